"""Head to head with DeepSpeed ZeRO-Infinity: the same GPT-2 training run and the same
forward, in one invocation, interleaved, next to plain in-memory torch.

    python benchmarks/vs_deepspeed.py --models 124M,355M --json docs/results/vs_deepspeed.json

For each model (GPT-2 shapes built from a config, random weights from seed 0, saved once as
safetensors under ``--path``, outside the repository by default and kept there for re-runs;
swap files are removed after each run), each round runs, every one in a fresh process so
that its peak RSS is its own:

  torch      the model in RAM, ``torch.optim.AdamW(fused=True)``: the in-memory reference;
  deepspeed  ZeRO-Infinity: ZeRO stage 3 with parameters and optimizer states on NVMe
             (``--ds-variant``, see DS_VARIANTS; the configuration is written into the JSON),
             DeepSpeedCPUAdam in AdamW mode with the same hyper-parameters;
  ours       ``offload.wrap`` with parameters and optimizer states on NVMe (O_DIRECT swap
             files), weights streamed from the safetensors, ``offload.AdamW``: without
             ``--clip`` updating each shard during backward (``update_during_backward``);
             with ``--clip``, ``backward(); clip_grad_norm_(); step()`` with the update in the
             next forward (the default: each group updated just before its next use);
  ours_next  (only with ``--systems ...,ours_next``) ``backward(); [clip]; step()`` with the
             default update in the next forward, with or without ``--clip``;
  ours_plain (only with ``--systems ...,ours_plain``) ``backward(); [clip]; step()`` with the
             update inside ``step()`` (``update_in_next_forward=False``);
  ours_FMT   (``--formats fp32,bf16,int8`` puts one per format in place of ``ours``) as ``ours``,
             with ``offload.AdamW(moments=FMT)``: the moments kept in fp32, bf16 or 8-bit codes.
             The JSON then has ``ours_FMT_step_s``, ``ours_FMT_bytes_per_param`` (bytes read
             plus written per step, per parameter) and ``ours_FMT_peak_rss_bytes``; the plain
             ``ours_*`` keys are fp32's;

and then the forward pass alone (no gradients, ``model.eval()``): torch in memory,
ZeRO-Inference (stage 3, parameters on NVMe, no optimizer) and ours (parameters on NVMe).

Training: batch ``--batch`` x ``--seq`` tokens, a new batch per step from a seeded generator
(the same for all three), fp32, AdamW lr ``--lr``, betas (0.9, 0.999), eps 1e-8, weight
decay ``--weight-decay`` on every parameter, gradient clipping at ``--clip`` (torch's
``clip_grad_norm_`` over the model's parameters for torch and ours, DeepSpeed's
``gradient_clipping``; none by default), GPT-2's dropout with the
torch RNG seeded just before the first step (the same masks everywhere); ``--warmup`` untimed steps
then ``--steps`` timed; the step time is the median of the timed steps (forward + backward +
optimizer step; ours returns from ``step()`` with write-backs in flight, which overlap the
next forward, so the last timed step includes waiting for them: ``opt.synchronize()``). The loss of
every step is recorded; ``*_max_loss_diff_vs_torch`` is the largest relative difference from
torch's loss at the same step. Inference: ``--infer-reps`` forwards of one batch, median.

Memory: peak RSS is the process's high-water mark (``ru_maxrss``: model building, loading
and every step included). Bytes read and written per step are the process's own block-device
I/O (``/proc/self/io``: ``read_bytes`` / ``write_bytes``, all threads), so they count what
reached the disk for every system alike, page-cache hits excluded. Both offloading systems
use O_DIRECT for their swap files, so their reads come from the disk.
"""

from __future__ import annotations

import argparse
import copy
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

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import gpt2_config as _gpt2_config  # noqa: E402
from _common import SCRATCH_HELP, disk_io_bytes, saved_gpt2, start  # noqa: E402

log = logging.getLogger("bench.vs_deepspeed")

# GPT-2 shapes: (layers, hidden, heads); vocabulary 50257, 1024 positions
MODELS = {"124M": (12, 768, 12), "355M": (24, 1024, 16), "774M": (36, 1280, 20), "1.5B": (48, 1600, 25)}

# ours: (device_budget, host_budget) per model unless --device-budget / --host-budget say
# otherwise; chosen so that the whole process stays below plain torch's RSS
BUDGETS = {"124M": ("256MiB", "1GiB"), "355M": ("512MiB", "3GiB"), "774M": ("768MiB", "4GiB"),
           "1.5B": ("1GiB", "6GiB")}

