"""The process's resident set against offload's plan: is the plan a promise the OOM killer
would agree with?

    python benchmarks/memory.py --json docs/results/memory.json
    python benchmarks/memory.py --models 124M --allocators system,lean --json alloc.json

For each GPT-2 model (124M, 355M, 774M and the 1.6B layout; random weights, built from a
config and saved once as safetensors in ``--path``) and each of two budget settings
(device_budget / host_budget: 124M 256MiB/1GiB and 512MiB/2GiB; 355M 512MiB/1536MiB and
512MiB/3GiB; 774M 768MiB/2GiB and 1GiB/4GiB; 1.6B 1GiB/3GiB and 2GiB/6GiB), a fresh process: ``offload.plan(model, cfg, batch=...)`` predicts the peak RSS, then the model is
built on the meta device, streamed from the safetensors into the NVMe tier and trained with
offload.AdamW (states on NVMe, batch 2 x 128, fp32, device "cpu") for ``--steps`` steps (20 on
124M and 355M, to see RSS flat after step 3). Reported per run:

  peak_rss_bytes       the process's VmHWM at the end: the most ever resident, load included;
  predicted_rss_bytes  the plan's ``predicted_rss`` (baseline + host rows + device rows on a
                       CPU device + activations, largest gradient, malloc's kept memory);
  untracked_bytes      the largest ``mem_untracked_bytes`` of the step log (RSS less the
                       baseline, offload's pools, torch's heap, malloc's kept memory and mapped
                       file pages), and its share of that step's RSS;
  rss_step3_bytes, rss_step20_bytes   RSS after step 3 and after step 20 (null when not run).

and the checks of the memory issue: peak <= 1.1 x predicted + 256 MiB, untracked <= 10% of RSS,
RSS after step 20 within 2% of after step 3. Each run is its own process, one at a time
(``--allocators`` runs each setting of ``OffloadConfig.host_allocator`` in turn, interleaved).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, gpt2_config, run_json_worker, saved_gpt2, start  # noqa: E402

log = logging.getLogger("bench.memory")
MiB = 1 << 20
# (layers, hidden, heads) of GPT-2's sizes, and two (device_budget, host_budget) settings each
MODELS = {"124M": ((12, 768, 12), (("256MiB", "1GiB"), ("512MiB", "2GiB"))),
          "355M": ((24, 1024, 16), (("512MiB", "1536MiB"), ("512MiB", "3GiB"))),
          "774M": ((36, 1280, 20), (("768MiB", "2GiB"), ("1GiB", "4GiB"))),
          "1.6B": ((48, 1600, 25), (("1GiB", "3GiB"), ("2GiB", "6GiB")))}
LONG = {"124M", "355M"}  # run 20 steps: RSS flat after step 3


def worker(args) -> dict:
    """One run in this process; returns its figures."""
    import torch
    import transformers

    import offload

    swap = os.path.join(args.path, "swap")
    shutil.rmtree(swap, ignore_errors=True)
    steps_log = os.path.join(args.path, "steps.jsonl")
    if os.path.exists(steps_log):
        os.remove(steps_log)
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget=args.device_budget, host_budget=args.host_budget,
                                io_backend="direct", host_allocator=args.allocator, log_path=steps_log)
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(gpt2_config(MODELS[args.model][0]))
    ids = torch.randint(0, 50257, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    plan = offload.plan(model, cfg, optimizer="adamw", batch={"input_ids": ids, "labels": ids})
    log.info("%s", plan)
    model = offload.wrap(model, cfg, checkpoint=args.checkpoint)
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    try:
        for _ in range(args.steps):
            began = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - began)
            losses.append(loss.item())
        peak = offload.stats(model)["rss_peak_bytes"]
    finally:
        opt.close()
        offload.close(model)
        shutil.rmtree(swap, ignore_errors=True)
    records = [json.loads(line) for line in open(steps_log)]
    worst = max(records, key=lambda r: r["mem_untracked_bytes"])
    rss = [r["rss_bytes"] for r in records]
    return {"model": args.model, "device_budget": args.device_budget, "host_budget": args.host_budget,
            "host_allocator": args.allocator, "allocator": records[-1]["allocator"], "steps": args.steps,
            "peak_rss_bytes": peak, "predicted_rss_bytes": plan.predicted_rss,
            "untracked_bytes": worst["mem_untracked_bytes"],
            "untracked_share": worst["mem_untracked_bytes"] / worst["rss_bytes"],
            "rss_step3_bytes": rss[2] if len(rss) >= 3 else None,
            "rss_step20_bytes": rss[19] if len(rss) >= 20 else None,
            "rss_per_step_bytes": rss,
            "per_step": [{k[len("mem_"):-len("_bytes")] if k.startswith("mem_") else k: r[k] for k in
                          ("rss_bytes", "mem_host_pool_bytes", "mem_device_pool_bytes", "mem_heap_bytes",
                           "mem_heap_free_bytes", "mem_untracked_bytes")} for r in records],
            "heap_peak_bytes": max(r["mem_heap_peak_bytes"] for r in records),
            "activations_estimate_bytes": plan.transient_bytes, "baseline_bytes": plan.baseline_rss,
            "breakdown_last_step": {k: v for k, v in records[-1].items() if k.startswith(("mem_", "rss_"))},
            "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0], "losses": losses}


def checks(run: dict) -> dict:
    """The memory issue's acceptance, per run."""
    out = {"peak_within_plan": run["peak_rss_bytes"] <= 1.1 * run["predicted_rss_bytes"] + 256 * MiB,
           "untracked_within_10pct": run["untracked_share"] <= 0.10}
    if run["rss_step20_bytes"] is not None:
        out["flat_step3_to_20"] = abs(run["rss_step20_bytes"] - run["rss_step3_bytes"]) <= 0.02 * run["rss_step3_bytes"]
        # a leak grows; a pool that unmaps a cached buffer to map one of another size falls
        out["no_growth_step3_to_20"] = max(run["rss_per_step_bytes"][2:]) <= 1.02 * run["rss_step3_bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="124M,355M,774M,1.6B",
                    help=f"comma-separated GPT-2 sizes among {', '.join(MODELS)} (default: all)")
    ap.add_argument("--settings", default="0,1",
                    help="which of each model's two budget settings to run, by index (default: both; see MODELS)")
    ap.add_argument("--allocators", default="auto",
                    help="OffloadConfig.host_allocator settings to run, comma-separated, each in its own process "
                         "(auto, lean, system; default: auto)")
    ap.add_argument("--preload", default=None,
                    help="also run each setting with this malloc preloaded (LD_PRELOAD), e.g. "
                         "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 (Debian's libjemalloc2)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per run (default: 20 on 124M and 355M, 5 on the others)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (default: 2)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: 128)")
    ap.add_argument("--path", default=None, help=f"scratch directory for models and swap files (default: "
                                                 f"{SCRATCH_HELP.format(name='memory')})")
    ap.add_argument("--json", default=None, help="write the runs as JSON here")
    # a worker's own settings (the parent passes them)
    for name in ("--worker-model", "--device-budget", "--host-budget", "--allocator", "--checkpoint"):
        ap.add_argument(name, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    start(args, "memory")
    if args.worker_model:
        args.model = args.worker_model
        print(json.dumps(worker(args)))
        return
    runs = []
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"--models: unknown size {model!r}; choose among {', '.join(MODELS)}")
        shape, settings = MODELS[model]
        checkpoint = saved_gpt2(args.path, model, shape)
        steps = args.steps or (20 if model in LONG else 5)
        for index in (int(i) for i in args.settings.split(",")):
            device_budget, host_budget = settings[index]
            variants = [(a, None) for a in args.allocators.split(",")]
            if args.preload:
                variants.append(("auto", args.preload))
            for allocator, preload in variants:
                log.info("%s, device_budget %s, host_budget %s, host_allocator %s%s: %d steps", model, device_budget,
                         host_budget, allocator, f", LD_PRELOAD={preload}" if preload else "", steps)
                cmd = [sys.executable, os.path.abspath(__file__), "--worker-model", model, "--device-budget",
                       device_budget, "--host-budget", host_budget, "--allocator", allocator, "--checkpoint",
                       checkpoint, "--steps", str(steps), "--batch", str(args.batch), "--seq", str(args.seq),
                       "--path", os.path.join(args.path, "run")]
                run = run_json_worker(cmd, f"{model} {device_budget}/{host_budget} {allocator}",
                                      env={**os.environ, "LD_PRELOAD": preload} if preload else None)
                if run is None:
                    continue
                run["preload"] = preload
                run["checks"] = checks(run)
                runs.append(run)
                _report(run)
                if args.json:  # after each run: a long sweep stopped halfway keeps what it measured
                    with open(args.json, "w") as fh:
                        json.dump({"runs": runs, "batch": [args.batch, args.seq], "device": "cpu"}, fh, indent=1)
    if args.json:
        log.info("wrote %s", args.json)


def _report(run: dict) -> None:
    gib = lambda n: f"{n / 2**30:.2f} GiB" if n is not None else "-"  # noqa: E731
    log.info("  peak RSS %s, predicted %s (%.2fx), untracked %s (%.1f%% of RSS), RSS after step 3 %s, after "
             "step 20 %s, step %.2f s; checks %s", gib(run["peak_rss_bytes"]), gib(run["predicted_rss_bytes"]),
             run["peak_rss_bytes"] / run["predicted_rss_bytes"], gib(run["untracked_bytes"]),
             100 * run["untracked_share"], gib(run["rss_step3_bytes"]), gib(run["rss_step20_bytes"]), run["step_s"],
             run["checks"])


if __name__ == "__main__":
    main()
