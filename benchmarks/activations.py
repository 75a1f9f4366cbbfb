"""How large a batch trains under a fixed RAM cap, with activations kept, checkpointed, or
offloaded to NVMe (``OffloadConfig.activation_tier``), parameters and AdamW states on NVMe.

    python benchmarks/activations.py --model 355M --cap 12GiB --json act.json
    python benchmarks/activations.py --model 6,384,6 --seq 1024 --cap 3GiB --json small.json

Modes, each a fresh process per (mode, batch), interleaved (every batch size runs the modes
still in the race, in an order that rotates):

  none       no checkpointing; activations stay in RAM
  ckpt_ram   transformers' gradient checkpointing; the checkpoints stay in RAM
  ckpt_nvme  gradient checkpointing; the checkpoints (and what the loss saves) beyond
             --act-budget go to NVMe
  all_nvme   no checkpointing, no recompute; every saved tensor (of 1 MiB and more) beyond
             --act-budget to NVMe

The batch doubles from 1 while a mode fits. The RAM cap is a memory cgroup of the worker
(cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes``; this needs root): a worker the
kernel kills for it (exit 137) did not fit. A cgroup counts page cache too; offload reads and
writes its swap files with O_DIRECT, so its bytes do not pass through the cache.

With ``--device cuda`` the model computes on the GPU and what bounds the batch is device
memory: ``--device-cap`` caps it (torch's per-process fraction; a worker the allocator
refuses did not fit), ``--cap none`` leaves RAM uncapped, and each run adds its peak device
bytes (``peak_device_bytes``). ``ckpt_ram`` then keeps the checkpoints in device memory.

Per run: peak RSS (sampled every 5 ms), the median step time of ``--steps`` steps after one
not timed, tokens per second, activation bytes written and read per step and the seconds
compute waited for them (offload's step log). JSON: ``ram_cap_bytes`` and a list ``runs``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, PeakRss, saved_gpt2, start  # noqa: E402

log = logging.getLogger("bench.activations")

OUT_OF_DEVICE_MEMORY = 3  # a worker's exit status when the device's allocator refused it
MODES = ("none", "ckpt_ram", "ckpt_nvme", "all_nvme", "ckpt_host", "all_host")
SHAPES = {"124M": (12, 768, 12), "355M": (24, 1024, 16), "774M": (36, 1280, 20)}


def shape_of(name: str) -> tuple[int, int, int]:
    if name in SHAPES:
        return SHAPES[name]
    try:
        layers, hidden, heads = (int(x) for x in name.split(","))
    except ValueError:
        raise SystemExit(f"--model {name!r}: use one of {sorted(SHAPES)} or LAYERS,HIDDEN,HEADS") from None
    return layers, hidden, heads


def worker(args) -> dict:
    import transformers

    import offload

    config = transformers.AutoConfig.from_pretrained(args.model_path)
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    swap = args.swap
    act = {}
    if args.mode.endswith(("_nvme", "_host")):
        act = dict(activation_tier=args.mode.split("_")[1], activation_budget=args.act_budget,
                   activation_host_budget=args.act_host_budget)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # (the per-process fraction wants an index)
    if device.type == "cuda" and args.device_cap:
        from offload._units import parse_size

        cap = parse_size(args.device_cap, name="--device-cap")
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(device).total_memory),
                                                   device)
    cfg = offload.OffloadConfig(device=args.device, param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget=max(params * 4 // 3, 2 * config.vocab_size * config.n_embd * 4
                                                  + (64 << 20)),
                                host_budget=args.host_budget, file_size="1GiB", host_allocator=args.host_allocator,
                                **act)
    try:
        model = offload.wrap(model, cfg, checkpoint=args.model_path)
        model.train()
        if args.mode.startswith("ckpt"):
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # (transformers 5.x's name)
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        opt = offload.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                            generator=torch.Generator().manual_seed(0)).to(device)
        torch.manual_seed(0)  # (the dropout masks: the same in every mode)
        rss = PeakRss().start()
        rows = []
        for i in range(args.steps + 1):
            before = offload.stats(model)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            now = offload.stats(model)
            row = {k: now[f"act_{k}"] - before[f"act_{k}"] for k in ("written_bytes", "read_bytes")}
            row.update(step_s=seconds, forward_s=t1 - t0, backward_s=t2 - t1,
                       stall_s=now["act_stall_seconds"] - before["act_stall_seconds"])
            log.info("%s batch %d step %d: %.2f s (forward %.2f, backward %.2f), loss %.4f, activations %.0f MB "
                     "written, stall %.2f s", args.mode, args.batch, i + 1, seconds, row["forward_s"],
                     row["backward_s"], float(loss), row["written_bytes"] / 1e6, row["stall_s"])
            if i >= 1:
                rows.append(row)
        out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        stats = offload.stats(model)  # (the activations' peak over the run: in place, read back, read ahead)
        out.update(peak_rss_bytes=rss.stop(), params=params, loss=float(loss), act_peak_bytes=stats["act_peak_bytes"],
                   act_buffer_peak_bytes=stats["act_buffer_peak_bytes"],
                   peak_device_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
        opt.close()
        offload.close(model)
        return out
    finally:
        shutil.rmtree(swap, ignore_errors=True)


class MemoryCap:
    """A memory cgroup of ``limit`` bytes for the workers (v2 ``memory.max`` or v1)."""

    def __init__(self, limit: int | None):
        self.limit, self.dir = limit, None
        if limit is None:  # (--cap none: the workers run uncapped)
            return
        name = f"offload-bench-{os.getpid()}"
        v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        root = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory"
        self.dir = os.path.join(root, name)
        try:
            os.makedirs(self.dir, exist_ok=True)
            with open(os.path.join(self.dir, "memory.max" if v2 else "memory.limit_in_bytes"), "w") as fh:
                fh.write(str(limit))
        except OSError as err:
            raise SystemExit(f"cannot make a memory cgroup in {root} ({err.strerror}): the RAM cap needs root and "
                             "a memory controller") from None

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the cgroup (the shell joins it, then becomes the worker)."""
        if self.dir is None:
            return cmd
        procs = os.path.join(self.dir, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "worker", *cmd]

    def close(self) -> None:
        if self.dir is None:
            return
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


