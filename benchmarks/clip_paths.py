"""What clipping costs on an offloaded model, by the path users take: GPT-2 124M (12 x 768)
training steps with clipping at 1.0 through ``torch.nn.utils.clip_grad_norm_`` over the
model's parameters (what HF Trainer and Accelerate call: it reads ``p.grad``, which for an
offloaded parameter is the optimizer's noted norm), through ``opt.clip_grad_norm_``, and
without clipping; next to plain torch in memory with torch's clip. Each run is a fresh
process, the modes interleaved and their order rotated per round.

    python benchmarks/clip_paths.py --rounds 2 --steps 3 --json clip.json

  torch       the model in RAM, torch.optim.AdamW(fused=True), torch's clip_grad_norm_;
  torch-clip  offload.wrap from the saved safetensors, parameters and AdamW states on NVMe
              (O_DIRECT), device budget a third of the model, host budget 4 GiB;
              torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0);
  opt-clip    the same with opt.clip_grad_norm_(1.0);
  no-clip     the same without clipping.

Step = forward + backward + clip + step + zero_grad + synchronize (write-backs included),
batch 2 x 128, 2 warm-up steps, median of --steps. Printed: each mode's median, the ratio
of each offloaded mode to no-clip (the clipping's cost) and to torch in memory. The final
losses of torch and torch-clip are printed too: equal to rounding, they show the clip acted
alike (a skipped clip changes them at the third decimal).
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

log = logging.getLogger("bench.clip")
SHAPE = (12, 768, 12)  # GPT-2 small: 124M parameters
MODES = ("torch", "torch-clip", "opt-clip", "no-clip")


def worker(mode: str, path: str, args) -> dict:
    import transformers

    import offload

    # no dropout: the final losses of torch and torch-clip are then comparable
    config = transformers.AutoConfig.from_pretrained(path, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    swap = tempfile.mkdtemp(prefix="swap-", dir=args.path)
    try:
        if mode == "torch":
            model = transformers.GPT2LMHeadModel.from_pretrained(path, config=config)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        else:
            with offload.init_empty_weights():
                model = transformers.GPT2LMHeadModel(config)
            params = sum(p.numel() for p in model.parameters())
            cfg = offload.OffloadConfig(
                device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                device_budget=max(params * 4 // 3, 2 * config.vocab_size * config.n_embd * 4 + (64 << 20)),
                host_budget="4GiB", file_size="1GiB", io_backend="direct")
            model = offload.wrap(model, cfg, checkpoint=path)
            opt = offload.AdamW(model.parameters(), lr=1e-4)
        model.train()
        ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
        times, losses = [], []
        for i in range(args.steps + 2):
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if mode in ("torch", "torch-clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            elif mode == "opt-clip":
                opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if mode != "torch":
                opt.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        if mode != "torch":
            opt.close()
            offload.close(model)
        return {"step_s": statistics.median(times), "steps_s": times, "losses": losses}
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the four runs (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per run (default 3)")
    parser.add_argument("--path", default=None, help="directory on the disk for the saved model and swap files "
                        f"(default: {SCRATCH_HELP.format(name='clip-paths')}); the model is kept there for re-runs")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    start(args, "clip-paths")
    if args.worker:
        print(json.dumps(worker(args.worker, args.model_path, args)))
        return
    path = saved_gpt2(args.path, "124M", SHAPE)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        for mode in order:
            cmd = [sys.executable, __file__, "--worker", mode, "--model-path", path, "--steps", str(args.steps),
                   "--path", args.path]
            out = run_json_worker(cmd, mode)
            if out is not None:
                results[mode].append(out)
                log.info("round %d %-10s step %.2f s", r + 1, mode, out["step_s"])
    medians = {m: statistics.median(x["step_s"] for x in runs) for m, runs in results.items() if runs}
    print(f"\n{'mode':<11} {'step s':>8} {'/ no-clip':>10} {'/ torch':>9}")
    for mode, value in medians.items():
        base = medians.get("no-clip")
        print(f"{mode:<11} {value:8.2f} {value / base if base else float('nan'):10.3f} "
              f"{value / medians['torch'] if 'torch' in medians else float('nan'):9.2f}")
    if results["torch"] and results["torch-clip"]:
        print(f"final loss: torch {results['torch'][0]['losses'][-1]:.5f}, "
              f"torch-clip {results['torch-clip'][0]['losses'][-1]:.5f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": SHAPE, "steps": args.steps, "rounds": args.rounds, "medians_s": medians,
                       "runs": results}, fh, indent=1)


if __name__ == "__main__":
    main()
