"""Time to the first generated token, from process start, for a model larger than the RAM
left free: offload reading the checkpoint in place, offload copying it first, Accelerate,
and plain torch where the model fits.

    python benchmarks/time_to_first_token.py --json ttft.json
    python benchmarks/time_to_first_token.py --models gpt2-1.5B --rounds 2 --json ttft.json

Models, built once from configs with random weights (seed 0) and saved with
``save_pretrained(max_shard_size="2GB")`` under --path, kept for re-runs:

  gpt2-1.5B   GPT-2 XL's layout (48 layers, hidden 1600), fp32 files (6.2 GB)
  llama-3B    a Llama of 3.4B parameters (26 layers, hidden 3200, MLP 8640; OpenLLaMA 3B's
              shape), bf16 files (6.9 GB), computed in bf16

Modes, each a fresh process, interleaved (their order rotates per round):

  inplace     ``offload.wrap(model, cfg, checkpoint=dir)`` with ``read_in_place=True`` (the
              default): setup writes nothing; the first forward reads the weights from the
              checkpoint's files
  copy        the same with ``read_in_place=False``: every group copied into swap files
              first (what wrap did before)
  accelerate  ``from_pretrained(dir, device_map="auto", max_memory={"cpu": --device-budget},
              offload_folder=...)``: the layers beyond the memory given go to "disk",
              which for safetensors checkpoints Accelerate reads from the files themselves
  memory      ``from_pretrained(dir)``, the whole model in RAM: run without the balloon
              (it does not fit under it); the page cache is dropped first

The three disk modes run while a balloon process holds all but --reserve of the available
RAM (locked; this machine has no swap), after the page cache is dropped: the page cache
cannot keep the weights, as for a model larger than RAM. Each worker generates 16 tokens
greedily from a 128-token prompt; a streamer stamps each token on the system-wide
monotonic clock, which the parent also read just before starting the worker. Between
loading and the prompt each worker pauses to write and read back --evict bytes of other
data (O_DIRECT), left out of its times and of its bytes written: the virtual disk's host
caches recently written data, and without the pause the copy mode reads the swap files it
has just written from that cache (docs/benchmarks.md). Nothing is read in that pause:
offload reads nothing between ``wrap`` and the first forward. ``--settle`` waits longer
still, so that the copy mode's swap files are minutes old when its tokens read them (one
session saw data written minutes before read faster than older data; a later one, with
``--settle 300``, did not: docs/benchmarks.md, "Swap files five minutes old").

The lower bound of a cold start (``bound_s``) has three parts, measured in the same round:
the interpreter's start and the imports (a process that imports torch, transformers,
offload and the model's class, which transformers loads lazily, and exits), one read of
the checkpoint's bytes at the disk's sustained O_DIRECT read of fresh data
(``offload.profile``'s, on a 12 GiB test file it writes and removes, right before the
modes: it also leaves the virtual disk's host cache holding other data
than the checkpoint), and the prompt's forward with the weights in memory (timed in the
memory mode, after its first forward).

Per model in the JSON, for each mode in ``inplace``, ``copy``, ``accelerate``, ``memory``:
``<mode>_ttft_s``, ``<mode>_16tok_s``, ``<mode>_setup_written_bytes`` (bytes the worker
wrote to disk before its first token, /proc/self/io), ``<mode>_tok_s`` (tokens per second
after the first), ``<mode>_peak_rss_bytes`` (the worker's VmHWM), and the first token's parts
``<mode>_imports_s`` (process start to its imports done), ``<mode>_load_s`` (building or
loading and wrapping the model), ``<mode>_first_forward_s`` (the prompt to the first
token), and after the first token ``<mode>_read_bytes_per_tok`` (block-device bytes the
worker read per token, /proc/self/io), ``<mode>_stall_s_per_tok`` (offload's
``stall_seconds`` per token: the forward waiting on reads), ``<mode>_cpu_s_per_tok`` and
``<mode>_sys_s_per_tok`` (the process's CPU seconds per token, all threads, and of those
in the kernel); null where a mode
did not run; and ``bound_s`` with ``bound_imports_s``, ``bound_read_s``,
``bound_compute_s``, ``read_gbps``, ``checkpoint_bytes``, the ratios to the bound and to
the other modes, and whether every mode's tokens equal the memory mode's.
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
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (SCRATCH_HELP, Balloon, disk_bandwidth, disk_io_bytes, drop_caches, evict_host_cache,  # noqa: E402
                     start)

log = logging.getLogger("bench.ttft")
MODES = ("inplace", "copy", "accelerate", "memory")
PROMPT, NEW_TOKENS = 128, 16
MODELS = {
    "gpt2-124M": dict(family="gpt2", dtype="float32",  # (a quick check of the script: not in the default list)
                      config=dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt2-1.5B": dict(family="gpt2", dtype="float32",
                      config=dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024)),
    "llama-3B": dict(family="llama", dtype="bfloat16",
                     config=dict(num_hidden_layers=26, hidden_size=3200, intermediate_size=8640,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                 max_position_embeddings=2048)),
}


def _model_class(family: str):
    import transformers

    return {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[family]


def prepare(root: str, name: str) -> str:
    """``root/NAME``: the model saved as safetensors shards (built once, kept)."""
    import torch
    import transformers

    spec = MODELS[name]
    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    log.info("building and saving %s in %s (once)", name, path)
    config_cls = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig}[spec["family"]]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, spec["dtype"]))  # (built in its dtype: no fp32 copy of 3B in RAM)
    try:
        model = _model_class(spec["family"])(config_cls(**spec["config"]))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path, max_shard_size="2GB")
    return path


# -- the workers ------------------------------------------------------------------------------
def worker(args) -> dict:
    """One mode in this fresh process: load as the mode says, generate, stamp the tokens."""
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    imported_at = time.monotonic()

    spec = MODELS[args.name]
    path, cls = args.model_path, _model_class(spec["family"])
    dtype = getattr(torch, spec["dtype"])
    swap = os.path.join(args.path, f"swap-{args.mode}")
    folder = os.path.join(args.path, "accelerate-offload")
    if args.mode in ("inplace", "copy"):
        import offload

        config = transformers.AutoConfig.from_pretrained(path)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # (as from_pretrained builds it: buffers such as inv_freq stay fp32)
        try:
            with offload.init_empty_weights():
                model = cls(config)
        finally:
            torch.set_default_dtype(default)
        cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                    device_budget=args.device_budget, host_budget=args.host_budget,
                                    read_in_place=args.mode == "inplace", io_backend="direct",
                                    trace_path=os.path.join(args.trace, f"{args.name}-{args.mode}-{os.getpid()}.json")
                                    if args.trace else None)
        model = offload.wrap(model, cfg, checkpoint=path)
    elif args.mode == "accelerate":
        model = cls.from_pretrained(path, dtype=dtype, device_map="auto", max_memory={"cpu": args.device_budget},
                                    offload_folder=folder)
    else:
        model = cls.from_pretrained(path, dtype=dtype)
    model.eval()
    loaded_at = time.monotonic()
    pause, evict_written = 0.0, 0
    if args.evict:  # (nothing is read between loading and the prompt: checked for offload's modes)
        written = disk_io_bytes()[1]
        evict_host_cache(args.path, args.evict)
        pause, evict_written = time.monotonic() - loaded_at, disk_io_bytes()[1] - written
    if args.settle:  # (the copy mode's swap files grow as old as --settle before the prompt reads them)
        time.sleep(args.settle)
        pause = time.monotonic() - loaded_at
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))

    class Clock(BaseStreamer):
        def __init__(self):
            self.stamps: list[float] = []
            self.written: int | None = None
            self.read: list[int] = []  # block-device bytes read at the first token and at the last
            self.stalls: list[float] = []  # offload's stall seconds at the same two points
            self.times: list = []  # the process's CPU times at the same two points

        def put(self, value):
            self.stamps.append(time.monotonic())
            if len(self.stamps) == 2:  # (the first put is the prompt)
                self.written = disk_io_bytes()[1]
                import subprocess
                self.perf = subprocess.Popen(["perf", "record", "-F", "499", "-g", "-p", str(os.getpid()), "-o", f"/var/tmp/s58/perf-{args.mode}.data"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if args.mode in ("inplace", "copy"):
                    self.st0 = offload.stats(model)
            if len(self.stamps) == NEW_TOKENS + 1:
                import signal, json
                self.perf.send_signal(signal.SIGINT); self.perf.wait()
                if args.mode in ("inplace", "copy"):
                    st1 = offload.stats(model)
                    json.dump({"before": self.st0, "after": st1}, open(f"/var/tmp/s58/stats-{args.mode}.json", "w"), default=str)
            if len(self.stamps) in (2, NEW_TOKENS + 1):
                self.read.append(disk_io_bytes()[0])
                self.times.append(os.times())
                if args.mode in ("inplace", "copy"):
                    self.stalls.append(offload.stats(model)["stall_seconds"])

        def end(self):
            pass

    clock = Clock()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, streamer=clock)
        prefill_s = None
        if args.mode == "memory":  # the prompt's forward with the weights in memory (a bound's part)
            started = time.perf_counter()
            model(input_ids=ids)
            prefill_s = time.perf_counter() - started
    first, last = clock.stamps[1] - pause, clock.stamps[NEW_TOKENS] - pause  # (the pause left out)
    result = {"imported_at": imported_at, "loaded_at": loaded_at, "first_token_at": first, "last_token_at": last,
              "tok_s": (NEW_TOKENS - 1) / (last - first), "evict_s": pause,
              "setup_written_bytes": clock.written - evict_written, "peak_rss_bytes": _peak_rss(),
              "tokens": out[0, -NEW_TOKENS:].tolist(), "prefill_s": prefill_s,
              "read_bytes_per_tok": (clock.read[-1] - clock.read[0]) / (NEW_TOKENS - 1),
              "stall_s_per_tok": (clock.stalls[-1] - clock.stalls[0]) / (NEW_TOKENS - 1) if clock.stalls else None,
              "cpu_s_per_tok": (sum(clock.times[-1][:2]) - sum(clock.times[0][:2])) / (NEW_TOKENS - 1),
              "sys_s_per_tok": (clock.times[-1].system - clock.times[0].system) / (NEW_TOKENS - 1)}
    if args.mode in ("inplace", "copy"):
        import offload

        store = offload.params.manager_of(model).store
        result.update({f"checkpoint_{k}": v for k, v in store.checkpoint_stats().items() if k != "files"})
        if args.trace:
            offload.write_trace(model)
        offload.close(model)
    return result


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM; getrusage's ru_maxrss would carry the parent's over exec)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def imports_seconds(name: str) -> float:
    """Wall time of a process that imports what the modes import, and exits: torch,
    transformers, offload and the model's class (transformers defers that import to first
    use, and it is most of the time: a second or more)."""
    cls = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[MODELS[name]["family"]]
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", f"import torch, transformers, offload; transformers.{cls}; "
                    "from transformers.generation.streamers import BaseStreamer"], check=True)
    return time.monotonic() - started


def run_mode(args, name: str, path: str, mode: str) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--name", name, "--model-path", path,
           "--path", args.path, "--device-budget", args.device_budget, "--host-budget", args.host_budget,
           "--evict", str(args.evict), "--settle", str(args.settle)] + (["--trace", args.trace] if args.trace else [])
    balloon = Balloon(args.reserve) if mode != "memory" else None
    try:
        if balloon is not None:
            balloon.__enter__()
        drop_caches()
        started = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        if balloon is not None:
            balloon.__exit__(None, None, None)
        for scratch in (f"swap-{mode}", "accelerate-offload"):
            shutil.rmtree(os.path.join(args.path, scratch), ignore_errors=True)
    if out.returncode != 0:
        log.warning("%s %s failed (exit %d):\n%s", name, mode, out.returncode, out.stderr[-3000:])
        return None
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got.update(ttft_s=got["first_token_at"] - started, **{"16tok_s": got["last_token_at"] - started},
               imports_s=got["imported_at"] - started, load_s=got["loaded_at"] - got["imported_at"],
               first_forward_s=got["first_token_at"] - got["loaded_at"])
    log.info("%s %s: first token %.1f s (imports %.1f, load %.1f, prompt to first token %.1f), 16 tokens %.1f s, "
             "%.2f tokens/s after the first (per token: %.2f GB read, stalled %s s, CPU %.2f s of which system %.2f), "
             "%.2f GB written before the first token, peak RSS %.2f GiB", name, mode, got["ttft_s"], got["imports_s"],
             got["load_s"], got["first_forward_s"], got["16tok_s"], got["tok_s"], got["read_bytes_per_tok"] / 1e9,
             "-" if got["stall_s_per_tok"] is None else f"{got['stall_s_per_tok']:.2f}", got["cpu_s_per_tok"],
             got["sys_s_per_tok"],
             (got["setup_written_bytes"] or 0) / 1e9, got["peak_rss_bytes"] / 2**30)
    return got


def summarize(name: str, rounds: list[dict], checkpoint_bytes: int) -> dict:
    def med(key, mode):
        values = [r[mode][key] for r in rounds if r.get(mode) is not None and r[mode].get(key) is not None]
        return statistics.median(values) if values else None

    rep: dict = {"checkpoint_bytes": checkpoint_bytes, "rounds": len(rounds)}
    for mode in MODES:
        for key in ("ttft_s", "16tok_s", "setup_written_bytes", "tok_s", "peak_rss_bytes", "imports_s", "load_s",
                    "first_forward_s", "read_bytes_per_tok", "stall_s_per_tok", "cpu_s_per_tok", "sys_s_per_tok"):
            rep[f"{mode}_{key}"] = med(key, mode)
    parts = {"bound_imports_s": statistics.median(r["imports_s"] for r in rounds),
             "read_gbps": statistics.median(r["read_gbps"] for r in rounds)}
    parts["bound_read_s"] = checkpoint_bytes / parts["read_gbps"] / 1e9
    parts["bound_compute_s"] = med("prefill_s", "memory")
    rep.update(parts)
    rep["bound_s"] = None if parts["bound_compute_s"] is None else \
        parts["bound_imports_s"] + parts["bound_read_s"] + parts["bound_compute_s"]
    ours = rep["inplace_ttft_s"]
    rep["inplace_vs_bound"] = ours / rep["bound_s"] if ours and rep["bound_s"] else None
    for other in ("copy", "accelerate", "memory"):
        theirs = rep[f"{other}_ttft_s"]
        rep[f"{other}_ttft_vs_inplace"] = theirs / ours if ours and theirs else None
    last = rounds[-1]
    want = last.get("memory") and last["memory"]["tokens"]
    rep["tokens_equal_memory"] = {m: last[m]["tokens"] == want for m in MODES if last.get(m) and want}
    return rep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--models", default="gpt2-1.5B,llama-3B", help=f"comma list of {', '.join(MODELS)} "
                        "(default gpt2-1.5B,llama-3B)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians reported (default 1)")
    parser.add_argument("--reserve", default="3GiB", help="RAM the balloon leaves free for a disk mode's process "
                        "and the page cache (default 3GiB: less than either model)")
    parser.add_argument("--device-budget", default="1GiB", help="offload's device_budget (the CPU's compute "
                        "memory: groups in use, prefetch, cache) and Accelerate's max_memory for the CPU "
                        "(default 1GiB)")
    parser.add_argument("--host-budget", default="512MiB", help="offload's host_budget (default 512MiB: the copy "
                        "mode stages each group through it, GPT-2's 321 MB embedding the largest)")
    parser.add_argument("--path", default=None, help="directory on the disk for the models (kept), swap files and "
                        "Accelerate's folder (removed); needs ~35 GB: the models, a mode's swap files and a 12 GiB "
                        f"scratch file (default: {SCRATCH_HELP.format(name='ttft')})")
    parser.add_argument("--evict", default="12GiB", help="after loading, before the prompt, each worker writes and "
                        "reads back this much other data (O_DIRECT, a scratch file under --path; the pause is left "
                        "out of its times), so that no mode reads weights from the virtual disk's host cache, which "
                        "holds what the copy mode has just written; 0 turns it off (default 12GiB)")
    parser.add_argument("--settle", type=float, default=0.0, help="after the eviction pause, each worker waits "
                        "this many seconds more before the prompt (left out of its times like the pause): the copy "
                        "mode's swap files, written at load, are then that much older when its tokens read them, "
                        "as a checkpoint read in place is older (default 0)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--trace", default=None, help="a directory: each offload worker writes its Chrome trace "
                        "there (OffloadConfig(trace_path=...): reads, compute and stalls on one timeline), named "
                        "<model>-<mode>-<pid>.json; off by default (it adds a little work per group)")
    parser.add_argument("--worker", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    parser.add_argument("--name", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode is not None:  # (a worker imports offload only in offload's modes: its imports are timed)
        args.evict = int(args.evict)
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(worker(args)))
        return
    start(args, "ttft")
    if args.trace:
        args.trace = os.path.abspath(args.trace)
        os.makedirs(args.trace, exist_ok=True)
    from offload._units import parse_size

    args.evict = parse_size(args.evict, name="--evict", allow_zero=True)
    args.reserve = parse_size(args.reserve, name="--reserve")
    names, modes = args.models.split(","), args.modes.split(",")
    for given, known, what in ((names, MODELS, "--models"), (modes, MODES, "--modes")):
        if any(n not in known for n in given):
            raise SystemExit(f"{what} {','.join(given)}: use a comma list of {', '.join(known)}")
    report = {"command": " ".join(sys.argv), "reserve_bytes": args.reserve, "models": {}}
    for name in names:
        path = prepare(args.path, name)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        rounds = []
        for r in range(args.rounds):
            row = {"imports_s": imports_seconds(name), "read_gbps": disk_bandwidth(args.path, size)["read_gbps"]}
            log.info("%s round %d: imports %.1f s, disk %.2f GB/s sustained O_DIRECT read", name, r + 1,
                     row["imports_s"], row["read_gbps"])
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            for mode in order:
                row[mode] = run_mode(args, name, path, mode)
            rounds.append(row)
        report["models"][name] = rep = summarize(name, rounds, size)
        print(f"\n{name}: checkpoint {size / 1e9:.2f} GB; lower bound {rep['bound_s'] or float('nan'):.1f} s = "
              f"imports {rep['bound_imports_s']:.1f} + read {rep['bound_read_s']:.1f} (at {rep['read_gbps']:.2f} GB/s)"
              f" + prompt {rep['bound_compute_s'] or float('nan'):.1f}")
        print(f"{'mode':<11} {'first token s':>13} {'16 tokens s':>12} {'tok/s after':>12} {'written GB':>11} "
              f"{'peak RSS GiB':>13}")
        for mode in modes:
            if rep[f"{mode}_ttft_s"] is None:
                print(f"{mode:<11} {'did not run':>13}")
                continue
            print(f"{mode:<11} {rep[f'{mode}_ttft_s']:>13.1f} {rep[f'{mode}_16tok_s']:>12.1f} "
                  f"{rep[f'{mode}_tok_s']:>12.2f} {(rep[f'{mode}_setup_written_bytes'] or 0) / 1e9:>11.2f} "
                  f"{rep[f'{mode}_peak_rss_bytes'] / 2**30:>13.2f}")
        print(f"inplace: {rep['inplace_vs_bound'] or float('nan'):.2f}x the lower bound; tokens equal the memory "
              f"mode's: {rep['tokens_equal_memory']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()
