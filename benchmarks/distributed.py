"""Several ranks: a GPT-2 training step with parameters and optimizer states on NVMe, run
on 1 rank and on N ranks (torchrun, gloo, CPU), interleaved round by round.

    python3 benchmarks/distributed.py --models 124M --ranks 1,2 --rounds 2 --json docs/results/distributed.json

Every run trains on the same global batch (``--batch`` sequences, split evenly over the
ranks). Per rank it reports the step time (median of ``--steps`` after ``--warmup``), the
bytes its tiers hold on NVMe (``offload.stats``: slices of the parameters and their
optimizer states), the block-device bytes it reads and writes per step (/proc/self/io: the
disk as the kernel sees it, page cache defeated by O_DIRECT), its peak RSS, and the time its
collectives took (all-gathers of parameter groups, reduce-scatters of their gradients). The disk limit: the bytes all ranks
move per step over this disk's bandwidth (offload-profile's quick sweep of offload's file
engine on a 1 GiB test file, its sustained O_DIRECT read and write, measured here first), as a
lower bound on the step and its ratio to the measured step.

On one machine the ranks share its cores and its disk: N ranks are not N machines. What
the figures show is what one rank holds and moves (about 1/N of one process's bytes) and
what partitioning costs or saves in wall time on the same hardware.
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
from _common import SCRATCH_HELP, disk_bandwidth, saved_gpt2, scratch_dir  # noqa: E402
from _common import disk_io_bytes as disk_bytes  # noqa: E402

log = logging.getLogger("bench")
MODELS = {"124M": (12, 768, 12), "355M": (24, 1024, 16), "774M": (36, 1280, 20)}
BUDGETS = {"124M": ("256MiB", "1GiB"), "355M": ("512MiB", "3GiB"), "774M": ("768MiB", "4GiB")}


def worker(args) -> None:
    """One rank (or the single process) of a run; rank 0 prints the JSON of every rank."""
    import torch
    import torch.distributed as dist
    import transformers

    import offload

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    config = transformers.AutoConfig.from_pretrained(args.model_path)
    # no dropout: one rank and N ranks draw their masks differently, and the losses of the
    # runs are compared (they differ by float rounding only)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    swap = os.path.join(args.swap, "rank{rank}")
    os.makedirs(swap.format(rank=rank), exist_ok=True)
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget=args.device_budget, host_budget=args.host_budget,
                                io_backend="direct")
    model = offload.wrap(model, cfg, checkpoint=args.model_path)
    model.train()
    opt = offload.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    per = args.batch // world
    times, reads, writes, losses, gathers, reduces = [], [], [], [], [], []
    torch.manual_seed(0)
    for i in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)[rank * per: (rank + 1) * per]
        if world > 1:
            dist.barrier()  # every rank starts the step together
        before = offload.stats(model)
        reduce0 = opt.stats["reduce_seconds"]
        r0, w0 = disk_bytes()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i == args.warmup + args.steps - 1:
            opt.synchronize()  # the last step's write-backs count in it
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        dt = time.perf_counter() - t0
        r1, w1 = disk_bytes()
        after = offload.stats(model)
        losses.append(float(mean))
        if i >= args.warmup:
            times.append(dt)
            reads.append(r1 - r0)
            writes.append(w1 - w0)
            gathers.append(after["gather_seconds"] - before["gather_seconds"])
            reduces.append(opt.stats["reduce_seconds"] - reduce0)
    stats = offload.stats(model)
    mine = {"rank": rank, "step_s": statistics.median(times), "step_times_s": times,
            "read_bytes_per_step": statistics.median(reads), "write_bytes_per_step": statistics.median(writes),
            "gather_s_per_step": statistics.median(gathers), "reduce_s_per_step": statistics.median(reduces),
            "nvme_bytes": stats["nvme_bytes"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "losses": losses}
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    opt.close()
    offload.close(model)
    if rank == 0:
        print(json.dumps({"world": world, "ranks": everyone}))
    if world > 1:
        dist.destroy_process_group()


def run(world: int, path: str, name: str, args) -> dict | None:
    swap = tempfile.mkdtemp(prefix=f"dist-swap-{world}-", dir=args.path)
    device_budget, host_budget = BUDGETS[name]
    inner = [os.path.abspath(__file__), "--worker", "--model-path", path, "--swap", swap,
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
             "--seq", str(args.seq), "--device-budget", device_budget, "--host-budget", host_budget]
    if world == 1:
        cmd = [sys.executable, *inner]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *inner]
    log.info("%s on %d rank(s) ...", name, world)
    t = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(
            max(1, (os.cpu_count() or 1) // world))))
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if out.returncode != 0:
        log.warning("%d-rank run failed (exit %d):\n%s", world, out.returncode, out.stderr[-4000:])
        return None
    result = json.loads(out.stdout.strip().splitlines()[-1])
    log.info("  done in %.0f s: %.2f s/step (slowest rank)", time.perf_counter() - t,
             max(r["step_s"] for r in result["ranks"]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="124M", help=f"comma-separated GPT-2 sizes from {list(MODELS)} "
                        "(default 124M)")
    parser.add_argument("--ranks", default="1,2", help="comma-separated world sizes to run (default 1,2)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians are reported (2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    parser.add_argument("--batch", type=int, default=4, help="global batch, split over the ranks (4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument("--path", default=None, help="directory on the disk under test for the models (built "
                        "once, kept there for re-runs) and swap files "
                        f"(default: {SCRATCH_HELP.format(name='distributed')})")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--swap", help=argparse.SUPPRESS)
    parser.add_argument("--device-budget", help=argparse.SUPPRESS)
    parser.add_argument("--host-budget", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        logging.basicConfig(level=logging.WARNING)
        worker(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args.path = scratch_dir("distributed", args.path)
    worlds = [int(w) for w in args.ranks.split(",")]
    if any(args.batch % w for w in worlds):
        parser.error(f"--batch {args.batch} must split evenly over every world size in {worlds}")
    disk = disk_bandwidth(args.path, 1 << 30)
    write_gbps, read_gbps = disk["write_gbps"], disk["read_gbps"]
    log.info("disk (offload-profile's sustained figures): write %.2f GB/s, read %.2f GB/s", write_gbps, read_gbps)
    report = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
              "disk_write_gbps": write_gbps, "disk_read_gbps": read_gbps, "models": {}}
    for name in args.models.split(","):
        path = saved_gpt2(args.path, name, MODELS[name])
        runs: dict[int, list] = {w: [] for w in worlds}
        for _ in range(args.rounds):
            for world in worlds:
                result = run(world, path, name, args)
                if result is not None:
                    runs[world].append(result)
        entry = {"device_budget": BUDGETS[name][0], "host_budget": BUDGETS[name][1], "batch": args.batch,
                 "seq": args.seq, "worlds": {}}
        for world, results in runs.items():
            if not results:
                continue
            per_round = [max(r["step_s"] for r in res["ranks"]) for res in results]  # the slowest rank sets the pace
            ranks = [res["ranks"] for res in results]
            summary = {
                "step_s": statistics.median(per_round), "step_s_rounds": per_round,
                "tokens_per_s": args.batch * args.seq / statistics.median(per_round),
                "nvme_bytes_per_rank": [r["nvme_bytes"] for r in ranks[0]],
                "read_bytes_per_step_per_rank": [statistics.median(rr[i]["read_bytes_per_step"] for rr in ranks)
                                                 for i in range(world)],
                "write_bytes_per_step_per_rank": [statistics.median(rr[i]["write_bytes_per_step"] for rr in ranks)
                                                  for i in range(world)],
                "peak_rss_bytes_per_rank": [max(rr[i]["peak_rss_bytes"] for rr in ranks) for i in range(world)],
                "gather_s_per_step": [statistics.median(rr[i]["gather_s_per_step"] for rr in ranks)
                                      for i in range(world)],
                "reduce_s_per_step": [statistics.median(rr[i]["reduce_s_per_step"] for rr in ranks)
                                      for i in range(world)],
                "losses": ranks[0][0]["losses"],
            }
            moved_read = sum(summary["read_bytes_per_step_per_rank"])
            moved_write = sum(summary["write_bytes_per_step_per_rank"])
            bound = moved_read / (read_gbps * 1e9) + moved_write / (write_gbps * 1e9)
            summary["disk_bound_s"] = bound
            summary["disk_bound_ratio"] = bound / summary["step_s"]
            entry["worlds"][str(world)] = summary
        base = entry["worlds"].get("1")
        for world, summary in entry["worlds"].items():
            if base is not None and world != "1":
                summary["step_vs_1_rank"] = summary["step_s"] / base["step_s"]
                summary["nvme_bytes_vs_1_rank"] = max(summary["nvme_bytes_per_rank"]) / base["nvme_bytes_per_rank"][0]
                summary["max_loss_diff_vs_1_rank"] = max(abs(a - b) for a, b in zip(summary["losses"], base["losses"]))
        report["models"][name] = entry
        print_table(name, entry)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        log.info("wrote %s", args.json)


def print_table(name: str, entry: dict) -> None:
    gb = 1e9
    print(f"\nGPT-2 {name}, global batch {entry['batch']}x{entry['seq']}, NVMe tiers")
    print(f"{'ranks':>5} {'step s':>8} {'vs 1':>6} {'disk bound':>10} {'NVMe GB/rank':>13} {'read GB/rank':>13} "
          f"{'written GB/rank':>16} {'RSS GiB/rank':>13} {'gather s':>9} {'reduce s':>9}")
    for world, s in entry["worlds"].items():
        print(f"{world:>5} {s['step_s']:>8.2f} {s.get('step_vs_1_rank', 1.0):>6.2f} {s['disk_bound_ratio']:>10.2f} "
              f"{max(s['nvme_bytes_per_rank']) / gb:>13.2f} {max(s['read_bytes_per_step_per_rank']) / gb:>13.2f} "
              f"{max(s['write_bytes_per_step_per_rank']) / gb:>16.2f} "
              f"{max(s['peak_rss_bytes_per_rank']) / 2**30:>13.2f} {max(s['gather_s_per_step']):>9.2f} "
              f"{max(s['reduce_s_per_step']):>9.2f}")


if __name__ == "__main__":
    main()
