"""Does keeping the moments in fewer bytes change what a fine-tune learns? The same run with
``offload.AdamW(moments=...)`` in fp32, bf16 and int8, loss curves side by side.

    python benchmarks/optimizer_accuracy.py --json docs/results/optimizer_accuracy.json \\
        --plot docs/results/optimizer_accuracy.png

The model is GPT-2-shaped, built from a config with random weights (seed 0): ``--layers``
x ``--hidden`` with a 256-token byte vocabulary (about 32M parameters by default). The text
is ``examples/finetune.py``'s generated arithmetic ("17 plus 25 is 42."), read as bytes;
every format sees the same batches (seed 1) and the same dropout masks. Each format trains
in a fresh process with parameters and optimizer states on NVMe (``offload.wrap``), clipping
at 1.0 and a cosine learning-rate schedule with warm-up, as a fine-tune would run.

``bf16_master`` runs the model in bf16 (``compute_dtype="bf16"``) with ``master="bf16"``;
``bf16_model``, the same bf16 model with fp32 master weights, runs beside it as its own
reference. (smaller by default: ``--bf16-layers``). The JSON holds ``steps``, ``params`` (the moments
formats' model), ``final_loss`` per run (the mean of the last
``--tail`` steps' losses, so one noisy batch does not decide), each format's relative
difference from fp32's (``bf16_master``'s from ``bf16_model``'s), and the losses of every
step. The plot shows the curves, smoothed over ``--tail`` steps, one panel per model.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, start  # noqa: E402

log = logging.getLogger("bench.optimizer_accuracy")

FORMATS = ("fp32", "bf16", "int8", "bf16_master")
# runs beyond the moments formats: (OffloadConfig.compute_dtype, AdamW's moments, master)
RUNS = {"bf16_master": ("bf16", "fp32", "bf16"),  # a bf16 model, its master weights bf16, rounded stochastically
        "bf16_model": ("bf16", "fp32", "fp32")}  # the same bf16 model with fp32 masters: bf16_master's own reference


def arithmetic(seed: int) -> torch.Tensor:
    """``examples/finetune.py``'s default corpus, as byte tokens."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from finetune import corpus

    return corpus(argparse.Namespace(corpus=None, seed=seed))


def worker(args) -> dict:
    import transformers

    import offload

    tokens = arithmetic(args.seed)
    layers, hidden = (args.bf16_layers, args.bf16_hidden) if args.worker in RUNS else (args.layers, args.hidden)
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=args.heads, vocab_size=256,
                                     n_positions=args.seq)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    swap = tempfile.mkdtemp(prefix="accuracy-", dir=args.path)
    dtype, moments, master = RUNS.get(args.worker, (None, args.worker, "fp32"))
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget="64MiB", host_budget="1GiB", compute_dtype=dtype)
    try:
        model = offload.wrap(model, cfg)
        model.train()
        opt = offload.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, moments=moments, master=master)

        def lr_at(step: int) -> float:
            warm = max(1, args.steps // 20)
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, args.steps - warm)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(2)  # dropout
        losses, started = [], time.perf_counter()
        for step in range(args.steps):
            starts = torch.randint(0, len(tokens) - args.seq - 1, (args.batch,), generator=g)
            ids = torch.stack([tokens[s: s + args.seq] for s in starts.tolist()])
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(float(loss))
            if step % 25 == 0 or step == args.steps - 1:
                log.info("%s step %d: loss %.4f (%.1f s)", args.worker, step + 1, losses[-1],
                         time.perf_counter() - started)
        opt.close()
        offload.close(model)
        return {"losses": losses, "params": params, "seconds": time.perf_counter() - started}
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def smooth(values: list[float], n: int) -> list[float]:
    return [sum(values[max(0, i - n + 1): i + 1]) / len(values[max(0, i - n + 1): i + 1]) for i in range(len(values))]


