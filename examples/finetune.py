"""Fine-tune a causal language model with its parameters and optimizer states offloaded.

    python examples/finetune.py --steps 5 --param-tier nvme --optimizer-tier nvme

By default the model is GPT-2-style with 24 layers x 1024 (355M parameters, random
weights, built from a config so nothing is downloaded); ``--model DIR`` takes a local
``save_pretrained`` directory (weights streamed from its safetensors) or a directory or
file with a ``config.json`` (random weights), any AutoModelForCausalLM architecture. The
text is generated arithmetic ("17 plus 25 is 42.") tokenized as bytes, or ``--corpus
FILE`` (any UTF-8 text), so the loss falls visibly within a few dozen steps.

Every step logs one line: loss, tokens/s, step time, bytes read and written by the NVMe
tier, stall seconds (compute waiting for parameters), peak device and host bytes, the
process's RSS and its peak next to the plan's prediction (``offload.plan(batch=...)``); a
tqdm bar shows progress. ``--save-dir`` checkpoints every ``--save-every`` steps and at the end
(atomic, resumable with ``--resume``); the trained weights are exported as safetensors to
``--export-dir`` (loadable with transformers' from_pretrained).

Several ranks (ZeRO-3: each rank keeps 1/N of the parameters and optimizer states, see
docs/distributed.md): launch it with torchrun, e.g. on one machine with two processes

    torchrun --standalone --nproc_per_node 2 examples/finetune.py --device cpu --steps 5

Each rank draws its own batches, swap files go to ``--nvme-path`` with ``{rank}`` filled in
(``rank{rank}`` is appended when the path has no ``{rank}``), rank 0 logs, and the
checkpoints and the export are written by all ranks together.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
import time

import torch

import offload

log = logging.getLogger("finetune")


def build_model(args):
    import transformers

    if args.model is None:
        config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                         vocab_size=args.vocab, n_positions=max(1024, args.seq_len))
        torch.manual_seed(args.seed)
        return transformers.AutoModelForCausalLM.from_config(config), None
    config = transformers.AutoConfig.from_pretrained(args.model)  # a local path: nothing downloaded
    has_weights = os.path.isdir(args.model) and any(f.endswith(".safetensors") for f in os.listdir(args.model))
    if has_weights:
        with offload.init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config)
        return model, args.model
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(config), None


def corpus(args) -> torch.Tensor:
    """Byte-level tokens of the training text."""
    if args.corpus:
        with open(args.corpus, "rb") as fh:
            data = fh.read()
    else:
        rng = random.Random(args.seed)
        lines = []
        for _ in range(20000):
            a, b = rng.randrange(100), rng.randrange(100)
            op, value = rng.choice((("plus", a + b), ("minus", a - b), ("times", a * b)))
            lines.append(f"{a} {op} {b} is {value}.")
        data = " ".join(lines).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, args, vocab: int, rank: int = 0):
    if int(tokens.max()) >= vocab:
        raise SystemExit(f"the model's vocabulary ({vocab}) is smaller than 256 byte tokens: use a model "
                         "with vocab_size >= 256")
    g = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batches
    span = args.seq_len
    while True:
        starts = torch.randint(0, len(tokens) - span - 1, (args.batch_size,), generator=g)
        yield torch.stack([tokens[s: s + span] for s in starts.tolist()])


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def local_path(text: str) -> str:
    """An argparse type: a path that exists here (a name would go to the Hugging Face Hub)."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file or directory: {text!r} (a local path: nothing is downloaded)")
    return text


