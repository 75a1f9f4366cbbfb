"""Does offload-profile predict what the runtime sees? Its figures against the store and fio.

    python benchmarks/profile_validate.py --rounds 3 --json profile_validate.json

Each round, on the same directory and one after another:
  1. ``offload-profile --quick --size SIZE --validate STORE_SIZE`` (a subprocess, timed
     wall-clock): the profile, then its own validation, offload's store moving STORE_SIZE
     of distinct 32 MiB tensors with the setting the profile chose;
  2. ``benchmarks/store_bandwidth.py``'s worker (offload's store with its default settings,
     in a fresh process): STORE_SIZE of distinct tensors written to fresh extents, written
     again, read back;
  3. fio (libaio, O_DIRECT, one job), 1 and 8 MiB blocks at depths 8 and 32, STORE_SIZE
     each, with 4 KiB-page buffers and (where hugetlb pages can be reserved) huge-page
     buffers as offload's are, the better of the two per setting: first writes run first
     in the round, each on a new file (fresh extents); reads and then overwrites of the
     file the last first write left run last, so that the profile, its validation and the
     store moved many GB in between (a re-read of just-written bytes is what a virtual
     disk's host cache would serve).
Printed per round and as medians: the profile's recommended read and write figures (the
sustained ones) over the store's read and overwrite in both runs, the first-write figure
over the store's first write, and where the profile's figures fall in the range of fio's.
Rounds are interleaved because this disk drifts by up to 2x within minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile

from offload import parse_size
from offload.profile._fio import fio_available, remove, reserved_hugepages, run_fio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, profile_cli, run_json_worker, scratch_dir  # noqa: E402

log = logging.getLogger("profile_validate")
HERE = os.path.dirname(os.path.abspath(__file__))
# profile figure -> the store's figure for the same kind of transfer
PAIRS = (("read", "read"), ("write", "overwrite"), ("first_write", "write"))


def profile_round(path: str, size: str, store_size: str, workdir: str) -> dict:
    wall, data, table = profile_cli(path, size, os.path.join(workdir, "r.json"), "--no-cache",
                                    "--validate", store_size)
    keep = ("disk_read_gbps", "disk_write_gbps", "disk_first_write_gbps", "disk_read_spread",
            "disk_write_spread", "disk_read_burst_gbps", "disk_write_burst_gbps", "disk_first_write_burst_gbps",
            "disk_cached_read_gbps", "disk_cached_write_gbps", "disk_best_read", "disk_best_write",
            "engine_choice", "validation", "elapsed_s")
    return {"wall_s": wall, **{k: data.get(k) for k in keep}, "table": table}


def store_round(path: str, store_size: int) -> dict | None:
    swap = os.path.join(path, "store")
    cmd = [sys.executable, os.path.join(HERE, "store_bandwidth.py"), "--worker", "ours", "--path", swap,
           "--size", str(store_size), "--host-budget", "384MiB", "--device-budget", "256MiB"]
    try:
        return run_json_worker(cmd, "store_bandwidth ours")
    finally:
        shutil.rmtree(swap, ignore_errors=True)


FIO_CONFIGS = ((1 << 20, 8), (1 << 20, 32), (8 << 20, 8), (8 << 20, 32))


def fio_round(path: str, store_size: int, kind: str, iomems: tuple[str, ...]) -> dict:
    """fio's jobs of one ``kind`` in the round: ``first_write`` each on a new file (fresh
    extents), ``read`` and ``overwrite`` of the file the first writes left; each setting
    with every buffer kind in ``iomems`` (its best counts: with 4 KiB pages fio reads about
    half as fast here as with huge pages, which offload's buffers are)."""
    filename = os.path.join(path, "fio.bin")
    out = {}
    for bs, depth in FIO_CONFIGS:
        figures = []
        for iomem in iomems:
            if kind == "first_write":
                remove(filename)
            figures.append(run_fio(filename, store_size, "read" if kind == "read" else "write", bs, depth,
                                   iomem=iomem))
        out[f"{kind}_{bs >> 20}MiB_qd{depth}"] = max(figures)
    return out


def compare(profile: dict, store: dict | None, fio: dict) -> dict:
    row: dict = {}
    v = profile["validation"]
    for ours, theirs in PAIRS:
        predicted = profile[f"disk_{ours}_gbps"]
        row[f"{ours}_vs_validate"] = predicted / v[f"{ours}_gbps"]
        if store:
            row[f"{ours}_vs_store"] = predicted / store[f"{theirs}_gbps"]
    for ours, kind in (("read", "read"), ("write", "overwrite"), ("first_write", "first_write")):
        figures = [g for k, g in fio.items() if k.startswith(kind)]
        if figures:
            row[f"fio_{kind}_min"], row[f"fio_{kind}_max"] = min(figures), max(figures)
            row[f"{ours}_within_fio"] = min(figures) <= profile[f"disk_{ours}_gbps"] <= max(figures)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--path", default=None, help="directory on the disk to measure, which must allow "
                        f"O_DIRECT (default: a directory made and removed under "
                        f"{SCRATCH_HELP.format(name='profile-validate')})")
    parser.add_argument("--size", default="12GiB", help="the profile's --size (default 12GiB, its default)")
    parser.add_argument("--store-size", default="6GiB", help="bytes of distinct tensors the store and fio "
                        "move per round, and the profile's --validate (default 6GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--no-fio", action="store_true", help="skip fio even if installed")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    use_fio = not args.no_fio and fio_available()
    if not use_fio and not args.no_fio:
        log.warning("fio is not installed (bash tools/setup.sh bench): no fio range")
    store_size = parse_size(args.store_size, name="--store-size")
    path = args.path or tempfile.mkdtemp(prefix="offload-profile-validate-", dir=scratch_dir("profile-validate"))
    rounds = []
    hugepages = reserved_hugepages(max(b * d for b, d in FIO_CONFIGS) * 3 // 2 if use_fio else 0)
    try:
        with tempfile.TemporaryDirectory() as workdir, hugepages:
            iomems = ("malloc", "shmhuge") if hugepages.ok else ("malloc",)
            if use_fio and not hugepages.ok:
                log.warning("no hugetlb pages (needs root): fio runs with 4 KiB-page buffers only")
            for i in range(args.rounds):
                fio = fio_round(path, store_size, "first_write", iomems) if use_fio else {}
                profile = profile_round(path, args.size, args.store_size, workdir)
                store = store_round(path, store_size)
                if use_fio:
                    for kind in ("read", "overwrite"):
                        fio.update(fio_round(path, store_size, kind, iomems))
                    remove(os.path.join(path, "fio.bin"))
                row = {"profile": {k: v for k, v in profile.items() if k != "table"}, "store": store, "fio": fio,
                       **compare(profile, store, fio)}
                rounds.append(row)
                if i == 0:
                    log.info("%s", profile["table"])
                _log_round(i, row)
                if args.json:
                    _write(args.json, args, rounds)
    finally:
        if args.path is None:
            shutil.rmtree(path, ignore_errors=True)
    summary = _write(args.json, args, rounds) if args.json else _summary(args, rounds)
    log.info("medians over %d rounds: %s", len(rounds),
             ", ".join(f"{k} {v:.2f}" for k, v in summary["medians"].items()))


def _log_round(i: int, row: dict) -> None:
    p, v, s = row["profile"], row["profile"]["validation"], row["store"] or {}
    log.info("round %d: profile %.0f s wall; read %.2f GB/s (validate %.2f, store %s); write %.2f (validate "
             "overwrite %.2f, store %s); first write %.2f (validate %.2f, store %s); cached read %.2f, write %.2f; "
             "fio read %s, overwrite %s, first write %s", i, p["wall_s"], p["disk_read_gbps"], v["read_gbps"],
             _g(s.get("read_gbps")), p["disk_write_gbps"], v["write_gbps"], _g(s.get("overwrite_gbps")),
             p["disk_first_write_gbps"], v["first_write_gbps"], _g(s.get("write_gbps")), p["disk_cached_read_gbps"],
             p["disk_cached_write_gbps"], _range(row, "read"), _range(row, "overwrite"), _range(row, "first_write"))


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _range(row: dict, op: str) -> str:
    return f"{row[f'fio_{op}_min']:.2f}-{row[f'fio_{op}_max']:.2f}" if f"fio_{op}_min" in row else "-"


def _summary(args: argparse.Namespace, rounds: list[dict]) -> dict:
    keys = [k for k in rounds[0] if k.endswith(("_vs_validate", "_vs_store"))]
    medians = {k: statistics.median(r[k] for r in rounds if k in r) for k in keys}
    medians["profile_wall_s_max"] = max(r["profile"]["wall_s"] for r in rounds)
    return {"size": args.size, "store_size": args.store_size, "rounds": rounds, "medians": medians}


def _write(path: str, args: argparse.Namespace, rounds: list[dict]) -> dict:
    summary = _summary(args, rounds)
    with open(path, "w") as fh:
        json.dump(summary, fh, indent=2)
    return summary


if __name__ == "__main__":
    main()
