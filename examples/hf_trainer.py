"""Fine-tune through transformers' Trainer with an offloaded model and offload.AdamW.

    python examples/hf_trainer.py --steps 20 --save-steps 10
    python examples/hf_trainer.py --steps 30 --save-steps 10 --resume   # goes on from the last checkpoint

A plain Trainer script with Trainer's defaults. What offload needs is two lines: wrap the
model (``offload.wrap``) and hand Trainer an offload optimizer (``optimizers=(opt, sched)``:
Trainer's own optimizer would be a torch one, which offload refuses over streamed
parameters). Everything else is Trainer's: it clips at ``max_grad_norm`` (1.0 by default;
``p.grad`` of an offloaded parameter carries the norm the optimizer noted, and the clip is
applied inside its step), saves a checkpoint every ``save_steps`` (the weights through
``state_dict()``, the optimizer's states in torch's format: both pass through host memory,
so for models larger than RAM use ``offload.save_checkpoint``, which streams) and resumes
bit-exact with ``resume_from_checkpoint``. ``--bf16`` turns on Trainer's bf16 autocast;
``--dtype`` chooses offload's compute dtype (fp16 builds the optimizer with
``loss_scale=None`` and sets Trainer's ``fp16=True``, so Trainer's GradScaler scales).

The model and data are those of ``examples/finetune.py`` (GPT-2-style, random weights,
generated arithmetic text as bytes); same defaults for tiers and budgets.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

import torch

import offload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune import add_batch_args, add_model_and_offload_args, build_model, corpus, offload_config  # noqa: E402,E501

log = logging.getLogger("hf_trainer")


class ByteChunks(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor, seq_len: int, count: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(tokens) - seq_len - 1, (count,), generator=g).tolist()
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        ids = self.tokens[self.starts[i]: self.starts[i] + self.seq_len]
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv=None) -> int:
    import transformers

    LogLoss, LogOffload = _callbacks()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_model_and_offload_args(parser)  # the same model, tiers and budgets as examples/finetune.py
    t = parser.add_argument_group("training (Trainer's max_steps, per_device_train_batch_size, "
                                  "gradient_accumulation_steps ...)")
    add_batch_args(t)
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="Trainer's clipping norm, 0 off (default 1.0, "
                   "Trainer's default)")
    t.add_argument("--save-steps", type=int, default=500, help="save a Trainer checkpoint every N steps "
                   "(default 500, Trainer's default)")
    t.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    t.add_argument("--bf16", action="store_true", help="Trainer's bf16 autocast")
    t.add_argument("--corpus", default=None, help="UTF-8 text file (default: generated arithmetic)")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    t.add_argument("--output-dir", default="./hf-trainer-out", help="Trainer's output directory: its checkpoints, "
                   "then the exported model in model/ (default ./hf-trainer-out)")
    t.add_argument("--no-offload", action="store_true", help="run the same Trainer on the plain model with "
                   "torch.optim.AdamW, for comparison")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    model, weights = build_model(args)
    data = ByteChunks(corpus(args), args.seq_len, args.steps * args.batch_size * args.grad_accum, args.seed)
    if args.no_offload:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    else:
        model = offload.wrap(model, offload_config(args), checkpoint=weights)
        opt = offload.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            loss_scale=None if args.dtype == "fp16" else "auto")  # fp16: Trainer's scaler
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
    training = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, max_grad_norm=args.max_grad_norm, save_steps=args.save_steps,
        bf16=args.bf16, fp16=args.dtype == "fp16" and not args.no_offload, logging_steps=1, report_to=[],
        use_cpu=args.device == "cpu", seed=args.seed, dataloader_num_workers=0,
        gradient_checkpointing=args.checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False})
    callbacks = [] if args.no_offload else [LogOffload(model)]
    trainer = transformers.Trainer(model=model, args=training, train_dataset=data, optimizers=(opt, sched),
                                   callbacks=[LogLoss(), *callbacks])
    resume = None
    if args.resume and os.path.isdir(args.output_dir):
        resume = transformers.trainer_utils.get_last_checkpoint(args.output_dir)
    if args.resume and not resume:
        log.info("--resume: no checkpoint in %s yet, starting at step 0", args.output_dir)
    result = trainer.train(resume_from_checkpoint=resume or None)
    log.info("Trainer finished: %d steps, training loss %.4f", result.global_step, result.training_loss)
    if not args.no_offload:
        offload.export(model, os.path.join(args.output_dir, "model"))  # streamed, a group at a time
        log.info("model exported to %s", os.path.join(args.output_dir, "model"))
        opt.close()
        offload.unwrap(model)
    return 0


def _callbacks():
    """Two TrainerCallbacks (defined here: transformers is imported on use)."""
    import transformers

    class LogLoss(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                log.info("step %d loss %r grad_norm %r", state.global_step, logs["loss"], logs.get("grad_norm"))

    class LogOffload(transformers.TrainerCallback):
        """offload's figures for each logged step: bytes moved, stalls, peaks."""

        def __init__(self, model):
            self.model, self.before = model, offload.stats(model)

        def on_log(self, args, state, control, logs=None, **kwargs):
            now = offload.stats(self.model)
            if not logs or "loss" not in logs:
                return
            log.info("step %d | read %s written %s | stall %.2f s | peak device %s host %s", state.global_step,
                     offload.format_size(now["read_bytes"] - self.before["read_bytes"]),
                     offload.format_size(now["write_bytes"] - self.before["write_bytes"]),
                     now["stall_seconds"] - self.before["stall_seconds"],
                     offload.format_size(now["device_peak_bytes"]), offload.format_size(now["host_peak_bytes"]))
            self.before = now

    return LogLoss, LogOffload


if __name__ == "__main__":
    sys.exit(main())
