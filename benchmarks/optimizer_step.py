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

The three in-memory modes (torch_fused, deepspeed, ours_host) are interleaved step by step:
each round builds the three optimizers, gives each ``--warmup`` untimed steps (state
creation, first-touch page faults, the kernel's own settling after fresh huge pages), then
times ``--steps`` steps of each in turn, the order rotated every step. This machine's
memory bandwidth drifts up to 2x within seconds, so optimizers timed one after the other
(a block each) compare the moments they ran in as much as themselves. When the three sets of
states do not fit in free memory next to each other, they run one after the other instead
(logged, and recorded as ``"interleaved": false`` in the round).
``memory_stream_s`` puts the step's memory traffic (28 bytes per parameter: parameter,
gradient and two moments read, parameter and moments written) at the bandwidth a
read-modify-write stream reaches in the same round (``addcmul_``, 16 bytes per element).
It is a reference, not a limit: the fused AdamW kernels stream faster than ``addcmul_``
here, so ``host_vs_memory_stream`` runs above 1.

This is the "offload only the optimizer" configuration: parameters and gradients stay in
memory, as they do for a model that fits but whose optimizer does not. The NVMe lower
bound is max(the disk's time for the step's bytes, the in-memory fused step time of the
same round). The disk's time is measured with offload's engine right before the run
(O_DIRECT, 64 MiB requests, 16 in flight; here rather than through offload-profile, which
measures one direction at a time) as the smaller of: the bytes read and then the
bytes written, and the same bytes read and written at once (the disk may serve the two
directions in parallel, and a pipelined step does that too; it did here, so a bound that
added the two directions would sit above what the step achieves).
``nvme_overlap_ratio`` = lower bound / measured step.
Each figure is the median of the timed steps of a round, and the reported figure the
median over rounds.
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

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, scratch_dir  # noqa: E402

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


def timed_step(opt) -> float:
    """Seconds of one step, write-backs to the tier included (offload's step returns with
    them in flight; ``synchronize()`` waits for them)."""
    started = time.perf_counter()
    opt.step()
    getattr(opt, "synchronize", lambda: None)()
    return time.perf_counter() - started


def time_steps(opt, steps: int, warmup: int) -> float:
    """Median seconds per step after ``warmup`` untimed steps."""
    for _ in range(warmup):
        timed_step(opt)
    return statistics.median(timed_step(opt) for _ in range(steps))


def memory_bandwidth(n: int) -> float:
    """Bytes per second of a read-modify-write stream over ``n`` fp32 elements per operand
    (``a.addcmul_(b, c)``: 16 bytes per element), the best of 3."""
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    a.addcmul_(b, c, value=1e-6)
    best = min(_seconds(lambda: a.addcmul_(b, c, value=1e-6)) for _ in range(3))
    return 16 * n / best


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


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


def make_optimizer(mode: str, params, args, swap_dir: str | None = None):
    """The optimizer ``mode`` names, or None when DeepSpeedCPUAdam is unavailable."""
    import offload

    if mode == "torch_fused":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    if mode == "deepspeed":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except Exception as err:  # not installed, or its op failed to build
            log.info("DeepSpeedCPUAdam unavailable: %s", err)
            return None
        return DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01, adamw_mode=True)
    if mode == "ours_host":
        return offload.AdamW(params, lr=1e-4, weight_decay=0.01)
    cfg = offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="nvme",
                                nvme_path=swap_dir, host_budget=args.host_budget)
    return offload.AdamW(params, lr=1e-4, weight_decay=0.01, config=cfg)


def dispose(opts) -> None:
    for opt in opts:
        if hasattr(opt, "close"):
            opt.close()
    gc.collect()


def run_mode(mode: str, params, args, swap_dir: str | None = None) -> float | None:
    """One optimizer built, warmed up and timed alone."""
    opt = make_optimizer(mode, params, args, swap_dir)
    if opt is None:
        return None
    try:
        return time_steps(opt, args.steps, args.warmup)
    finally:
        dispose([opt])