def writable_parent(path: str) -> str | None:
    """Why a directory cannot be made or written at ``path``, or None."""
    at = os.path.abspath(path)
    while not os.path.exists(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        return f"{at!r} is a file, not a directory"
    if not os.access(at, os.W_OK):
        return f"{at!r} is not writable"
    return None


def add_model_and_offload_args(parser: argparse.ArgumentParser) -> None:
    """The model and offload flags (shared with examples/hf_trainer.py)."""
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=None, type=local_path, help="local save_pretrained directory, or config.json path/dir "
                   "(default: a GPT-2-style model built from --layers/--hidden/--heads/--vocab)")
    m.add_argument("--layers", type=int, default=24, help="default model: transformer layers (24)")
    m.add_argument("--hidden", type=int, default=1024, help="default model: hidden size (1024)")
    m.add_argument("--heads", type=int, default=16, help="default model: attention heads (16)")
    m.add_argument("--vocab", type=int, default=50257, help="default model: vocabulary size (50257)")
    o = parser.add_argument_group("offload")
    o.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="compute device: cuda, cuda:N or cpu (default: cuda when available)")
    o.add_argument("--param-tier", default="nvme", choices=["device", "host", "nvme"],
                   help="where parameters rest between uses (default nvme)")
    o.add_argument("--optimizer-tier", default="nvme", choices=["host", "nvme"],
                   help="where fp32 master weights and Adam moments rest (default nvme)")
    o.add_argument("--nvme-path", default="./offload-nvme", help="directory for swap files (default "
                   "./offload-nvme, created if missing; use a local disk). Under torchrun, {rank} and "
                   "{local_rank} are filled in per rank; without them rank{rank} is appended")
    o.add_argument("--device-budget", default="1GiB", help="most parameter bytes on the device at once (1GiB)")
    o.add_argument("--host-budget", default="4GiB", help="most bytes of host buffers offload may hold (4GiB)")
    o.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype of the parameters; master weights stay fp32 (default fp32)")
    o.add_argument("--checkpointing", action="store_true", help="activation checkpointing "
                   "(gradient_checkpointing_enable): keep each layer's input, recompute the rest in backward")
    o.add_argument("--activations", default="none", choices=["none", "host", "nvme"],
                   help="where saved activations beyond --activation-budget rest until backward: with "
                   "--checkpointing the checkpoints, without it every saved tensor of --activation-min-bytes "
                   "and more (default none: where autograd puts them)")
    o.add_argument("--activation-budget", default="512MiB", help="saved activations kept in place, the newest "
                   "(default 512MiB)")
    o.add_argument("--activation-min-bytes", default="1MiB", help="saved tensors whose storage is smaller than "
                   "this stay in place (default 1MiB)")
    add_observability_args(o)


def add_observability_args(o) -> None:
    o.add_argument("--log-path", default=None, help="append one JSON line per step here (bytes moved, "
                   "stall, optimizer time, loss); plot it with tools/plot_log.py (default: none)")
    o.add_argument("--trace", default=None, help="write the timeline of fetches, compute and optimizer "
                   "updates here as a Chrome trace at the end (open in ui.perfetto.dev; default: none)")