# ZeRO-Infinity configurations tried here. All keep parameters and optimizer states on NVMe;
# the notes say why each setting is there (defaults fail or keep the model in RAM).
_AIO = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
        "overlap_events": True}
DS_VARIANTS = {
    # sub_group_size 1e9: the optimizer swaps one large sub-group at a time
    "fast": {"zero": {"sub_group_size": int(1e9)}, "aio": _AIO},
    # sub_group_size 1e7: many small sub-groups, about half the RSS, slower
    "lean": {"zero": {"sub_group_size": int(1e7)}, "aio": _AIO},
    # "fast" with more I/O parallelism: 8 MiB blocks, 32 in flight, 4 aio threads
    "fast_aio": {"zero": {"sub_group_size": int(1e9)},
                 "aio": dict(_AIO, block_size=8 << 20, queue_depth=32, thread_count=4)},
}


def gpt2_config(name: str):
    return _gpt2_config(MODELS[name])


def prepare(name: str, root: str) -> str:
    """The model saved as safetensors (once per size and --path)."""
    return saved_gpt2(root, name, MODELS[name])


def build_in_memory(path: str):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(path)


def batch(step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 50257, (args.batch, args.seq), generator=g)


class DiskIo:
    """This process's block-device bytes (all threads), from /proc/self/io."""

    now = staticmethod(disk_io_bytes)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed_steps(step_fn, args, finish=None) -> dict:
    """Run warm-up + timed steps; ``step_fn(ids)`` returns the loss (a float). ``finish()``
    (writes still in flight) is timed as part of the last step."""
    times, losses, reads, writes = [], [], [], []
    torch.manual_seed(0)  # the same dropout masks in every system (same ops, same order)
    for i in range(args.warmup + args.steps):
        ids = batch(i, args)
        r0, w0 = DiskIo.now()
        t0 = time.perf_counter()
        loss = step_fn(ids)
        if finish is not None and i == args.warmup + args.steps - 1:
            finish()
        dt = time.perf_counter() - t0
        r1, w1 = DiskIo.now()
        losses.append(loss)
        log.info("step %d: %.2f s, loss %.6f, read %.2f GB, written %.2f GB", i + 1, dt, loss,
                 (r1 - r0) / 1e9, (w1 - w0) / 1e9)
        if i >= args.warmup:
            times.append(dt), reads.append(r1 - r0), writes.append(w1 - w0)
    return {"step_s": statistics.median(times), "step_times_s": times, "losses": losses,
            "read_bytes_per_step": statistics.median(reads), "write_bytes_per_step": statistics.median(writes)}


def timed_forwards(forward_fn, args) -> dict:
    ids = batch(0, args)
    times, reads = [], []
    for i in range(args.infer_reps + 1):
        r0, _ = DiskIo.now()
        t0 = time.perf_counter()
        with torch.no_grad():
            loss = forward_fn(ids)
        dt = time.perf_counter() - t0
        r1, _ = DiskIo.now()
        log.info("forward %d: %.2f s, read %.2f GB", i + 1, dt, (r1 - r0) / 1e9)
        if i >= 1:  # the first builds caches (and, for DeepSpeed, its swap buffers)
            times.append(dt), reads.append(r1 - r0)
    return {"infer_s": statistics.median(times), "infer_times_s": times, "infer_loss": loss,
            "infer_read_bytes": statistics.median(reads)}


# -- workers (each a fresh process) ---------------------------------------------------------

def worker_torch(path: str, args) -> dict:
    model = build_in_memory(path)
    if args.job == "infer":
        model.eval()
        return timed_forwards(lambda ids: float(model(input_ids=ids, labels=ids).loss), args)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay, fused=True)

    phases = []

    def step(ids):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        log.info("  forward %.2f s, backward %.2f s, step() %.2f s", *phases[-1])
        return float(loss)

    out = timed_steps(step, args)
    timed = phases[args.warmup:]
    out["phases_s"] = {k: statistics.median(p[i] for p in timed) for i, k in enumerate(("forward", "backward", "step"))}
    return out


