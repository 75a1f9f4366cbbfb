"""Optimizer step time: offload.AdamW with states in host memory and on NVMe, against torch.

    python benchmarks/optimizer_step.py --params 100M,300M --rounds 5 --json optimizer.json

For each size, a model-like set of fp32 parameters (tensors of 1-16M elements) with random
gradients lives in memory, and these are timed, interleaved round by round:

  torch_fused   torch.optim.AdamW(fused=True) on in-memory tensors (states in RAM);
  deepspeed     DeepSpeedCPUAdam (adamw_mode) when deepspeed is importable;
  ours_host     offload.AdamW with optimizer_tier="host": exp_avg and exp_avg_sq in the
                store's host memory, updated shard by shard with torch's fused kernel;
  ours_nvme     offload.AdamW with optimizer_tier="nvme": exp_avg and exp_avg_sq in swap
                files (8 bytes per parameter read and 8 written each step, O_DIRECT, so
                the page cache does not serve them), the step pipelined over shards.

This is the "offload only the optimizer" configuration: parameters and gradients stay in
memory, as they do for a model that fits but whose optimizer does not. The NVMe lower
bound is max(the disk's time for the step's bytes, the in-memory fused step time of the
same round). The disk's time is measured with offload's engine right before the run
(O_DIRECT, 64 MiB requests, 16 in flight) as the smaller of: the bytes read and then the
bytes written, and the same bytes read and written at once (the disk may serve the two
directions in parallel, and a pipelined step does that too; it did here, so a bound that
added the two directions would sit above what the step achieves).
``nvme_overlap_ratio`` = lower bound / measured step.
Each figure is the median of the timed steps of a round (after one untimed step), and the
reported figure the median over rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

log = logging.getLogger("optimizer_step")


def make_params(n: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """About ``n`` fp32 parameters in tensors of a transformer's sizes (16M down to 1M)."""
    g = torch.Generator().manual_seed(seed)
    sizes, left = [], n
    pattern = [16 << 20, 4 << 20, 4 << 20, 12 << 20, 1 << 20]
    i = 0
    while left > 0:
        s = min(pattern[i % len(pattern)], left)
        sizes.append(s)
        left -= s
        i += 1
    params = []
    for s in sizes:
        p = torch.nn.Parameter(torch.empty(s).uniform_(-0.05, 0.05, generator=g))
        p.grad = torch.empty(s).normal_(0, 1e-3, generator=g)
        params.append(p)
    return params


def time_steps(opt, steps: int) -> float:
    """Median seconds per step, write-backs to the tier included (offload's step returns
    with them in flight; ``synchronize()`` waits for them)."""
    sync = getattr(opt, "synchronize", lambda: None)
    opt.step()  # untimed: state initialisation, first-touch page faults
    sync()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def disk_seconds(read_bytes: int, write_bytes: int, directory: str) -> dict:
    """This disk's time to read ``read_bytes`` and to write ``write_bytes``: each alone
    (the lower bound's terms), and both at once (for reference). O_DIRECT, offload's
    engine, 64 MiB requests, 16 in flight per direction (1 GiB, as deep as the
    optimizer's own pipeline gets)."""
    from offload.io import FileEngine, HostBuffer

    chunk, depth = 64 << 20, 16
    src, dst = os.path.join(directory, "bw-read"), os.path.join(directory, "bw-write")
    out = {}
    with FileEngine() as engine:
        f = engine.open(src, create=True)
        w = engine.open(dst, create=True)
        wbuf = HostBuffer(chunk)
        wbuf.bytes.random_(0, 255)
        rbufs = [HostBuffer(chunk) for _ in range(depth)]
        if os.path.getsize(src) < read_bytes:  # written once per run, then only read
            for h in [engine.write(f, off, wbuf, min(chunk, read_bytes - off)) for off in range(0, read_bytes, chunk)]:
                h.wait()

        def run(do_read: bool, do_write: bool) -> float:
            started = time.perf_counter()
            reads, writes = [], []
            roffs = list(range(0, read_bytes, chunk)) if do_read else []
            woffs = list(range(0, write_bytes, chunk)) if do_write else []
            for i in range(max(len(roffs), len(woffs))):
                if i < len(roffs):
                    if len(reads) == depth:
                        reads.pop(0).wait()
                    reads.append(engine.read(f, roffs[i], rbufs[i % depth], min(chunk, read_bytes - roffs[i])))
                if i < len(woffs):
                    if len(writes) == depth:
                        writes.pop(0).wait()
                    writes.append(engine.write(w, woffs[i], wbuf, min(chunk, write_bytes - woffs[i])))
            for h in reads + writes:
                h.wait()
            return time.perf_counter() - started

        out["read_s"] = run(True, False)
        out["write_s"] = run(False, True)
        out["both_s"] = run(True, True)
        engine.close_file(f)
        engine.close_file(w)
    os.unlink(dst)
    return out