def plot(report: dict, path: str, tail: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [[f for f in report["runs"] if f not in RUNS], [f for f in report["runs"] if f in RUNS]]
    panels = [p for p in panels if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, runs in zip(axes[0], panels):
        for fmt in runs:
            run = report["runs"][fmt]
            ax.plot(range(1, len(run["losses"]) + 1), smooth(run["losses"], tail),
                    label=f"{fmt}: final {report['final_loss'][fmt]:.4f}")
        params = report["runs"][runs[0]]["params"]
        ax.set_title(f"GPT-2 {params / 1e6:.1f}M" + (", bf16 weights" if runs[0] in RUNS else "")
                     + f", {report['steps']} steps")
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean of {tail} steps)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma list of runs: the moments formats "
                        "fp32, bf16, int8, and bf16_master (a bf16 model whose master weights are bf16, rounded "
                        "stochastically; bf16_model, the same model with fp32 masters, runs beside it); default "
                        "all four; fp32 is the reference and always runs")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="bytes per sequence (default 64)")
    parser.add_argument("--layers", type=int, default=10, help="transformer layers (default 10)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512: with 10 layers, 32M "
                        "parameters)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--bf16-layers", type=int, default=2, help="layers of the bf16 model of bf16_master and "
                        "bf16_model (default 2: bf16 matrix products run about 25x slower than fp32 on a CPU "
                        "without bf16 instructions)")
    parser.add_argument("--bf16-hidden", type=int, default=256, help="hidden size of that bf16 model (default 256)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated text (default 0)")
    parser.add_argument("--tail", type=int, default=20, help="steps averaged into the final loss and the "
                        "plotted curves (default 20)")
    parser.add_argument("--path", default=None, help="directory for the swap files (default: "
                        f"{SCRATCH_HELP.format(name='optimizer-accuracy')})")
    parser.add_argument("--json", default=None, help="write the report as JSON to this path")
    parser.add_argument("--plot", default=None, help="write the loss curves as a PNG to this path")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    start(args, "optimizer-accuracy")
    if args.worker:
        print(json.dumps(worker(args)))
        return
    formats = ["fp32"] + [f for f in args.formats.split(",") if f and f != "fp32"]
    if "bf16_master" in formats and "bf16_model" not in formats:
        formats.append("bf16_model")
    report = {"command": " ".join(sys.argv), "steps": args.steps, "batch": args.batch, "seq": args.seq,
              "lr": args.lr, "tail": args.tail, "runs": {}, "final_loss": {}, "final_loss_vs_fp32": {},
              "final_loss_vs_bf16_model": {}}
    for fmt in formats:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", fmt, "--path", args.path]
        for flag in ("steps", "batch", "seq", "layers", "hidden", "heads", "lr", "seed", "bf16_layers", "bf16_hidden"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        log.info("running %s ...", fmt)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"the {fmt} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        run = json.loads(out.stdout.strip().splitlines()[-1])
        report.setdefault("params", run["params"])  # (fp32's: the model of the moments formats)
        report["runs"][fmt] = run
        report["final_loss"][fmt] = sum(run["losses"][-args.tail:]) / len(run["losses"][-args.tail:])
    print(f"\n{args.steps} steps")
    print("run          params  final loss  reference  vs reference   run s")
    for fmt in formats:
        ref = "bf16_model" if fmt in RUNS else "fp32"  # (each against its own model's reference)
        diff = report["final_loss"][fmt] / report["final_loss"][ref] - 1
        report["final_loss_vs_fp32" if ref == "fp32" else "final_loss_vs_bf16_model"][fmt] = diff
        print(f"{fmt:11s} {report['runs'][fmt]['params'] / 1e6:6.1f}M {report['final_loss'][fmt]:11.4f} "
              f"{ref:>10s} {diff:+13.2%} {report['runs'][fmt]['seconds']:7.0f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        log.info("wrote %s", args.json)
    if args.plot:
        plot(report, args.plot, args.tail)


if __name__ == "__main__":
    main()