def deepspeed_config(args, config, swap: str, variant: str, infer: bool) -> dict:
    largest = config.vocab_size * config.n_embd  # the tied embedding, in elements
    zero = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": swap, "pin_memory": False,
                          # defaults fail ("Not enough buffers 0 for swapping 1") or keep models
                          # under 1B parameters in RAM (max_in_cpu)
                          "buffer_count": 10, "buffer_size": int(largest * 1.05), "max_in_cpu": 0},
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0,
    }
    if not infer:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap, "pin_memory": False,
                                     "buffer_count": 4}
        zero.update(DS_VARIANTS[variant]["zero"])
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "aio": dict(DS_VARIANTS[variant]["aio"]),
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if not infer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": args.weight_decay}}
        cfg["gradient_clipping"] = float(args.clip or 0.0)
    return cfg


def worker_deepspeed(path: str, args) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_in_memory(path)
    swap = tempfile.mkdtemp(prefix="ds-swap-", dir=args.path)
    try:
        infer = args.job == "infer"
        cfg = deepspeed_config(args, model.config, swap, args.ds_variant, infer)
        # partition the built model first: deepspeed.initialize alone casts it to bf16 here
        deepspeed.zero.Init(module=model, config_dict_or_path=copy.deepcopy(cfg))
        if infer:
            engine = deepspeed.initialize(model=model, config=copy.deepcopy(cfg))[0]
            engine.module.eval()
            out = timed_forwards(lambda ids: float(engine(input_ids=ids, labels=ids).loss), args)
        else:
            engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=copy.deepcopy(cfg))[0]
            engine.train()

            def step(ids):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                return float(loss)

            out = timed_steps(step, args)
        out["deepspeed_config"] = {k: v for k, v in cfg.items()}
        out["deepspeed_config"]["zero_optimization"] = json.loads(
            json.dumps(cfg["zero_optimization"]).replace(swap, "<swap dir>"))
        out["deepspeed_version"] = deepspeed.__version__
        return out
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def worker_ours(path: str, args) -> dict:
    import transformers

    import offload

    config = transformers.AutoConfig.from_pretrained(path)
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    swap = tempfile.mkdtemp(prefix="ours-swap-", dir=args.path)
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget=args.device_budget, host_budget=args.host_budget,
                                io_backend="direct")
    try:
        model = offload.wrap(model, cfg, checkpoint=path)
        if args.job == "infer":
            model.eval()
            out = timed_forwards(lambda ids: float(model(input_ids=ids, labels=ids).loss), args)
        else:
            model.train()
            opt = offload.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=args.weight_decay, moments=moments_of(args.worker),
                                update_in_next_forward=args.worker != "ours_plain")
            # (update_during_backward refuses clipping)
            overlap = args.worker not in ("ours_next", "ours_plain") and not args.clip

            phases = []

            def step(ids):
                t0 = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                t1 = time.perf_counter()
                if overlap:
                    with opt.update_during_backward():
                        loss.backward()
                else:
                    loss.backward()
                t2 = time.perf_counter()
                if args.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                opt.zero_grad()
                phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
                log.info("  forward %.2f s, backward %.2f s, step() %.2f s", *phases[-1])
                return float(loss)

            # a step's write-backs overlap the next forward; the last step waits for them
            out = timed_steps(step, args, finish=opt.synchronize)
            timed = phases[args.warmup:]
            out["phases_s"] = {k: statistics.median(p[i] for p in timed)
                               for i, k in enumerate(("forward", "backward", "step"))}
            out["optimizer_stats"] = dict(opt.stats)
            opt.close()
        stats = offload.stats(model)
        out["offload_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        offload.close(model)
        return out
    finally:
        shutil.rmtree(swap, ignore_errors=True)


FORMATS = ("fp32", "bf16", "int8")
WORKERS = {"torch": worker_torch, "deepspeed": worker_deepspeed, "ours": worker_ours, "ours_next": worker_ours,
           "ours_plain": worker_ours, **{f"ours_{fmt}": worker_ours for fmt in FORMATS}}


def moments_of(worker: str) -> str:
    """The moments format a worker of ours runs with (``ours_FMT``; fp32 otherwise)."""
    fmt = worker.rsplit("_", 1)[-1]
    return fmt if fmt in FORMATS else "fp32"


def run_worker(system: str, job: str, path: str, args, name: str) -> dict | None:
    device_budget = args.device_budget or BUDGETS[name][0]
    host_budget = args.host_budget or BUDGETS[name][1]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--job", job, "--model-path", path,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--seq", str(args.seq), "--lr", str(args.lr), "--weight-decay", str(args.weight_decay),
           "--path", args.path, "--device-budget", device_budget, "--host-budget", host_budget,
           "--ds-variant", args.ds_variant, "--infer-reps", str(args.infer_reps)] + \
        (["--clip", str(args.clip)] if args.clip else [])
    log.info("%s %s %s ...", os.path.basename(path), system, job)
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        log.warning("%s %s worker failed (exit %d):\n%s", system, job, out.returncode, out.stderr[-4000:])
        return None
    result = json.loads(out.stdout.strip().splitlines()[-1])
    log.info("  done in %.0f s: %s", time.perf_counter() - t,
             f"{result['step_s']:.2f} s/step" if "step_s" in result else f"{result['infer_s']:.2f} s/forward")
    return result