def run(args, cap: MemoryCap, path: str, mode: str, batch: int) -> dict:
    swap = tempfile.mkdtemp(prefix="swap-", dir=args.path)  # (removed here: a worker the cap kills cannot)
    cmd = [sys.executable, __file__, "--worker", mode, "--model-path", path, "--batch", str(batch), "--seq",
           str(args.seq), "--steps", str(args.steps), "--path", args.path, "--host-budget", args.host_budget,
           "--act-budget", args.act_budget, "--act-host-budget", args.act_host_budget, "--host-allocator", args.host_allocator, "--swap", swap,
           "--device", args.device, *(["--device-cap", args.device_cap] if args.device_cap else [])]
    try:
        out = subprocess.run(cap.command(cmd), capture_output=True, text=True)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    row = {"model": args.model, "mode": mode, "batch": batch, "fits": out.returncode == 0}
    if out.returncode != 0:
        capped = out.returncode in (137, -9, OUT_OF_DEVICE_MEMORY)
        why = {137: "killed by the RAM cap", -9: "killed by the RAM cap",
               OUT_OF_DEVICE_MEMORY: "out of device memory"}.get(out.returncode, f"exit {out.returncode}")
        log.info("%s batch %d: does not fit (%s)%s", mode, batch, why, "" if capped else "\n" + out.stderr[-2000:])
        return {**row, "peak_rss_bytes": None, "step_s": None, "tokens_per_s": None, "act_written_bytes": None,
                "act_read_bytes": None, "stall_s": None, "act_peak_bytes": None, "peak_device_bytes": None}
    got = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(peak_rss_bytes=got["peak_rss_bytes"], step_s=got["step_s"],
               tokens_per_s=batch * args.seq / got["step_s"], act_written_bytes=got["written_bytes"],
               act_read_bytes=got["read_bytes"], stall_s=got["stall_s"], forward_s=got["forward_s"],
               backward_s=got["backward_s"], loss=got["loss"], act_peak_bytes=got["act_peak_bytes"],
               act_buffer_peak_bytes=got["act_buffer_peak_bytes"], peak_device_bytes=got["peak_device_bytes"])
    log.info("%s batch %d: %.2f s/step, %.0f tokens/s, peak RSS %.2f GiB, activations %.2f GB written, stall %.2f s%s",
             mode, batch, row["step_s"], row["tokens_per_s"], row["peak_rss_bytes"] / 2**30,
             row["act_written_bytes"] / 1e9, row["stall_s"],
             f", peak device {row['peak_device_bytes'] / 2**30:.2f} GiB" if row["peak_device_bytes"] else "")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="355M", help=f"one of {sorted(SHAPES)}, or LAYERS,HIDDEN,HEADS "
                        "(GPT-2 vocabulary and 1024 positions); default 355M")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--cap", default="12GiB", help="the workers' RAM cap (a memory cgroup; default 12GiB); "
                        "'none' runs them uncapped")
    parser.add_argument("--device", default="cpu", help="where the model computes: 'cpu' (default) or 'cuda'; on "
                        "'cuda' the modes' activations stay in (or leave) device memory, and each run reports its "
                        "peak device bytes")
    parser.add_argument("--device-cap", default=None, help="on 'cuda', the device memory a worker may allocate "
                        "(torch's per-process fraction); a worker refused more does not fit")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes instead of doubling from 1 to "
                        "--max-batch")
    parser.add_argument("--modes", default=",".join(MODES[:4]), help=f"comma-separated subset of {MODES} "
                        f"(default the first four; the _host modes rest activations in host memory)")
    parser.add_argument("--max-batch", type=int, default=64, help="stop doubling here (default 64)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per run, after one not timed (default 1)")
    parser.add_argument("--host-budget", default="2GiB", help="offload's host budget for parameters (default 2GiB)")
    parser.add_argument("--act-budget", default="256MiB",
                        help="activation_budget of the NVMe modes: saved bytes kept in RAM (default 256MiB)")
    parser.add_argument("--act-host-budget", default="auto", help="activation_host_budget: the write buffers "
                        "(nvme) or where activations rest (host); default 'auto'")
    parser.add_argument("--host-allocator", default="auto", choices=["auto", "lean", "system"],
                        help="OffloadConfig.host_allocator of every mode: 'lean' makes RSS follow the tensors "
                             "alive, 'system' (what 'auto' is on a CPU device) lets malloc keep freed memory "
                             "(docs/memory.md); default auto")
    parser.add_argument("--path", default=None, help=f"scratch directory (models, swap files); default {SCRATCH_HELP}")
    parser.add_argument("--json", default=None, help="write the runs here as JSON")
    parser.add_argument("--worker", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--swap", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode is not None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
        try:
            print(json.dumps(worker(args)))
        except Exception as err:  # (offload may raise the allocator's refusal as the cause of its own error)
            if not any(isinstance(e, torch.OutOfMemoryError) for e in (err, err.__cause__, err.__context__)):
                raise
            log.info("out of device memory: %s", str(err).splitlines()[0])
            sys.exit(OUT_OF_DEVICE_MEMORY)
        return
    start(args, "activations")
    from offload._units import parse_size

    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes {args.modes!r}: use a comma-separated subset of {MODES}")
    shape = shape_of(args.model)
    path = saved_gpt2(args.path, args.model.replace(",", "x"), shape)
    cap = MemoryCap(None if args.cap == "none" else parse_size(args.cap, name="--cap"))
    batches = [int(b) for b in args.batches.split(",")] if args.batches else \
        [1 << i for i in range(args.max_batch.bit_length()) if 1 << i <= args.max_batch]
    runs, racing, turn = [], list(modes), 0
    try:
        for batch in batches:
            if not racing:
                break
            order = racing[turn % len(racing):] + racing[: turn % len(racing)]
            for mode in order:
                row = run(args, cap, path, mode, batch)
                runs.append(row)
                if not row["fits"]:
                    racing.remove(mode)
            turn += 1
    finally:
        cap.close()
    print(f"\nGPT-2 {args.model}, sequence {args.seq}, RAM cap {args.cap}, device {args.device}"
          + (f", device cap {args.device_cap}" if args.device_cap else ""))
    print(f"{'mode':<10} {'batch':>5} {'fits':>5} {'step s':>8} {'tok/s':>8} {'peak RSS GiB':>13} {'act GB w/r':>12}"
          f" {'stall s':>8}")
    for r in runs:
        if r["fits"]:
            print(f"{r['mode']:<10} {r['batch']:>5} {'yes':>5} {r['step_s']:>8.2f} {r['tokens_per_s']:>8.0f} "
                  f"{r['peak_rss_bytes'] / 2**30:>13.2f} {r['act_written_bytes'] / 1e9:>5.2f}/"
                  f"{r['act_read_bytes'] / 1e9:<6.2f} {r['stall_s']:>8.2f}")
        else:
            print(f"{r['mode']:<10} {r['batch']:>5} {'no':>5}")
    best = {m: max((r for r in runs if r["mode"] == m and r["fits"]), key=lambda r: r["batch"], default=None)
            for m in modes}
    for m, r in best.items():
        if r is not None:
            print(f"{m}: largest batch {r['batch']}, best {max(x['tokens_per_s'] for x in runs if x['mode'] == m and x['fits']):.0f} tokens/s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ram_cap_bytes": cap.limit, "model": args.model, "seq": args.seq, "runs": runs,
                       "host_allocator": args.host_allocator, "act_budget": args.act_budget,
                       "torch": torch.__version__, "device": args.device, "device_cap": args.device_cap},
                      fh, indent=1)
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()
