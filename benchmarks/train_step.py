"""Training step time up a ladder of model sizes, parameters and AdamW states on NVMe, next to
the in-memory torch step of the same model and a lower bound from this machine's disk.

    python benchmarks/train_step.py --sizes 100M,200M,400M --steps 3 --json train.json
    python benchmarks/train_step.py --sizes 2B --steps 2 --no-memory --json top.json   # > RAM

Each size is a GPT-2-style model (hidden 1024 up to 400M, wider above) built from a config
with random weights and saved once as safetensors in ``--path`` (outside the repository by
default, see ``--help``; the models are kept there for re-runs, swap files are removed); every
run is a fresh process (so peak RSS is its own):

  memory  plain torch: the model in RAM, torch.optim.AdamW(fused=True); times forward +
          backward and the optimizer step separately (the compute terms of the bound);
          skipped when model + grads + states (16 B/parameter) do not fit in 80% of RAM;
  ours    the model built on the meta device and streamed from the safetensors into
          offload's NVMe tier (device budget below the model's size: a third of it, at least
          twice the embedding + 64 MiB), offload.AdamW with states on NVMe;
          ``backward(); [clip]; step()`` with the update in the next forward (the default;
          ``--update-in-step``: inside ``step()``). A step is timed from its forward to the
          next step's forward (so it holds the previous step's update, run in its forward),
          the last one to the end of ``synchronize()`` (its own update and write-backs).

``--clip NORM`` clips both runs with ``torch.nn.utils.clip_grad_norm_`` over the model's
parameters before ``step()`` (Trainer's default is 1.0); none by default.

Batch ``--batch`` x ``--seq`` tokens, fp32, 2 warm-up steps not timed, then the median of
``--steps``. Bytes read and written per step come from offload's own counters (the
optimizer's part separately). Page cache: offload's swap files are read and written with
O_DIRECT, so the page cache serves none of these bytes.

Lower bound = max(forward+backward compute, parameter bytes / disk) + max(optimizer
compute, optimizer bytes / disk), with compute from the in-memory run (scaled by
parameter count from the largest measured size when the model does not fit) and the
disk's read and write bandwidth measured in the same invocation by offload-profile's quick
sweep (``offload.profile.run_profile``: the sustained O_DIRECT read and write of offload's
engine, of bytes not moved recently).
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

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, PeakRss, disk_bandwidth, run_json_worker, saved_gpt2, start  # noqa: E402
from _common import gpt2_config as _gpt2_config  # noqa: E402

log = logging.getLogger("bench.train")

# (layers, hidden, heads) per nominal size; vocabulary 50257, 1024 positions
SHAPES = {"100M": (6, 1024, 16), "200M": (14, 1024, 16), "400M": (30, 1024, 16),
          "800M": (30, 1536, 16), "1.6B": (40, 1920, 16), "2B": (48, 2048, 16)}


def gpt2_config(name: str):
    return _gpt2_config(SHAPES[name])


def prepare(name: str, root: str) -> str:
    """The model saved as safetensors (once per size and --path)."""
    return saved_gpt2(root, name, SHAPES[name])


def worker_memory(path: str, args) -> dict:
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    ids = torch.randint(0, 50257, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    fb, st, total, losses = [], [], [], []
    rss = PeakRss().start()
    torch.manual_seed(0)  # the same dropout masks in both runs (same ops, same order)
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        t1 = time.perf_counter()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        losses.append(float(loss))
        if i >= 2:
            fb.append(t1 - t0), st.append(t2 - t1), total.append(t2 - t0)
    return {"step_s": statistics.median(total), "fwd_bwd_s": statistics.median(fb), "opt_s": statistics.median(st),
            "peak_rss_bytes": rss.stop(), "losses": losses, "params": sum(p.numel() for p in model.parameters())}


def worker_ours(path: str, args) -> dict:
    import transformers

    import offload

    config = transformers.AutoConfig.from_pretrained(path)
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    swap = tempfile.mkdtemp(prefix="swap-", dir=args.path)
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget=device_budget(config, params), host_budget=args.host_budget,
                                file_size="1GiB")
    try:
        model = offload.wrap(model, cfg, checkpoint=path)
        model.train()
        opt = offload.AdamW(model.parameters(), lr=args.lr, update_in_next_forward=not args.update_in_step)
        ids = torch.randint(0, 50257, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        rows, losses = [], []
        rss = PeakRss().start()
        last = args.steps + 1
        before, ob = offload.stats(model), dict(opt.stats)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        for i in range(args.steps + 2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            t1 = time.perf_counter()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()
            if i == last:
                opt.synchronize()  # (the update of the last step, and its write-backs)
            t2 = time.perf_counter()
            now, on = offload.stats(model), dict(opt.stats)
            losses.append(float(loss))
            log.info("ours step %d: %.2f s (fwd+bwd %.2f), loss %.4f", i + 1, t2 - t0, t1 - t0, float(loss))
            if i >= 2:
                rows.append({"step_s": t2 - t0, "fwd_bwd_s": t1 - t0,
                             "read_bytes": now["read_bytes"] - before["read_bytes"],
                             "write_bytes": now["write_bytes"] - before["write_bytes"],
                             "opt_read_bytes": on["read_bytes"] - ob["read_bytes"],
                             "opt_write_bytes": on["write_bytes"] - ob["write_bytes"],
                             "stall_s": now["stall_seconds"] - before["stall_seconds"]})
            before, ob, t0 = now, on, t2
        out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out.update(peak_rss_bytes=rss.stop(), losses=losses, params=params,
                   device_peak_bytes=offload.stats(model)["device_peak_bytes"])
        opt.close()
        offload.unwrap(model)
        return out
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def device_budget(config, params: int) -> int:
    """Below the model's size: a third of it, but room for the tied embedding (the largest
    group, used at both ends of the pass) twice over plus 64 MiB for the layers streaming by."""
    return max(params * 4 // 3, 2 * config.vocab_size * config.n_embd * 4 + (64 << 20))


def run_worker(mode: str, path: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", mode, "--model-path", path, "--steps", str(args.steps),
           "--batch", str(args.batch), "--seq", str(args.seq), "--host-budget", args.host_budget, "--path", args.path,
           "--lr", str(args.lr)] + (["--clip", str(args.clip)] if args.clip else []) + \
        (["--update-in-step"] if args.update_in_step else [])
    return run_json_worker(cmd, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--sizes", default="100M,200M,400M", help=f"comma list of {', '.join(SHAPES)} (default 100M,200M,400M)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after 2 warm-up steps (default 3)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--host-budget", default="4GiB", help="offload's host budget (default 4GiB)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, both runs (default 1e-4)")
    parser.add_argument("--path", default=None, help="directory on the disk to use for models and swap files "
                        f"(default: {SCRATCH_HELP.format(name='train-step')}); models are kept there for re-runs")
    parser.add_argument("--clip", type=float, default=None, help="clip the gradients' total norm to this value in "
                        "both runs (torch.nn.utils.clip_grad_norm_); default: no clipping")
    parser.add_argument("--update-in-step", action="store_true", help="ours: update inside step() "
                        "(update_in_next_forward=False) instead of during the next forward (the default)")
    parser.add_argument("--no-memory", action="store_true", help="skip the in-memory torch runs")
    parser.add_argument("--json", default=None, help="write the report as JSON to this path")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    start(args, "train-step")
    if args.worker:
        fn = worker_memory if args.worker == "memory" else worker_ours
        print(json.dumps(fn(args.model_path, args)))
        return
    ram = psutil.virtual_memory().total
    report = {"command": " ".join(sys.argv), "batch": args.batch, "seq": args.seq, "clip": args.clip,
              "update": "in step()" if args.update_in_step else "in the next forward", "ladder": []}
    scale = None  # (fwd_bwd, opt) seconds per parameter from the largest in-memory run
    for size in args.sizes.split(","):
        path = prepare(size, args.path)
        disk = disk_bandwidth(args.path, 1 << 30)
        read_gbps, write_gbps = disk["read_gbps"], disk["write_gbps"]
        read_bw, write_bw = read_gbps * 1e9, write_gbps * 1e9
        entry = {"size": size, "disk_read_gbps": read_gbps, "disk_write_gbps": write_gbps}
        mem = None
        config = gpt2_config(size)
        nparams = config.n_layer * 12 * config.n_embd ** 2 + config.vocab_size * config.n_embd
        if not args.no_memory and nparams * 16 < 0.8 * ram:
            mem = run_worker("memory", path, args)
        ours = run_worker("ours", path, args)
        if ours is None:
            continue
        params = ours["params"]
        if mem is not None:
            scale = (mem["fwd_bwd_s"] / params, mem["opt_s"] / params)
        fwd_bwd = mem["fwd_bwd_s"] if mem else (scale[0] * params if scale else None)
        opt_s = mem["opt_s"] if mem else (scale[1] * params if scale else None)
        param_read = ours["read_bytes"] - ours["opt_read_bytes"]
        param_write = ours["write_bytes"] - ours["opt_write_bytes"]
        param_io = param_read / read_bw + param_write / write_bw
        opt_io = ours["opt_read_bytes"] / read_bw + ours["opt_write_bytes"] / write_bw
        bound = None if fwd_bwd is None else max(fwd_bwd, param_io) + max(opt_s, opt_io)
        entry.update(params=params, step_s=ours["step_s"], memory_step_s=mem["step_s"] if mem else None,
                     lower_bound_s=bound, peak_rss_bytes=ours["peak_rss_bytes"], read_bytes=ours["read_bytes"],
                     write_bytes=ours["write_bytes"], stall_s=ours["stall_s"], fwd_bwd_s=fwd_bwd, opt_s=opt_s,
                     compute_extrapolated=mem is None, param_io_s=param_io, opt_io_s=opt_io,
                     tokens_per_s=args.batch * args.seq / ours["step_s"], losses=ours["losses"],
                     memory_peak_rss_bytes=mem["peak_rss_bytes"] if mem else None,
                     ours_vs_bound=bound / ours["step_s"] if bound else None,
                     ours_vs_memory=ours["step_s"] / mem["step_s"] if mem else None,
                     max_loss_diff_vs_memory=max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], mem["losses"]))
                     if mem else None,
                     device_peak_bytes=ours["device_peak_bytes"])
        report["ladder"].append(entry)
        log.info("%s (%.0fM): ours %.2f s/step (%.0f tok/s), in memory %s, bound %s, read %.1f GB, written %.1f GB, "
                 "stall %.2f s, peak RSS %.2f GiB", size, params / 1e6, ours["step_s"], entry["tokens_per_s"],
                 f"{mem['step_s']:.2f} s" if mem else "n/a", f"{bound:.2f} s ({bound / ours['step_s']:.2f})" if bound else "n/a",
                 ours["read_bytes"] / 1e9, ours["write_bytes"] / 1e9, ours["stall_s"], ours["peak_rss_bytes"] / 2**30)
    print("\nsize   params  ours s/step  tok/s  in-memory s  ours/memory  loss diff  bound s  bound/ours  read GB  "
          "written GB  stall s  peak RSS GiB")
    nan = float("nan")
    for e in report["ladder"]:
        print(f"{e['size']:6s} {e['params'] / 1e6:6.0f}M {e['step_s']:10.2f} {e['tokens_per_s']:6.0f} "
              f"{e['memory_step_s'] or nan:11.2f} {e['ours_vs_memory'] or nan:12.2f} "
              f"{e['max_loss_diff_vs_memory'] if e['max_loss_diff_vs_memory'] is not None else nan:10.1e} "
              f"{e['lower_bound_s'] or float('nan'):8.2f} "
              f"{e['ours_vs_bound'] or float('nan'):10.2f} {e['read_bytes'] / 1e9:8.1f} {e['write_bytes'] / 1e9:11.1f} "
              f"{e['stall_s']:8.2f} {e['peak_rss_bytes'] / 2**30:13.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