def max_rel_diff(losses, reference) -> float | None:
    if losses is None or reference is None:
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def median_of(results: list, key: str):
    vals = [r[key] for r in results if r is not None and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--models", default="124M,355M", help=f"comma list of {', '.join(MODELS)} (default 124M,355M)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds: each runs every system once "
                        "(default 1); figures are medians over rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per run (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, all systems (default 1e-4)")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    parser.add_argument("--clip", type=float, default=None, help="clip the gradients' total norm to this value in "
                        "every system (torch's clip_grad_norm_; DeepSpeed's gradient_clipping); default: no clipping")
    parser.add_argument("--infer-reps", type=int, default=3, help="timed forwards for inference (default 3)")
    parser.add_argument("--device-budget", default=None, help="ours: device_budget, the most parameter "
                        "bytes in use at once on the compute device (default per model, BUDGETS)")
    parser.add_argument("--host-budget", default=None, help="ours: host_budget, the most bytes of host "
                        "buffers (default per model, BUDGETS)")
    parser.add_argument("--ds-variant", default="fast", choices=sorted(DS_VARIANTS),
                        help="ZeRO-Infinity configuration (default fast: sub_group_size 1e9)")
    parser.add_argument("--systems", default="torch,deepspeed,ours", help="which to run, of torch, deepspeed, "
                        "ours, ours_next, ours_plain (default torch,deepspeed,ours)")
    parser.add_argument("--formats", default=None, help="run ours once per moments format of this comma list "
                        "(fp32, bf16, int8) in place of the single fp32 run (default: fp32 only, as 'ours')")
    parser.add_argument("--jobs", default="train,infer", help="train, infer or both (default both)")
    parser.add_argument("--path", default=None, help="directory on the disk under test for models and swap "
                        f"files (default: {SCRATCH_HELP.format(name='vs-deepspeed')}); models are kept there "
                        "for re-runs")
    parser.add_argument("--json", default=None, help="write the report as JSON to this path")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    start(args, "vs-deepspeed")
    if args.worker:
        out = WORKERS[args.worker](args.model_path, args)
        out["peak_rss_bytes"] = peak_rss()
        print(json.dumps(out))
        return
    systems = args.systems.split(",")
    # the forward alone: one run of ours (the same forward whatever the optimizer)
    infer_systems = [s for s in systems if s not in ("ours_next", "ours_plain")]
    if args.formats and "ours" in systems:
        at = systems.index("ours")
        systems[at: at + 1] = [f"ours_{fmt}" for fmt in args.formats.split(",")]
    jobs = args.jobs.split(",")
    report = {"command": " ".join(sys.argv), "batch": args.batch, "seq": args.seq, "lr": args.lr,
              "weight_decay": args.weight_decay, "ds_variant": args.ds_variant, "clip": args.clip,
              "models": {}}
    for name in args.models.split(","):
        path = prepare(name, args.path)
        runs: dict[tuple[str, str], list] = {(s, j): [] for s in dict.fromkeys(systems + infer_systems) for j in jobs}
        for r in range(args.rounds):
            for job in jobs:
                for system in (infer_systems if job == "infer" else systems):
                    runs[(system, job)].append(run_worker(system, job, path, args, name))
        entry: dict = {"params": sum(p.numel() for p in build_in_memory(path).parameters()),
                       "ours_device_budget": args.device_budget or BUDGETS[name][0],
                       "ours_host_budget": args.host_budget or BUDGETS[name][1]}
        for system in dict.fromkeys(systems + infer_systems):
            train = runs.get((system, "train"), [])
            infer = runs.get((system, "infer"), [])
            entry[f"{system}_step_s"] = median_of(train, "step_s")
            entry[f"{system}_peak_rss_bytes"] = median_of(train, "peak_rss_bytes")
            entry[f"{system}_read_bytes_per_step"] = median_of(train, "read_bytes_per_step")
            entry[f"{system}_write_bytes_per_step"] = median_of(train, "write_bytes_per_step")
            entry[f"{system}_infer_s"] = median_of(infer, "infer_s")
            entry[f"{system}_infer_peak_rss_bytes"] = median_of(infer, "peak_rss_bytes")
            entry[f"{system}_losses"] = next((r["losses"] for r in train if r), None)
            entry[f"{system}_runs"] = {"train": train, "infer": infer}
            if system in {f"ours_{fmt}" for fmt in FORMATS}:
                moved = [(r["read_bytes_per_step"] + r["write_bytes_per_step"]) / entry["params"] for r in train if r]
                entry[f"{system}_bytes_per_param"] = statistics.median(moved) if moved else None
        if "ours_fp32" in systems:  # (the training keys a run without --formats writes)
            for key in [k for k in entry if k.startswith("ours_fp32_") and "infer" not in k]:
                if entry.get("ours_" + key[len("ours_fp32_"):]) is None:
                    entry["ours_" + key[len("ours_fp32_"):]] = entry[key]
        ref = entry.get("torch_losses")
        for system in systems:
            if system != "torch":
                entry[f"{system}_max_loss_diff_vs_torch"] = max_rel_diff(entry[f"{system}_losses"], ref)
        if entry.get("deepspeed_step_s") and entry.get("ours_step_s"):
            entry["ours_speedup_vs_deepspeed"] = entry["deepspeed_step_s"] / entry["ours_step_s"]
        if entry.get("torch_step_s") and entry.get("ours_step_s"):
            entry["ours_vs_torch_step"] = entry["ours_step_s"] / entry["torch_step_s"]
        for system in systems:
            if system.startswith("ours_") and entry.get("torch_step_s") and entry.get(f"{system}_step_s"):
                entry[f"{system}_vs_torch_step"] = entry[f"{system}_step_s"] / entry["torch_step_s"]
        if entry.get("deepspeed_infer_s") and entry.get("ours_infer_s"):
            entry["ours_infer_speedup_vs_deepspeed"] = entry["deepspeed_infer_s"] / entry["ours_infer_s"]
        ds_run = next((r for r in runs.get(("deepspeed", "train"), []) if r), None)
        if ds_run:
            entry["deepspeed_config"] = ds_run["deepspeed_config"]
            entry["deepspeed_version"] = ds_run["deepspeed_version"]
        report["models"][name] = entry
        print_table(name, entry, list(dict.fromkeys(systems + (infer_systems if "infer" in jobs else []))))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        log.info("wrote %s", args.json)


