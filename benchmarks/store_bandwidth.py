"""NVMe tier bandwidth: offload's store against fio and DeepSpeed's aio, interleaved.

    python benchmarks/store_bandwidth.py --size 4GiB --json bw.json

Each round writes ``--size`` bytes through offload's NVMe tier (``put`` of 32 MiB tensors,
default settings; fresh extents, then a rewrite of the same tensors) and reads them back into the compute tier (``fetch`` / ``wait`` /
``evict``, as the parameter prefetcher does), then runs the same transfers with fio
(O_DIRECT, libaio, 1 MiB and 8 MiB blocks, iodepth 8 and 32; each write job on a
fresh file, as ours) and, when its async_io op
loads, with DeepSpeed's aio handle. Rounds are interleaved because this disk drifts by up
to 2x within minutes; the figures reported are medians over rounds, and the ratios are
ours over fio's best configuration (best by median). Every engine runs in its own
process, so each peak RSS is that engine's alone. All reads are O_DIRECT: the page cache
serves none of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, run_json_worker, scratch_dir  # noqa: E402

log = logging.getLogger("store_bandwidth")
CHUNK = 32 << 20  # bytes per stored tensor: a transformer layer group of a ~1B-parameter model
FIO_CONFIGS = [("1M", 8), ("1M", 32), ("8M", 8), ("8M", 32)]


# ---------------------------------------------------------------------------------------
# workers (each runs in a fresh process and prints one JSON line)
# ---------------------------------------------------------------------------------------
def worker_ours(path: str, size: int, host_budget: str, device_budget: str) -> dict:
    import torch

    from offload.store import Tier, create_store

    nchunks = size // CHUNK
    source = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8)
    io = json.loads(os.environ.get("OFFLOAD_BENCH_IO", "{}"))  # for sweeps; default settings otherwise
    with create_store(device="cpu", nvme_path=path, device_budget=device_budget,
                      host_budget=host_budget, **io) as store:
        keys = [f"chunk{i}" for i in range(nchunks)]
        started = time.perf_counter()
        for key in keys:
            store.put(key, source, Tier.NVME)  # waits for staging room as writes complete
        for key in keys:
            store.wait(key, Tier.NVME)
        write_s = time.perf_counter() - started

        # the steady state of training: the same tensors written again, into the same extents
        started = time.perf_counter()
        for key in keys:
            store.put(key, source, Tier.NVME)
        for key in keys:
            store.wait(key, Tier.NVME)
        overwrite_s = time.perf_counter() - started

        started = time.perf_counter()
        ahead = store.tiers[Tier.DEVICE].budget // CHUNK  # fetches in flight, as a prefetcher keeps
        for key in keys[:ahead]:
            store.fetch(key, Tier.DEVICE)
        for i, key in enumerate(keys):
            store.wait(key, Tier.DEVICE)
            store.evict(key, Tier.DEVICE)
            if i + ahead < nchunks:
                store.fetch(keys[i + ahead], Tier.DEVICE)
        read_s = time.perf_counter() - started
        check = store.wait(keys[-1], Tier.DEVICE)
        if not torch.equal(check, source):
            raise RuntimeError("read-back bytes differ from what was written")
        stats = store.stats()
    moved = nchunks * CHUNK
    return {"write_gbps": moved / write_s / 1e9, "overwrite_gbps": moved / overwrite_s / 1e9,
            "read_gbps": moved / read_s / 1e9, "peak_rss_bytes": _peak_rss(), "nvme_read_bytes": stats["nvme"]["read_bytes"],
            "nvme_write_bytes": stats["nvme"]["write_bytes"]}


def worker_deepspeed(path: str, size: int, *_: str) -> dict:
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = AsyncIOBuilder().load(verbose=False)
    handle = aio.aio_handle(1 << 20, 32, False, True, 2)  # DeepSpeed's documented good settings
    nchunks = size // CHUNK
    buffers = [handle.new_cpu_locked_tensor(CHUNK, torch.empty(0, dtype=torch.uint8)) for _ in range(4)]
    for b in buffers:
        b.copy_(torch.randint(0, 256, (CHUNK,), dtype=torch.uint8))
    filename = os.path.join(path, "deepspeed.bin")

    def timed(submit) -> float:  # 4 chunks in flight, then wait: DeepSpeed's swap pattern
        started = time.perf_counter()
        for i in range(0, nchunks, len(buffers)):
            for j, buf in enumerate(buffers[: nchunks - i]):
                submit(buf, filename, (i + j) * CHUNK)
            handle.wait()
        return time.perf_counter() - started

    write_s = timed(handle.async_pwrite)
    read_s = timed(handle.async_pread)
    os.unlink(filename)
    moved = nchunks * CHUNK
    return {"write_gbps": moved / write_s / 1e9, "read_gbps": moved / read_s / 1e9,
            "peak_rss_bytes": _peak_rss()}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------
def run_worker(name: str, path: str, size: int, args: argparse.Namespace) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--path", path, "--size", str(size),
           "--host-budget", args.host_budget, "--device-budget", args.device_budget]
    return run_json_worker(cmd, name)


def run_fio(path: str, size: int, rw: str, bs: str, depth: int) -> float:
    filename = os.path.join(path, "fio.bin")
    if rw == "write" and os.path.exists(filename):
        os.unlink(filename)  # a fresh file each time, as offload's store writes fresh extents
    cmd = ["fio", "--name=bw", f"--filename={filename}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={depth}", "--ioengine=libaio", "--direct=1", f"--size={size}",
           "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout)["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def deepspeed_available() -> bool:
    code = "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=900).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--size", default="4GiB", help="bytes written and read per engine per round "
                        "(default 4GiB; rounded down to 32 MiB)")
    parser.add_argument("--path", default=None, help="directory on the disk to measure, which must allow "
                        "O_DIRECT for a fair figure (default: a directory made and removed under "
                        f"{SCRATCH_HELP.format(name='store-bandwidth')})")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3); the "
                        "medians are reported")
    parser.add_argument("--host-budget", default="384MiB", help="offload's host budget: staging "
                        "buffers for writes (default 384MiB: 12 tensors in flight)")
    parser.add_argument("--device-budget", default="256MiB", help="offload's compute-tier budget: "
                        "reads in flight ahead of use (default 256MiB: 8 tensors)")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    parser.add_argument("--no-fio", action="store_true", help="skip fio even if installed")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even if installed")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from offload import format_size, parse_size

    size = parse_size(args.size, name="--size") // CHUNK * CHUNK
    if size == 0:
        parser.error(f"--size {args.size} is below one 32 MiB chunk")
    if args.worker:
        result = {"ours": worker_ours, "deepspeed": worker_deepspeed}[args.worker](
            args.path, size, args.host_budget, args.device_budget)
        print(json.dumps(result))
        return

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    base = args.path or tempfile.mkdtemp(prefix="offload-bench-", dir=scratch_dir("store-bandwidth"))
    os.makedirs(base, exist_ok=True)
    free = shutil.disk_usage(base).free
    if free < 2 * size:
        parser.error(f"{base} has {format_size(free)} free; --size {format_size(size)} needs twice that")
    use_fio = not args.no_fio and shutil.which("fio") is not None
    use_ds = not args.no_deepspeed and deepspeed_available()
    if not use_fio:
        log.info("fio: skipped (%s)", "--no-fio" if args.no_fio else "not installed: apt-get install fio")
    if not use_ds:
        log.info("DeepSpeed aio: skipped (%s)", "--no-deepspeed" if args.no_deepspeed
                 else "not importable: tools/setup.sh peers")

    rounds: list[dict] = []
    try:
        for r in range(args.rounds):
            row: dict = {"round": r}
            row["ours"] = run_worker("ours", os.path.join(base, "ours"), size, args)
            if use_fio:
                for bs, depth in FIO_CONFIGS:
                    row[f"fio_write_{bs}_qd{depth}"] = run_fio(base, size, "write", bs, depth)
                    row[f"fio_read_{bs}_qd{depth}"] = run_fio(base, size, "read", bs, depth)
                os.unlink(os.path.join(base, "fio.bin"))
            if use_ds:
                row["deepspeed"] = run_worker("deepspeed", base, size, args)
            rounds.append(row)
            log.info("round %d: ours write %.2f rewrite %.2f read %.2f GB/s%s", r,
                     row["ours"]["write_gbps"], row["ours"]["overwrite_gbps"], row["ours"]["read_gbps"],
                     "".join(f" | fio {k[4:]} {v:.2f}" for k, v in row.items() if k.startswith("fio_")))
    finally:
        if args.path is None:
            shutil.rmtree(base, ignore_errors=True)
    report = summarize(rounds, size, use_fio, use_ds)
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


def summarize(rounds: list[dict], size: int, use_fio: bool, use_ds: bool) -> dict:
    med = statistics.median
    report: dict = {
        "size_bytes": size, "rounds": len(rounds),
        "read_gbps": med(r["ours"]["read_gbps"] for r in rounds),
        "write_gbps": med(r["ours"]["write_gbps"] for r in rounds),
        "overwrite_gbps": med(r["ours"]["overwrite_gbps"] for r in rounds),
        "ours_peak_rss_bytes": max(r["ours"]["peak_rss_bytes"] for r in rounds),
        "fio_read_gbps": None, "fio_write_gbps": None, "read_ratio": None, "write_ratio": None,
        "deepspeed_read_gbps": None, "deepspeed_write_gbps": None,
        "read_ratio_vs_deepspeed": None, "write_ratio_vs_deepspeed": None,
        "per_round": rounds,
    }
    if use_fio:
        for op in ("read", "write"):
            by_config = {f"{bs}_qd{d}": med(r[f"fio_{op}_{bs}_qd{d}"] for r in rounds) for bs, d in FIO_CONFIGS}
            best = max(by_config, key=by_config.get)
            report[f"fio_{op}_gbps"] = by_config[best]
            report[f"fio_{op}_best_config"] = best
            report[f"fio_{op}_by_config"] = by_config
            report[f"{op}_ratio"] = report[f"{op}_gbps"] / by_config[best]
    if use_ds:
        for op in ("read", "write"):
            report[f"deepspeed_{op}_gbps"] = med(r["deepspeed"][f"{op}_gbps"] for r in rounds)
            report[f"{op}_ratio_vs_deepspeed"] = report[f"{op}_gbps"] / report[f"deepspeed_{op}_gbps"]
        report["deepspeed_peak_rss_bytes"] = max(r["deepspeed"]["peak_rss_bytes"] for r in rounds)
    return report


def print_report(rep: dict) -> None:
    def fmt(x, unit=" GB/s"):
        return "n/a" if x is None else f"{x:.2f}{unit}"

    log.info("")
    log.info("NVMe tier, %d rounds of %.1f GiB each way (medians)", rep["rounds"], rep["size_bytes"] / 2**30)
    log.info("%-28s %12s %12s", "", "write", "read")
    log.info("%-28s %12s %12s", "offload store", fmt(rep["write_gbps"]), fmt(rep["read_gbps"]))
    log.info("%-28s %12s", "  rewrite of the same tensors", fmt(rep["overwrite_gbps"]))
    if rep["fio_read_gbps"] is not None:
        log.info("%-28s %12s %12s", "fio best (libaio, direct)", fmt(rep["fio_write_gbps"]), fmt(rep["fio_read_gbps"]))
        log.info("%-28s %12s %12s", "  best config", rep["fio_write_best_config"], rep["fio_read_best_config"])
        log.info("%-28s %12s %12s", "ours / fio best", fmt(rep["write_ratio"], "x"), fmt(rep["read_ratio"], "x"))
    if rep["deepspeed_read_gbps"] is not None:
        log.info("%-28s %12s %12s", "DeepSpeed aio", fmt(rep["deepspeed_write_gbps"]), fmt(rep["deepspeed_read_gbps"]))
        log.info("%-28s %12s %12s", "ours / DeepSpeed", fmt(rep["write_ratio_vs_deepspeed"], "x"),
                 fmt(rep["read_ratio_vs_deepspeed"], "x"))
    log.info("peak RSS of the offload process: %.0f MiB", rep["ours_peak_rss_bytes"] / 2**20)
    if rep.get("deepspeed_peak_rss_bytes"):
        log.info("peak RSS of the DeepSpeed process: %.0f MiB", rep["deepspeed_peak_rss_bytes"] / 2**20)


if __name__ == "__main__":
    main()
