"""Fine-tune through transformers' Trainer with an offloaded model and offload.AdamW.

    python examples/hf_trainer.py --steps 5 --param-tier nvme --optimizer-tier nvme

Shows that offload fits the ecosystem's main training loop. What must be set, and why:

- ``model.is_parallelizable = model.model_parallel = True``: Trainer then leaves the model
  where it is instead of calling ``model.to(device)`` (offload already placed it; moving a
  wrapped model's placeholders would be wrong).
- ``optimizers=(offload.AdamW(...), scheduler)``: Trainer uses them as given.
- ``max_grad_norm=0`` plus :class:`ClipWithOffload`: offload moves gradients off the device
  as they are produced, so ``p.grad`` is empty when Trainer would clip; the callback calls
  ``opt.clip_grad_norm_`` (norms noted on the way) just before each optimizer step.
- ``save_strategy="no"`` and ``offload.save_checkpoint`` / ``offload.export`` instead of
  Trainer's saving: between passes a wrapped model's parameters are placeholders, and
  Trainer would save those.
- Leave Trainer's ``fp16``/``bf16`` off; choose the compute dtype with ``--dtype`` (offload's
  ``compute_dtype``; fp16 gets offload's own loss scaling, not Trainer's GradScaler).

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
from finetune import add_model_and_offload_args, build_model, corpus, offload_config  # noqa: E402

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

    class ClipWithOffload(transformers.TrainerCallback):
        """Clip offloaded gradients right before Trainer's optimizer step."""

        def __init__(self, opt, max_norm: float):
            self.opt, self.max_norm = opt, max_norm

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if self.max_norm > 0:
                self.opt.clip_grad_norm_(self.max_norm)

    class LogLoss(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                log.info("step %d loss %r", state.global_step, logs["loss"])

    class LogOffload(transformers.TrainerCallback):
        """One line per step with offload's figures next to Trainer's loss."""

        def __init__(self, model):
            self.model, self.before = model, offload.stats(model)

        def on_log(self, args, state, control, logs=None, **kwargs):
            now = offload.stats(self.model)
            if not logs or "loss" not in logs:
                return
            log.info("step %d loss %r | read %s written %s | stall %.2f s | peak device %s host %s",
                     state.global_step, logs["loss"],
                     offload.format_size(now["read_bytes"] - self.before["read_bytes"]),
                     offload.format_size(now["write_bytes"] - self.before["write_bytes"]),
                     now["stall_seconds"] - self.before["stall_seconds"],
                     offload.format_size(now["device_peak_bytes"]), offload.format_size(now["host_peak_bytes"]))
            self.before = now

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_model_and_offload_args(parser)  # the same model, tiers and budgets as examples/finetune.py
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--batch-size", type=int, default=2, help="per-device batch (default 2)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm, 0 off (default 1.0)")
    parser.add_argument("--corpus", default=None, help="UTF-8 text file (default: generated arithmetic)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--output-dir", default="./hf-trainer-out", help="Trainer's output directory; the "
                        "checkpoint and the export go in it (default ./hf-trainer-out)")
    parser.add_argument("--no-offload", action="store_true", help="run the same Trainer on the plain model "
                        "with torch.optim.AdamW (Trainer clips), for comparison")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    model, weights = build_model(args)
    data = ByteChunks(corpus(args), args.seq_len, args.steps * args.batch_size * args.grad_accum, args.seed)
    if args.no_offload:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=True)  # the kernel offload.AdamW calls
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
        trainer = transformers.Trainer(model=model, args=_training_args(transformers, args, args.clip),
                                       train_dataset=data, optimizers=(opt, sched), callbacks=[LogLoss()])
        result = trainer.train()
        log.info("Trainer finished: %d steps, training loss %.4f", result.global_step, result.training_loss)
        return 0
    model = offload.wrap(model, offload_config(args), checkpoint=weights)
    model.is_parallelizable = model.model_parallel = True  # Trainer: do not move the model
    opt = offload.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
    trainer = transformers.Trainer(model=model, args=_training_args(transformers, args, 0.0), train_dataset=data,
                                   optimizers=(opt, sched), callbacks=[ClipWithOffload(opt, args.clip), LogOffload(model)])
    result = trainer.train()
    opt.synchronize()
    log.info("Trainer finished: %d steps, training loss %.4f", result.global_step, result.training_loss)
    offload.save_checkpoint(os.path.join(args.output_dir, "checkpoint"), model, opt,
                            extra={"step": result.global_step, "scheduler": sched.state_dict()})
    offload.export(model, os.path.join(args.output_dir, "model"))
    log.info("checkpoint and export written to %s", args.output_dir)
    opt.close()
    offload.unwrap(model)
    return 0


def _training_args(transformers, args, max_grad_norm: float):
    return transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, max_grad_norm=max_grad_norm, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=args.device == "cpu", seed=args.seed,
        dataloader_num_workers=0)


if __name__ == "__main__":
    sys.exit(main())