def print_table(name: str, e: dict, systems: list[str]) -> None:
    def f(v, scale=1.0, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v / scale)

    print(f"\n{name} ({e['params'] / 1e6:.0f}M parameters)")
    print("system      step s  peak RSS GiB  read GB/step  written GB/step  forward s  max loss diff vs torch")
    for s in systems:
        diff = e.get(f"{s}_max_loss_diff_vs_torch")
        print(f"{s:10s} {f(e[f'{s}_step_s']):>7s} {f(e[f'{s}_peak_rss_bytes'], 2**30):>13s} "
              f"{f(e[f'{s}_read_bytes_per_step'], 1e9):>13s} {f(e[f'{s}_write_bytes_per_step'], 1e9):>16s} "
              f"{f(e[f'{s}_infer_s']):>10s} {f(diff, fmt='{:.1e}') if s != 'torch' else '-':>23s}")
    for s in systems:
        if e.get(f"{s}_bytes_per_param") is not None:
            ratio = e.get(f"{s}_vs_torch_step")
            print(f"{s}: {e[f'{s}_bytes_per_param']:.1f} bytes moved per parameter per step"
                  + (f", step {ratio:.2f}x torch's" if ratio else ""))
    for key, label in (("ours_speedup_vs_deepspeed", "ours step vs ZeRO-Infinity"),
                       ("ours_vs_torch_step", "ours step / torch step"),
                       ("ours_infer_speedup_vs_deepspeed", "ours forward vs ZeRO-Inference")):
        if e.get(key) is not None:
            print(f"{label}: {e[key]:.2f}x")


if __name__ == "__main__":
    main()