def run_interleaved(modes: list[str], params, args) -> dict[str, float | None]:
    """The in-memory ``modes`` timed step by step in turn (see the module's docstring)."""
    opts = {mode: make_optimizer(mode, params, args) for mode in modes}
    live = [m for m in modes if opts[m] is not None]
    try:
        for mode in live:
            for _ in range(args.warmup):
                timed_step(opts[mode])
        times: dict[str, list[float]] = {m: [] for m in live}
        for k in range(args.steps):
            for mode in live[k % len(live):] + live[: k % len(live)]:
                times[mode].append(timed_step(opts[mode]))
        return {m: statistics.median(times[m]) if m in times else None for m in modes}
    finally:
        live_opts = [o for o in opts.values() if o is not None]
        opts.clear()
        dispose(live_opts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--params", default="100M,300M", help="comma-separated parameter counts "
                        "(K/M/B suffixes; default 100M,300M; 1B needs ~16 GB of RAM for torch's states)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5); medians reported")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode per round (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer before its timed "
                        "ones (default 2)")
    parser.add_argument("--sequential", action="store_true", help="time the in-memory optimizers one after "
                        "the other (a block of steps each) instead of step by step in turn")
    parser.add_argument("--path", default=None, help="directory on the disk under test for the swap files and "
                        "the bandwidth files, all removed at the end (needs 16 bytes per parameter; default: "
                        f"{SCRATCH_HELP.format(name='optimizer-step')})")
    parser.add_argument("--host-budget", default="1GiB", help="offload's host_budget for the NVMe run "
                        "(bounds the shards in flight; default 1GiB)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = [int(float(s[:-1]) * {"K": 1e3, "M": 1e6, "B": 1e9}[s[-1].upper()]) if s[-1].isalpha() else int(s)
             for s in args.params.split(",")]
    args.path = scratch_dir("optimizer-step", args.path)
    try:
        report = measure(sizes, args)
    finally:
        for f in ("bw-read", "bw-write"):
            try:
                os.unlink(os.path.join(args.path, f))
            except FileNotFoundError:
                pass
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


def measure(sizes: list[int], args) -> dict:
    """Every size's rounds; the report."""
    host_modes = ["torch_fused"] + ([] if args.no_deepspeed else ["deepspeed"]) + ["ours_host"]
    modes = host_modes + ["ours_nvme"]
    report = {"threads": torch.get_num_threads(), "steps": args.steps, "warmup": args.warmup,
              "sequential": args.sequential, "sizes": []}
    for n in sizes:
        params = make_params(n)
        n = sum(p.numel() for p in params)
        rows = []
        # three sets of states (8 bytes per parameter each, 16 for ours with its padding slack)
        fits = psutil.virtual_memory().available > 1.2 * (8 * n * len(host_modes) + 16 * n)
        interleave = fits and not args.sequential
        if not fits and not args.sequential:
            log.info("%.0fM params: %d optimizers' states do not fit in free memory together; timing them "
                     "one after the other", n / 1e6, len(host_modes))
        for r in range(args.rounds):
            row = {"interleaved": interleave}
            row["memory_stream_s"] = 28 * n / memory_bandwidth(n)
            if interleave:
                row.update(run_interleaved(host_modes, params, args))
            else:
                for mode in host_modes:
                    row[mode] = run_mode(mode, params, args)
            row["disk"] = disk_seconds(8 * n, 8 * n, args.path)
            # the disk's own time for these bytes: one direction after the other, or
            # both at once, whichever it did faster (an overlapped step may do the same)
            row["io_lower_s"] = min(row["disk"]["read_s"] + row["disk"]["write_s"], row["disk"]["both_s"])
            swap = tempfile.mkdtemp(dir=args.path)
            row["ours_nvme"] = run_mode("ours_nvme", params, args, swap)
            shutil.rmtree(swap, ignore_errors=True)
            for mode in modes:
                if row[mode] is not None:
                    log.info("%s params, round %d: %-12s %.3f s/step (%.2f G params/s)", f"{n/1e6:.0f}M", r,
                             mode, row[mode], n / row[mode] / 1e9)
            log.info("  memory: %.3f s for the step's 28 bytes per parameter at addcmul_'s bandwidth "
                     "(ours host takes %.0f%% of that time)",
                     row["memory_stream_s"], 100 * row["ours_host"] / row["memory_stream_s"])
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
            "memory_stream_s": med("memory_stream_s"),
            "host_vs_memory_stream": statistics.median(r["memory_stream_s"] / r["ours_host"] for r in rows),
            "torch_fused_vs_memory_stream": statistics.median(r["memory_stream_s"] / r["torch_fused"] for r in rows),
        }
        report["sizes"].append(entry)
        del params
        gc.collect()
        log.info("")
        log.info("%.0fM params: torch fused %.2f G/s, deepspeed %s, ours host %.2f G/s (%.2fx torch, %s DeepSpeed, "
                 "%.2fx a memory stream); ours nvme %.2f s/step, lower bound %.2f s, overlap ratio %.2f", n / 1e6,
                 entry["torch_fused_params_per_s"] / 1e9,
                 f"{entry['deepspeed_params_per_s'] / 1e9:.2f} G/s" if entry["deepspeed_params_per_s"] else "n/a",
                 entry["host_params_per_s"] / 1e9, entry["host_vs_torch_fused"],
                 f"{entry['host_vs_deepspeed']:.2f}x" if entry["host_vs_deepspeed"] else "n/a",
                 entry["host_vs_memory_stream"], entry["nvme_step_s"], entry["nvme_lower_bound_s"], entry["nvme_overlap_ratio"])
    # the top-level keys are those of the largest size
    top = report["sizes"][-1]
    for key in ("host_params_per_s", "torch_fused_params_per_s", "deepspeed_params_per_s", "nvme_step_s",
                "nvme_lower_bound_s", "nvme_overlap_ratio"):
        report[key] = top[key]
    return report


if __name__ == "__main__":
    sys.exit(main())
