"""What demand fetch costs when there is nothing to fetch: GPT-2 355M (24 x 1024) training
steps and generated tokens with the mechanism as shipped ("on") and switched off ("off"),
each run a fresh process, the modes interleaved and their order rotated per round.

    python benchmarks/demand_overhead.py --rounds 3 --json demand.json

Demand fetch routes every function call on a wrapped parameter through its class's
``__torch_function__`` (offload/params/_demand.py); inside its own module's forward the
parameter is already materialized, so the call only looks its group up and runs. "off"
leaves the parameters plain ``nn.Parameter`` (the class swap is skipped in the worker):
not a configuration offload offers, only the baseline that isolates this cost.

  train   offload.wrap from the saved safetensors, parameters and AdamW states on NVMe
          (O_DIRECT: the page cache serves none of it), device budget a third of the
          model, host budget 4 GiB; step = forward + backward + step + synchronize,
          batch 2 x 128, 2 warm-up steps, median of --steps.
  infer   the same wrap, torch.no_grad greedy generation of --tokens tokens after an
          8-token prompt (KV cache), one warm-up generation; seconds per token.

It also counts the handler's calls per training step and per token, and times the call
alone (F.linear on a 64-wide layer, resident on the device, 200k calls, against a plain
parameter): calls x cost is the overhead the end-to-end medians should show.
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
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, run_json_worker, saved_gpt2, start  # noqa: E402

log = logging.getLogger("bench.demand")
SHAPE = (24, 1024, 16)  # GPT-2 medium: 355M parameters


def wrapped(path: str, args, off: bool):
    import transformers

    import offload

    if off:  # the baseline: parameters stay plain nn.Parameter
        import offload.params._access as access

        access.register = lambda param, owner: None
    config = transformers.AutoConfig.from_pretrained(path)
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    swap = tempfile.mkdtemp(prefix="swap-", dir=args.path)
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget=max(params * 4 // 3, 2 * config.vocab_size * config.n_embd * 4 + (64 << 20)),
                                host_budget="4GiB", file_size="1GiB", io_backend="direct")
    return offload.wrap(model, cfg, checkpoint=path), swap


def count_calls(fn) -> int:
    """How many times ``OffloadedParameter.__torch_function__`` runs in ``fn()``."""
    from offload.params import _demand

    original = _demand.OffloadedParameter.__dict__["__torch_function__"].__func__
    calls = [0]

    def counted(cls, *a, **kw):
        calls[0] += 1
        return original(cls, *a, **kw)

    _demand.OffloadedParameter.__torch_function__ = classmethod(counted)
    try:
        fn()
    finally:
        _demand.OffloadedParameter.__torch_function__ = classmethod(original)
    return calls[0]


def worker_train(path: str, args, off: bool) -> dict:
    import offload

    model, swap = wrapped(path, args, off)
    try:
        model.train()
        opt = offload.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(0))

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()

        times = []
        for i in range(args.steps + 2):
            t0 = time.perf_counter()
            step()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        calls = 0 if off else count_calls(step)
        demand = offload.stats(model)["demand_fetches"]
        opt.close()
        offload.close(model)
        return {"step_s": statistics.median(times), "steps_s": times, "calls_per_step": calls,
                "demand_fetches": demand}
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def worker_infer(path: str, args, off: bool) -> dict:
    import offload

    model, swap = wrapped(path, args, off)
    try:
        model.eval()
        prompt = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0))

        def generate():
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)

        generate()  # warm-up: records the order
        t0 = time.perf_counter()
        generate()
        seconds = time.perf_counter() - t0
        calls = 0 if off else count_calls(generate)
        offload.close(model)
        return {"token_s": seconds / args.tokens, "calls_per_token": calls / args.tokens}
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def call_cost(n: int = 200_000) -> dict:
    """Seconds per F.linear call on an offloaded (resident) parameter and on a plain one."""
    import torch.nn.functional as F
    from torch import nn

    import offload

    x = torch.randn(1, 64)
    plain = nn.Linear(64, 64)
    ours = nn.Linear(64, 64)
    swap = tempfile.mkdtemp(prefix="swap-")
    offload.wrap(ours, offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host",
                                             device_budget="1MiB", host_budget="4MiB"))
    out = {}
    for name, layer in (("plain", plain), ("offloaded", ours)):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                F.linear(x, layer.weight, layer.bias)
            best = min(best, (time.perf_counter() - t0) / n)
        out[name] = best
    offload.close(ours)
    shutil.rmtree(swap, ignore_errors=True)
    return {"plain_call_s": out["plain"], "offloaded_call_s": out["offloaded"],
            "handler_s": out["offloaded"] - out["plain"]}


def run_worker(mode: str, off: bool, path: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", mode, "--model-path", path, "--steps", str(args.steps),
           "--tokens", str(args.tokens), "--path", args.path] + (["--off"] if off else [])
    return run_json_worker(cmd, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the four runs (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per run (default 3)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per timed generation (default 16)")
    parser.add_argument("--path", default=None, help="directory on the disk for the saved model and swap files "
                        f"(default: {SCRATCH_HELP.format(name='demand-overhead')}); the model is kept there "
                        "for re-runs")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--off", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    start(args, "demand-overhead")
    if args.worker:
        fn = worker_train if args.worker == "train" else worker_infer
        print(json.dumps(fn(args.model_path, args, args.off)))
        return
    path = saved_gpt2(args.path, "355M", SHAPE)
    runs = [("train", False), ("train", True), ("infer", False), ("infer", True)]
    results: dict[str, list[dict]] = {f"{m}-{'off' if off else 'on'}": [] for m, off in runs}
    for r in range(args.rounds):
        order = runs[r % len(runs):] + runs[: r % len(runs)]
        for mode, off in order:
            got = run_worker(mode, off, path, args)
            key = f"{mode}-{'off' if off else 'on'}"
            if got is not None:
                results[key].append(got)
                log.info("round %d %s: %s", r + 1, key, {k: v for k, v in got.items() if not isinstance(v, list)})
    cost = call_cost()

    def med(key: str, field: str) -> float:
        values = [x[field] for x in results[key]]
        return statistics.median(values) if values else float("nan")

    report = {"command": " ".join(sys.argv), "rounds": results, "call_cost": cost}
    for mode, field, per in (("train", "step_s", "calls_per_step"), ("infer", "token_s", "calls_per_token")):
        on, off = med(f"{mode}-on", field), med(f"{mode}-off", field)
        calls = med(f"{mode}-on", per)
        report[mode] = {"on_s": on, "off_s": off, "ratio": on / off, "calls": calls,
                        "estimated_overhead_s": calls * cost["handler_s"],
                        "spread_off_s": [min(x[field] for x in results[f"{mode}-off"]),
                                         max(x[field] for x in results[f"{mode}-off"])] if results[f"{mode}-off"] else None}
    print(f"\nhandler call: {cost['handler_s'] * 1e6:.2f} us over a plain parameter's "
          f"{cost['plain_call_s'] * 1e6:.2f} us (F.linear, 64 wide)")
    print("mode   on (s)   off (s)  on/off  calls  calls x cost (s)  off min..max (s)")
    for mode in ("train", "infer"):
        e = report[mode]
        spread = e["spread_off_s"] or [float("nan")] * 2
        print(f"{mode:6s} {e['on_s']:7.3f}  {e['off_s']:7.3f}  {e['ratio']:6.3f}  {e['calls']:5.0f}  "
              f"{e['estimated_overhead_s']:16.4f}  {spread[0]:.3f}..{spread[1]:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