def run_mode(mode: str, params, args, swap_dir: str) -> float | None:
    import offload

    if mode == "torch_fused":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    elif mode == "deepspeed":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except Exception as err:  # not installed, or its op failed to build
            log.info("DeepSpeedCPUAdam unavailable: %s", err)
            return None
        opt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01, adamw_mode=True)
    elif mode == "ours_host":
        opt = offload.AdamW(params, lr=1e-4, weight_decay=0.01)
    else:
        cfg = offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="nvme",
                                    nvme_path=swap_dir, host_budget=args.host_budget)
        opt = offload.AdamW(params, lr=1e-4, weight_decay=0.01, config=cfg)
    try:
        return time_steps(opt, args.steps)
    finally:
        if hasattr(opt, "close"):
            opt.close()
        del opt
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--params", default="100M,300M", help="comma-separated parameter counts "
                        "(K/M/B suffixes; default 100M,300M; 1B needs ~16 GB of RAM for torch's states)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5); medians reported")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode per round (default 3)")
    parser.add_argument("--path", default="/var/tmp/offload-optim", help="directory on the disk under test "
                        "for the swap files (needs 8 bytes per parameter, plus as much for the bandwidth file)")
    parser.add_argument("--host-budget", default="1GiB", help="offload's host_budget for the NVMe run "
                        "(bounds the shards in flight; default 1GiB)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = [int(float(s[:-1]) * {"K": 1e3, "M": 1e6, "B": 1e9}[s[-1].upper()]) if s[-1].isalpha() else int(s)
             for s in args.params.split(",")]
    os.makedirs(args.path, exist_ok=True)
    modes = ["torch_fused"] + ([] if args.no_deepspeed else ["deepspeed"]) + ["ours_host", "ours_nvme"]
    report = {"threads": torch.get_num_threads(), "sizes": []}
    for n in sizes:
        params = make_params(n)
        n = sum(p.numel() for p in params)
        rows = []
        for r in range(args.rounds):
            row = {}
            for mode in modes:
                if mode == "ours_nvme":
                    row["disk"] = disk_seconds(8 * n, 8 * n, args.path)
                    # the disk's own time for these bytes: one direction after the other, or
                    # both at once, whichever it did faster (an overlapped step may do the same)
                    row["io_lower_s"] = min(row["disk"]["read_s"] + row["disk"]["write_s"], row["disk"]["both_s"])
                swap = tempfile.mkdtemp(dir=args.path)
                row[mode] = run_mode(mode, params, args, swap)
                shutil.rmtree(swap, ignore_errors=True)
                if row[mode] is not None:
                    log.info("%s params, round %d: %-12s %.3f s/step (%.2f G params/s)", f"{n/1e6:.0f}M", r,
                             mode, row[mode], n / row[mode] / 1e9)
            row["nvme_lower_bound_s"] = max(row["io_lower_s"], row["torch_fused"])
            d = row["disk"]
            log.info("  disk: read %.2f GB in %.2f s (%.2f GB/s), write in %.2f s (%.2f GB/s), both at once "
                     "%.2f s; lower bound %.3f s", 8 * n / 1e9, d["read_s"], 8 * n / d["read_s"] / 1e9,
                     d["write_s"], 8 * n / d["write_s"] / 1e9, d["both_s"], row["nvme_lower_bound_s"])
            rows.append(row)
        med = lambda key: statistics.median(r[key] for r in rows) if rows[0].get(key) is not None else None  # noqa: E731
        entry = {
            "params": n, "rounds": rows,
            "torch_fused_params_per_s": n / med("torch_fused"),
            "deepspeed_params_per_s": n / med("deepspeed") if med("deepspeed") else None,
            "host_params_per_s": n / med("ours_host"),
            "nvme_step_s": med("ours_nvme"),
            "nvme_lower_bound_s": med("nvme_lower_bound_s"),
            "nvme_overlap_ratio": statistics.median(r["nvme_lower_bound_s"] / r["ours_nvme"] for r in rows),
            "host_vs_torch_fused": statistics.median(r["torch_fused"] / r["ours_host"] for r in rows),
            "host_vs_deepspeed": (statistics.median(r["deepspeed"] / r["ours_host"] for r in rows)
                                  if med("deepspeed") else None),
        }
        report["sizes"].append(entry)
        del params
        gc.collect()
        log.info("")
        log.info("%.0fM params: torch fused %.2f G/s, deepspeed %s, ours host %.2f G/s (%.2fx torch, %s DeepSpeed); "
                 "ours nvme %.2f s/step, lower bound %.2f s, overlap ratio %.2f", n / 1e6,
                 entry["torch_fused_params_per_s"] / 1e9,
                 f"{entry['deepspeed_params_per_s'] / 1e9:.2f} G/s" if entry["deepspeed_params_per_s"] else "n/a",
                 entry["host_params_per_s"] / 1e9, entry["host_vs_torch_fused"],
                 f"{entry['host_vs_deepspeed']:.2f}x" if entry["host_vs_deepspeed"] else "n/a",
                 entry["nvme_step_s"], entry["nvme_lower_bound_s"], entry["nvme_overlap_ratio"])
    # the top-level keys are those of the largest size
    top = report["sizes"][-1]
    for key in ("host_params_per_s", "torch_fused_params_per_s", "deepspeed_params_per_s", "nvme_step_s",
                "nvme_lower_bound_s", "nvme_overlap_ratio"):
        report[key] = top[key]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    for f in ("bw-read",):
        try:
            os.unlink(os.path.join(args.path, f))
        except FileNotFoundError:
            pass


if __name__ == "__main__":
    sys.exit(main())
