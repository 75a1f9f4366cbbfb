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

The JSON holds ``steps``, ``params``, ``final_loss`` per format (the mean of the last
``--tail`` steps' losses, so one noisy batch does not decide), each format's relative
difference from fp32's, and the losses of every step. The plot shows the curves, smoothed
over ``--tail`` steps.
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

FORMATS = ("fp32", "bf16", "int8")


def arithmetic(seed: int) -> torch.Tensor:
    """``examples/finetune.py``'s default corpus, as byte tokens."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from finetune import corpus

    return corpus(argparse.Namespace(corpus=None, seed=seed))


def worker(args) -> dict:
    import transformers

    import offload

    tokens = arithmetic(args.seed)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=256,
                                     n_positions=args.seq)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    swap = tempfile.mkdtemp(prefix="accuracy-", dir=args.path)
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget="64MiB", host_budget="1GiB")
    try:
        model = offload.wrap(model, cfg)
        model.train()
        opt = offload.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, moments=args.worker)

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

    fig, ax = plt.subplots(figsize=(7, 4))
    for fmt, run in report["runs"].items():
        ax.plot(range(1, len(run["losses"]) + 1), smooth(run["losses"], tail),
                label=f"{fmt}: final {report['final_loss'][fmt]:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {tail} steps)")
    ax.set_title(f"offload.AdamW moments, GPT-2 {report['params'] / 1e6:.0f}M, {report['steps']} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma list of moments formats to run "
                        "(default fp32,bf16,int8; fp32 is the reference and always runs)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="bytes per sequence (default 64)")
    parser.add_argument("--layers", type=int, default=10, help="transformer layers (default 10)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512: with 10 layers, 32M "
                        "parameters)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
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
    report = {"command": " ".join(sys.argv), "steps": args.steps, "batch": args.batch, "seq": args.seq,
              "lr": args.lr, "tail": args.tail, "runs": {}, "final_loss": {}, "final_loss_vs_fp32": {}}
    for fmt in formats:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", fmt, "--path", args.path]
        for flag in ("steps", "batch", "seq", "layers", "hidden", "heads", "lr", "seed"):
            cmd += [f"--{flag}", str(getattr(args, flag))]
        log.info("running %s ...", fmt)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"the {fmt} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        run = json.loads(out.stdout.strip().splitlines()[-1])
        report["params"] = run["params"]
        report["runs"][fmt] = run
        report["final_loss"][fmt] = sum(run["losses"][-args.tail:]) / len(run["losses"][-args.tail:])
    ref = report["final_loss"]["fp32"]
    print(f"\nGPT-2 {report['params'] / 1e6:.1f}M, {args.steps} steps")
    print("moments  final loss  vs fp32   run s")
    for fmt in formats:
        diff = report["final_loss"][fmt] / ref - 1
        report["final_loss_vs_fp32"][fmt] = diff
        print(f"{fmt:7s} {report['final_loss'][fmt]:11.4f} {diff:+8.2%} {report['runs'][fmt]['seconds']:7.0f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        log.info("wrote %s", args.json)
    if args.plot:
        plot(report, args.plot, args.tail)


if __name__ == "__main__":
    main()