def setup_distributed(args) -> tuple[int, int]:
    """Under torchrun with several processes: join the process group (gloo on CPU, NCCL on
    CUDA, one GPU per local rank) and give each rank its own swap directory. (rank, world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device.startswith("cuda"):
        args.device = f"cuda:{local}"
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    if "{rank}" not in args.nvme_path and "{local_rank}" not in args.nvme_path:
        args.nvme_path = os.path.join(args.nvme_path, "rank{rank}")
    return dist.get_rank(), world


def add_batch_args(group: argparse._ArgumentGroup) -> None:
    """Steps, batch shape and learning rate (shared with examples/hf_trainer.py)."""
    group.add_argument("--steps", type=positive, default=20, help="optimizer steps (default 20)")
    group.add_argument("--batch-size", type=positive, default=2, help="sequences per micro-batch (default 2)")
    group.add_argument("--seq-len", type=positive, default=128, help="tokens per sequence (default 128)")
    group.add_argument("--grad-accum", type=positive, default=1, help="micro-batches per step (default 1)")
    group.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")


def enable_checkpointing(model) -> None:
    """transformers' activation checkpointing, non-reentrant (its name since 5.x, else the old one)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def offload_config(args) -> offload.OffloadConfig:
    activations = getattr(args, "activations", "none")
    act = {} if activations == "none" else dict(activation_tier=activations, activation_budget=args.activation_budget,
                                                      activation_min_bytes=args.activation_min_bytes)
    nvme = "nvme" in (args.param_tier, args.optimizer_tier, act.get("activation_tier"))
    if nvme:
        rank, local = os.environ.get("RANK", "0"), os.environ.get("LOCAL_RANK", "0")
        os.makedirs(args.nvme_path.replace("{rank}", rank).replace("{local_rank}", local), exist_ok=True)
    return offload.OffloadConfig(device=args.device, param_tier=args.param_tier,
                                 optimizer_tier=args.optimizer_tier, nvme_path=args.nvme_path if nvme else None,
                                 device_budget=args.device_budget, host_budget=args.host_budget,
                                 compute_dtype=None if args.dtype == "fp32" else args.dtype,
                                 log_path=getattr(args, "log_path", None), trace_path=getattr(args, "trace", None),
                                 **act)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_model_and_offload_args(parser)
    t = parser.add_argument_group("training")
    add_batch_args(t)
    t.add_argument("--warmup", type=int, default=2, help="linear warm-up steps (default 2)")
    t.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm, 0 to disable (default 1.0)")
    t.add_argument("--update-in-backward", action="store_true", help="update each layer's weights during "
                   "backward as soon as its gradients are final (opt.update_during_backward()) instead of during "
                   "the next forward (the default, which clips exactly); the same result as step() after "
                   "backward; needs --clip 0 and fp32 or bf16")
    t.add_argument("--moments", default="fp32", choices=["fp32", "bf16", "int8"], help="how AdamW keeps its "
                   "moments between steps: fp32 (default, torch's trajectory), bf16 (half the bytes) or int8 "
                   "(8-bit block-wise codes, about a quarter): fewer bytes read and written per step with states "
                   "on NVMe; see docs/benchmarks.md for the loss curves")
    t.add_argument("--corpus", default=None, help="UTF-8 text file to train on (default: generated arithmetic)")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    c = parser.add_argument_group("checkpoints and output")
    c.add_argument("--save-dir", default=None, help="checkpoint directory (default: no checkpoints)")
    c.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (default: only at the end)")
    c.add_argument("--resume", action="store_true", help="continue from --save-dir if a checkpoint is there")
    c.add_argument("--stop-at", type=int, default=None, help="stop after this step (saving a checkpoint when "
                   "--save-dir is set), as a job cut off by a time limit would; --resume continues the run")
    c.add_argument("--export-dir", default="./finetuned", help="export the trained model as safetensors here "
                   "(default ./finetuned; '' to skip)")
    c.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    for flag, path in (("--save-dir", args.save_dir), ("--export-dir", args.export_dir),
                       ("--nvme-path", args.nvme_path.replace("{rank}", "0").replace("{local_rank}", "0"))):
        unwritable = path and writable_parent(path)
        if unwritable:  # (found now, not after the training it would lose)
            parser.error(f"{flag} {path!r}: {unwritable}")
    if args.save_dir and not offload.checkpoint_exists(args.save_dir) and os.path.isdir(args.save_dir) \
            and os.listdir(args.save_dir):
        parser.error(f"--save-dir {args.save_dir!r} is not empty and holds no offload checkpoint (no manifest.json): "
                     "a checkpoint cannot be saved over it; choose another directory")
    if args.update_in_backward and (args.clip > 0 or args.dtype == "fp16"):
        parser.error("--update-in-backward updates during backward, before the total gradient norm or an "
                     "fp16 overflow is known: use it with --clip 0 and --dtype fp32 or bf16")
    rank, world = setup_distributed(args)
    logging.basicConfig(level=args.log_level.upper() if rank == 0 else "WARNING",
                        format="%(asctime)s %(message)s" if world == 1 else f"%(asctime)s [rank {rank}] %(message)s",
                        datefmt="%H:%M:%S")

    started = time.perf_counter()
    model, weights = build_model(args)
    if args.checkpointing:
        enable_checkpointing(model)
    # the process's peak RSS this run should reach (what the OOM killer reads), from a batch's shape
    shape = torch.empty(args.batch_size, args.seq_len, dtype=torch.long, device="meta")
    memory = offload.plan(model, offload_config(args), optimizer="adamw", moments=args.moments,
                          batch={"input_ids": shape, "labels": shape}, checkpoint=weights)  # (what wrap is given)
    try:
        memory.check()  # (a budget too small: every problem named now, with what fits, not one at a time later)
    except offload.MemoryPlanError as err:
        parser.exit(2, f"finetune.py: {err}\n")
    predicted = memory.predicted_rss
    model = offload.wrap(model, offload_config(args), checkpoint=weights)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = offload.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                        lr=args.lr, betas=(0.9, 0.95), moments=args.moments)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup))
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
    first = 0
    if args.resume and args.save_dir and offload.checkpoint_exists(args.save_dir):
        extra = offload.load_checkpoint(args.save_dir, model, opt)
        sched.load_state_dict(extra["scheduler"])
        offload.set_rng_state(extra["rng"])
        first = extra["step"]
        log.info("resumed from %s at step %d", args.save_dir, first)
    elif args.resume:
        log.info("--resume: no checkpoint in %s yet, starting at step 0", args.save_dir or "(no --save-dir)")
    log.info("model: %.1fM parameters; setup took %.1f s%s", params / 1e6, time.perf_counter() - started,
             "" if world == 1 else f"; partitioned over {world} ranks")

    data = batches(corpus(args), args, model.config.vocab_size, rank)
    for _ in range(first * args.grad_accum):  # the same batches as an uninterrupted run
        next(data)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    device = torch.device(args.device)
    try:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
        bar = tqdm(total=args.steps, initial=first, desc="train", unit="step", file=sys.stderr,
                   disable=rank != 0)
        redirect = logging_redirect_tqdm()  # log lines print above the bar, not through it
        redirect.__enter__()
    except ImportError:
        bar = redirect = None
    losses, times = [], []
    before = offload.stats(model)
    for step in range(first, args.steps):
        t0 = time.perf_counter()
        offload.reset_peak_stats(model)
        total = 0.0
        for micro in range(args.grad_accum):
            ids = next(data).to(device)
            loss = model(input_ids=ids, labels=ids).loss / args.grad_accum
            if args.update_in_backward and micro == args.grad_accum - 1:  # the step's last backward
                with opt.update_during_backward():
                    loss.backward()
            else:
                opt.scale_loss(loss).backward()
            total += float(loss.detach())
        if args.clip > 0:
            opt.clip_grad_norm_(args.clip)
        if world > 1:  # the mean over ranks, as the update sees it
            mean = torch.tensor([total], dtype=torch.float64)
            torch.distributed.all_reduce(mean)
            total = float(mean) / world
        offload.note_step(model, loss=total)  # into the step log line (--log-path) the step writes
        opt.step()
        opt.zero_grad()
        sched.step()
        seconds = time.perf_counter() - t0
        now = offload.stats(model)
        losses.append(total)
        times.append(seconds)
        log.info("step %d/%d loss %.4f | %.0f tok/s | %.2f s | read %s written %s | stall %.2f s | "
                 "peak device %s host %s | RSS %s, peak %s (plan %s)", step + 1, args.steps, total,
                 tokens_per_step / seconds, seconds, offload.format_size(now["read_bytes"] - before["read_bytes"]),
                 offload.format_size(now["write_bytes"] - before["write_bytes"]),
                 now["stall_seconds"] - before["stall_seconds"], offload.format_size(now["device_peak_bytes"]),
                 offload.format_size(now["host_peak_bytes"]), offload.format_size(now["rss_bytes"]),
                 offload.format_size(now["rss_peak_bytes"]), offload.format_size(predicted))
        if args.activations != "none":
            log.info("  activations: written %s, read %s, waited %.2f s; peak held %s (budget %s)",
                     offload.format_size(now["act_written_bytes"] - before["act_written_bytes"]),
                     offload.format_size(now["act_read_bytes"] - before["act_read_bytes"]),
                     now["act_stall_seconds"] - before["act_stall_seconds"],
                     offload.format_size(now["act_peak_bytes"]), args.activation_budget)
        if not math.isfinite(total):
            log.error("the loss is not finite at step %d: lower --lr or use --dtype bf16/fp32", step + 1)
            return 1
        before = now
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{total:.3f}")
        last = step + 1 == args.steps or step + 1 == args.stop_at
        if args.save_dir and (last or (args.save_every and (step + 1) % args.save_every == 0)):
            offload.save_checkpoint(args.save_dir, model, opt, extra={
                "step": step + 1, "scheduler": sched.state_dict(), "rng": offload.rng_state()})
            log.info("checkpoint saved to %s", args.save_dir)
        if step + 1 == args.stop_at:
            log.info("stopping at step %d as asked (--stop-at)", step + 1)
            break
    if bar is not None:
        bar.close()
        redirect.__exit__(None, None, None)
    opt.synchronize()
    if losses:
        log.info("done: %d steps, loss %.4f -> %.4f, median step %.2f s (%.0f tok/s)", len(losses), losses[0],
                 losses[-1], sorted(times)[len(times) // 2], tokens_per_step / sorted(times)[len(times) // 2])
    if args.export_dir:
        offload.export(model, args.export_dir)
        log.info("exported to %s (transformers' from_pretrained loads it)", args.export_dir)
    opt.close()
    if world > 1:
        offload.close(model)  # (unwrap would gather every parameter onto every rank)
        torch.distributed.destroy_process_group()
    else:
        offload.unwrap(model)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # (one line, not a traceback: nothing is wrong, and the run can go on)
        log.warning("interrupted: a checkpoint saved with --save-dir is whole; the same command with --resume "
                    "goes on from it")
        sys.exit(130)
