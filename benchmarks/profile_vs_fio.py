"""offload-profile against fio: is the profiler's best disk figure the disk's best?

Each round runs ``offload-profile --quick`` (a subprocess, timed wall-clock, with
``--json`` and ``--recommend``), then, right after it on the same directory, fio (libaio,
O_DIRECT, one job) over a grid of block sizes and queue depths, reading and writing a file
of the same size. fio's best read and write of the round are the yardstick: the profiler's
best figures are reported as a share of them, per round and as the median over rounds.
The recommended config is loaded with ``OffloadConfig.from_file`` each round.

fio reads first (it lays the file out) and then overwrites it, as the profiler's sweep
overwrites its test file; both fsync at the end of a write. fio runs with its buffers in
malloc'd memory (4 KiB pages) and, where hugetlb pages can be reserved (root: the script
reserves them and restores the count), in huge pages (``iomem=shmhuge``), as offload's
buffers are: on this VM that doubles fio's O_DIRECT reads (offload/profile/_fio.py).
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

from offload import OffloadConfig, parse_size
from offload.profile._fio import fio_available, remove, reserved_hugepages, run_fio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, profile_cli, scratch_dir  # noqa: E402

log = logging.getLogger("profile_vs_fio")

FIO_BLOCKS = (1 << 20, 4 << 20, 8 << 20, 16 << 20)
FIO_DEPTHS = (4, 16, 32)


def profile_round(path: str, size: str, workdir: str) -> dict:
    rec = os.path.join(workdir, "c.json")
    wall, data, table = profile_cli(path, size, os.path.join(workdir, "r.json"), "--recommend", rec)
    OffloadConfig.from_file(rec)  # the acceptance: the recommendation loads
    # the question here is the sweep's best against fio's best (the sustained figures the
    # recommendation uses are checked by benchmarks/profile_validate.py)
    return {"wall_s": wall, "read_gbps": data["disk_best_read"]["gbps"], "write_gbps": data["disk_best_write"]["gbps"],
            "best_read": data["disk_best_read"], "best_write": data["disk_best_write"],
            "engine_choice": data["engine_choice"], "table": table}


def fio_round(path: str, size: int, iomems: tuple[str, ...]) -> dict:
    filename = os.path.join(path, "fio-yardstick.bin")
    by_setting: dict[str, dict[str, float]] = {}
    try:
        for bs in FIO_BLOCKS:
            for depth in FIO_DEPTHS:
                for iomem in iomems:
                    key = f"{bs >> 20}MiB_qd{depth}_{iomem}"
                    by_setting[key] = {op: run_fio(filename, size, op, bs, depth, iomem=iomem)
                                       for op in ("read", "write")}
    finally:
        remove(filename)
    best = {op: max(by_setting.items(), key=lambda kv: kv[1][op]) for op in ("read", "write")}
    return {"by_setting": by_setting, **{f"{op}_gbps": best[op][1][op] for op in best},
            **{f"{op}_best": best[op][0] for op in best}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--path", default=None, help="directory on the disk to measure, which must allow "
                        "O_DIRECT (default: a directory made and removed under "
                        f"{SCRATCH_HELP.format(name='profile-vs-fio')})")
    parser.add_argument("--size", default="1GiB", help="the profiler's --size and fio's file size "
                        "(default 1GiB, as in the acceptance command)")
    parser.add_argument("--rounds", type=int, default=3, help="profile-then-fio rounds (default 3)")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not fio_available():
        sys.exit("fio is not installed: bash tools/setup.sh bench (or apt-get install fio)")
    size = parse_size(args.size, name="--size")
    path = args.path or tempfile.mkdtemp(prefix="offload-profile-bench-", dir=scratch_dir("profile-vs-fio"))
    try:
        rounds = measure(path, size, args)
    finally:
        if args.path is None:
            shutil.rmtree(path, ignore_errors=True)
    summary = {
        "size": size, "rounds": rounds,
        "profile_wall_s_max": max(r["profile"]["wall_s"] for r in rounds),
        "read_share_median": statistics.median(r["read_share"] for r in rounds),
        "write_share_median": statistics.median(r["write_share"] for r in rounds),
    }
    log.info("median share of fio's best: read %.2f, write %.2f; slowest profile %.1f s",
             summary["read_share_median"], summary["write_share_median"], summary["profile_wall_s_max"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)


def measure(path: str, size: int, args) -> list[dict]:
    """``--rounds`` rounds of offload-profile then fio on ``path``."""
    rounds = []
    hugepages = reserved_hugepages(max(FIO_BLOCKS) * max(FIO_DEPTHS) * 3 // 2)  # fio needs a little over
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.rounds):
            ours = profile_round(path, args.size, workdir)
            with hugepages:
                iomems = ("malloc", "shmhuge") if hugepages.ok else ("malloc",)
                if not hugepages.ok:
                    log.warning("no hugetlb pages (needs root): fio runs with malloc buffers only")
                fio = fio_round(path, size, iomems)
            row = {"profile": {k: v for k, v in ours.items() if k != "table"}, "fio": fio,
                   "read_share": ours["read_gbps"] / fio["read_gbps"],
                   "write_share": ours["write_gbps"] / fio["write_gbps"]}
            rounds.append(row)
            if i == 0:
                log.info("%s", ours["table"])
            log.info("round %d: offload-profile %.1f s wall; read %.2f GB/s (%s) vs fio %.2f (%s): %.2f; "
                     "write %.2f (%s) vs fio %.2f (%s): %.2f", i, ours["wall_s"], ours["read_gbps"],
                     _label(ours["best_read"]), fio["read_gbps"], fio["read_best"], row["read_share"],
                     ours["write_gbps"], _label(ours["best_write"]), fio["write_gbps"], fio["write_best"],
                     row["write_share"])
    return rounds


def _label(best: dict) -> str:
    return f"{best['block_size'] >> 20}MiB qd{best['queue_depth']} t{best['threads']}"


if __name__ == "__main__":
    main()
