"""Optimizer step of a wrapped fp32 model, parameters and states in host memory, against torch.

    python benchmarks/optimizer_wrapped.py --layers 16 --width 4096 --rounds 5 --json wrapped.json

A stack of ``--layers`` Linear(width, width) layers (fp32, random weights) is wrapped with
``offload.wrap(model, OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host"))``
and trained with ``offload.AdamW``; an unwrapped copy is trained with
``torch.optim.AdamW(fused=True)``. Each step runs one forward and backward on both; only
``step()`` is timed (offload's includes its ``synchronize()``), the two alternating step by
step after 2 untimed steps. Per round: a fresh pair, the median of ``--steps`` steps; the
figures are medians over rounds.

Unlike ``optimizer_step.py`` (plain tensors, "offload only the optimizer"), this includes
what a wrapped model adds to the step: gradients accumulated in the optimizer's fp32
buffers, parameter groups updated in their host home copy, the device copies dropped.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import statistics
import sys
import time

import torch

log = logging.getLogger("optimizer_wrapped")


def one_round(args) -> dict:
    import offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    ref = copy.deepcopy(model)
    cfg = offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host",
                                host_budget=args.host_budget)
    wrapped = offload.wrap(model, cfg)
    ours = offload.AdamW(wrapped.parameters(), lr=1e-4, weight_decay=0.01)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    x = torch.randn(4, args.width)
    times = {"torch_fused": [], "ours_host": []}
    try:
        for step in range(2 + args.steps):
            for name, m, opt in (("torch_fused", ref, theirs), ("ours_host", wrapped, ours)):
                m(x).pow(2).mean().backward()
                started = time.perf_counter()
                opt.step()
                getattr(opt, "synchronize", lambda: None)()
                if step >= 2:
                    times[name].append(time.perf_counter() - started)
                opt.zero_grad()
        return {k: statistics.median(v) for k, v in times.items()} | {
            "master_rows": sum(1 for s in ours._book.shards if s.master)}
    finally:
        ours.close()
        offload.unwrap(wrapped)
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--layers", type=int, default=16, help="Linear layers (default 16)")
    parser.add_argument("--width", type=int, default=4096, help="their width (default 4096: 16.8M parameters each)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, a fresh pair each (default 5)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round (default 5)")
    parser.add_argument("--host-budget", default="20GiB", help="offload's host_budget (default 20GiB)")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    n = args.layers * (args.width * args.width + args.width)
    rows = []
    for r in range(args.rounds):
        row = one_round(args)
        rows.append(row)
        log.info("%.0fM params, round %d: torch fused %.3f s/step, ours host %.3f s/step (%.2fx)", n / 1e6, r,
                 row["torch_fused"], row["ours_host"], row["torch_fused"] / row["ours_host"])
    report = {
        "params": n, "layers": args.layers, "width": args.width, "rounds": rows,
        "torch_fused_step_s": statistics.median(r["torch_fused"] for r in rows),
        "ours_host_step_s": statistics.median(r["ours_host"] for r in rows),
        "ours_vs_torch_fused": statistics.median(r["torch_fused"] / r["ours_host"] for r in rows),
    }
    log.info("%.0fM params: torch fused %.3f s/step, ours host %.3f s/step, ours / torch %.2fx", n / 1e6,
             report["torch_fused_step_s"], report["ours_host_step_s"], report["ours_vs_torch_fused"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    sys.exit(main())
