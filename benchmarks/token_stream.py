"""Generated tokens while every weight streams through a small device budget, per token.

Where time_to_first_token.py measures a cold start from a disk, this measures the steady
state after the first token, and the CPU it costs: tokens per second, the process's CPU
seconds per token (user and system: the kernel's page zeroing and faults show in the
latter), and the buffers the device pool mapped anew or resized per token. Put ``--path``
on a memory file system (``/dev/shm``) to take the disk out: the checkpoint is then read
in place through the page cache at memory speed, and what is left is offload's own cost,
next to the same model in RAM (``memory``).

    python benchmarks/token_stream.py --model gpt2-1.5B --path /dev/shm/token-stream --json stream.json

Each mode a fresh process, interleaved per round; medians over the timed tokens of a
round, then over rounds. Modes: ``inplace`` (``offload.wrap(..., checkpoint=dir)``, weights
read from the checkpoint's files), ``copy`` (the same with ``read_in_place=False``: the
weights copied into offload's swap files at ``wrap``, then read from there) and ``memory``
(``from_pretrained`` in RAM). JSON per mode: ``<mode>_tok_s``, ``<mode>_cpu_s_per_tok``,
``<mode>_sys_s_per_tok``, ``<mode>_mapped_per_tok``, ``<mode>_resized_per_tok`` (offload
only), per round and median; ``inplace_vs_memory`` and ``inplace_vs_copy`` (tokens/s ratios).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, run_json_worker, start  # noqa: E402
from time_to_first_token import MODELS, _model_class, prepare  # noqa: E402

log = logging.getLogger("bench.stream")
MODES = ("inplace", "copy", "memory")
PROMPT = 16


def worker(args) -> dict:
    """Load as the mode says, run the prompt, then time ``--tokens`` single-token forwards."""
    import torch
    import transformers

    spec = MODELS[args.model]
    path, cls, dtype = args.model_path, _model_class(spec["family"]), getattr(torch, spec["dtype"])
    pool = None
    if args.mode in ("inplace", "copy"):
        import offload
        from offload.store import Tier

        config = transformers.AutoConfig.from_pretrained(path)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with offload.init_empty_weights():
                model = cls(config)
        finally:
            torch.set_default_dtype(default)
        cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme",
                                    nvme_path=os.path.join(args.scratch, "swap"), device_budget=args.device_budget,
                                    host_budget="512MiB", io_backend="direct",  # (buffered where no O_DIRECT)
                                    read_in_place=args.mode == "inplace")
        model = offload.wrap(model, cfg, checkpoint=path)
        pool = offload.params.manager_of(model).store.tiers[Tier.DEVICE].pool
    else:
        model = cls.from_pretrained(path, dtype=dtype)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    per_token = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(args.tokens):
            nxt = out.logits[:, -1:].argmax(-1)
            before, counts = os.times(), _counts(pool)
            started = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            wall = time.perf_counter() - started
            after = os.times()
            now = _counts(pool)
            per_token.append(dict(wall=wall, cpu=after.user + after.system - before.user - before.system,
                                  sys=after.system - before.system,
                                  **{k: now[k] - counts[k] if now[k] is not None else None for k in now}))
    if args.mode != "memory":
        offload.close(model)
    timed = per_token[1:]  # (the first after the prompt still maps the pool's first buffers)

    def med(key):
        values = [t[key] for t in timed if t[key] is not None]
        return statistics.median(values) if values else None

    return {"tok_s": 1 / med("wall"), "cpu_s_per_tok": med("cpu"), "sys_s_per_tok": med("sys"),
            "mapped_per_tok": med("mapped"), "resized_per_tok": med("resized")}


def _counts(pool) -> dict:
    """The device pool's buffers mapped and resized so far (None: no pool, or a version of
    offload that does not count them)."""
    return {k: getattr(pool, k, None) for k in ("mapped", "resized")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="gpt2-1.5B", choices=sorted(MODELS),
                        help="the model (time_to_first_token.py's, built once and saved under --path)")
    parser.add_argument("--path", default=None, help="where the model is saved and read from; default: "
                        + SCRATCH_HELP.format(name="token-stream") + "; /dev/shm takes the disk out")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of inplace, copy, memory "
                        "(default all three)")
    parser.add_argument("--tokens", type=int, default=6, help="single-token forwards per run; the first "
                        "is left out of the figures (default 6)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians reported (default 2)")
    parser.add_argument("--device-budget", default="1GiB", help="offload's device_budget (default 1GiB: less "
                        "than either model, so every pass reads most weights)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--worker", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(worker(args)))
        return
    start(args, "token-stream")
    path = prepare(args.path, args.model)
    modes = [m for m in args.modes.split(",") if m]
    rounds: list[dict] = []
    for r in range(args.rounds):
        got = {}
        for mode in modes if r % 2 == 0 else modes[::-1]:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--model", args.model,
                   "--model-path", path, "--scratch", args.path, "--tokens", str(args.tokens),
                   "--device-budget", args.device_budget]
            got[mode] = run_json_worker(cmd, mode)
            if got[mode] is not None:
                log.info("round %d %s: %.3f tokens/s, CPU %.2f s per token (system %.2f), buffers mapped %s "
                         "and resized %s per token", r, mode, got[mode]["tok_s"], got[mode]["cpu_s_per_tok"],
                         got[mode]["sys_s_per_tok"], got[mode]["mapped_per_tok"], got[mode]["resized_per_tok"])
        rounds.append(got)
    report = {"command": " ".join(sys.argv), "model": args.model, "path": path, "rounds": rounds}
    for mode in modes:
        for key in ("tok_s", "cpu_s_per_tok", "sys_s_per_tok", "mapped_per_tok", "resized_per_tok"):
            values = [r[mode][key] for r in rounds if r.get(mode) and r[mode][key] is not None]
            report[f"{mode}_{key}"] = statistics.median(values) if values else None
    for other in ("memory", "copy"):
        if report.get("inplace_tok_s") and report.get(f"{other}_tok_s"):
            report[f"inplace_vs_{other}"] = report["inplace_tok_s"] / report[f"{other}_tok_s"]
    log.info("medians: %s", {k: round(v, 3) for k, v in report.items() if isinstance(v, float)})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
