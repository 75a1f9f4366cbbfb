"""Runs in a subprocess for the checkpoint tests: a fresh interpreter, and one that can be killed.

    python child.py train  OUT.json CKPT PARAM_TIER OPT_TIER WORKDIR   # 3 steps, save, 3 more
    python child.py resume OUT.json CKPT PARAM_TIER OPT_TIER WORKDIR   # load, 3 steps
    python child.py rss    OUT.json CKPT WORKDIR                        # peak RSS while saving

With ``CHILD_KILL_AT=<point>`` in the environment the process SIGKILLs itself at that point
of its checkpoint save (``kill_at``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import psutil
import torch
import transformers

import offload

STEPS = 3


def model(dropout=0.1, layers=2, embd=64, vocab=211):
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=embd, n_head=4, vocab_size=vocab, n_positions=64,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def config(workdir, param_tier, optimizer_tier, **kw):
    os.makedirs(workdir, exist_ok=True)
    args = dict(device="cpu", param_tier=param_tier, optimizer_tier=optimizer_tier,
                nvme_path=os.path.join(workdir, "nvme"), device_budget="2MiB", host_budget="64MiB",
                resident_bytes="4KiB", file_size="16MiB")
    args.update(kw)
    return offload.OffloadConfig(**args)


def batches(n, start):
    g = torch.Generator().manual_seed(100 + start)
    return [torch.randint(0, 211, (2, 12), generator=g) for _ in range(n)]


def train(m, opt, ids_list):
    losses = []
    for ids in ids_list:
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def finish(out, m, opt, losses):
    sd = offload.state_dict(m)
    weights = {k: v.flatten().tolist() for k, v in sd.items()}
    state = opt.state_dict()["state"]
    moments = {str(k): v["exp_avg_sq"].flatten().tolist() for k, v in state.items() if "exp_avg_sq" in v}
    with open(out, "w") as fh:
        json.dump({"losses": losses, "weights": weights, "moments": moments}, fh)


def kill_at(point: str) -> None:
    """SIGKILL this process at ``point`` of its checkpoint save: ``blob:N`` (after the write
    of blob N was issued), ``before_manifest``, ``after_manifest``, ``before_swap``,
    ``after_swap``, ``between_renames`` (the two-rename swap). The library has no test
    hooks: the save's own steps are wrapped here."""
    from offload.checkpoint import _format, _save, _stream

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    if point.startswith("blob:"):
        issue, seen = _stream.BlobWriter._issue_ready, [0]

        def counted(self, held):  # called once per blob, after its write is issued
            issue(self, held)
            seen[0] += 1
            if seen[0] == int(point[5:]) + 1:
                die()
        _stream.BlobWriter._issue_ready = counted
    elif point in ("before_manifest", "after_manifest"):
        write = _save.write_json

        def manifest(path, obj):
            if path.endswith(_format.MANIFEST) and point == "before_manifest":
                die()
            write(path, obj)
            if path.endswith(_format.MANIFEST):
                die()
        _save.write_json = manifest
    elif point == "before_swap":
        commit = _format.AtomicDirectory.commit
        _format.AtomicDirectory.commit = lambda self: (die(), commit(self))
    elif point == "after_swap":  # swapped in; the old checkpoint not removed yet
        _format._remove_later = die
    elif point == "between_renames":
        rename = os.rename

        def renamed(src, dst):
            rename(src, dst)
            if ".prev-" in os.fspath(dst):
                die()
        os.rename = renamed
    else:
        raise ValueError(f"unknown kill point {point!r}")


def main():
    if os.environ.get("CHILD_KILL_AT"):
        kill_at(os.environ["CHILD_KILL_AT"])
    mode, out = sys.argv[1], sys.argv[2]
    if mode in ("train", "resume"):
        ckpt, pt, ot, workdir = sys.argv[3:7]
        m = offload.wrap(model(), config(workdir, pt, ot))
        opt = offload.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        if mode == "train":
            torch.manual_seed(7)
            train(m, opt, batches(STEPS, 0))
            offload.save_checkpoint(ckpt, m, opt, extra={"step": STEPS, "rng": offload.rng_state()})
            losses = train(m, opt, batches(STEPS, STEPS))
        else:
            torch.manual_seed(12345)  # a different RNG: the checkpoint's must win
            extra = offload.load_checkpoint(ckpt, m, opt)
            assert extra["step"] == STEPS
            offload.set_rng_state(extra["rng"])
            losses = train(m, opt, batches(STEPS, STEPS))
        finish(out, m, opt, losses)
    elif mode == "rss":
        ckpt, workdir = sys.argv[3:5]
        m = model(dropout=0.0, layers=8, embd=512, vocab=8000)
        nbytes = sum(p.numel() * 4 for p in m.parameters())
        cfg = config(workdir, "nvme", "nvme", device_budget="96MiB", host_budget="64MiB", file_size="256MiB")
        m = offload.wrap(m, cfg)
        opt = offload.AdamW(m.parameters(), lr=1e-3)
        ids = torch.randint(0, 8000, (1, 16))
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        proc = psutil.Process()
        before = proc.memory_info().rss
        peak = [before]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            offload.save_checkpoint(ckpt, m, opt)
        finally:
            stop.set()
        sampler.join()
        size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        with open(out, "w") as fh:
            json.dump({"before": before, "peak": peak[0], "param_bytes": nbytes, "checkpoint_bytes": size,
                       "host_budget": cfg.host_budget}, fh)


if __name__ == "__main__":
    main()
