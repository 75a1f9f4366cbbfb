"""The fault-injection suite's harness: a small real model trained with offload against the
same model trained in memory, faults injected into the file engine's system calls, and a
check that a run which failed released everything it held.

Every case in this directory asserts four things: the exception's type and a message that
names the culprit (and, where there is one, the fix); no hang (each test is bounded by a
timeout); no thread, descriptor or file left behind once the user closes; and that what was
saved before the fault (a checkpoint) still loads and continues the reference trajectory.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

import offload
import offload.params._manager as manager_module

transformers = pytest.importorskip("transformers")

LR, WD = 1e-3, 0.01


def tiny_gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=64,
                                  tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def make_config(tmp_path, **kw) -> offload.OffloadConfig:
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=str(tmp_path / "nvme"),
                device_budget="160KiB", host_budget="64MiB", resident_bytes="4KiB", file_size="16MiB",
                cache_bytes=0, io="manual", io_backend="direct")  # each pass reads most of its parameters from NVMe
    args.update(kw)
    return offload.OffloadConfig(**args)


def batches(steps: int, *, vocab: int = 211, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 12), generator=g) for _ in range(steps)]


def step(model, opt, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def offload_run(tmp_path, **cfg):
    """A wrapped tiny GPT-2 (about 120k parameters) and its offloaded AdamW."""
    os.makedirs(tmp_path, exist_ok=True)
    model = offload.wrap(tiny_gpt2(), make_config(tmp_path, **cfg))
    # small shards: the step is a pipeline of several reads, updates and writes
    return model, offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, shard_size=16384)


def reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of the same run in memory with torch's AdamW."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = [step(model, opt, ids) for ids in batches(steps)]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_weights(model, expected: dict[str, torch.Tensor]) -> None:
    got = offload.state_dict(model) if model in manager_module._managers else model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)


def close_all(model, opt) -> None:
    """What a user does after an error: close the optimizer, release the model."""
    opt.close()
    offload.close(model)


def assert_released(nvme_dir) -> None:
    """No swap file and no lock left in the NVMe directory."""
    left = glob.glob(os.path.join(str(nvme_dir), "offload-*"))
    assert not left, f"files left behind: {left}"


def save_after(tmp_path, steps: int = 2, **cfg):
    """Train ``steps`` offloaded steps and save a checkpoint; returns (model, opt, path)."""
    model, opt = offload_run(tmp_path, **cfg)
    for ids in batches(steps):
        step(model, opt, ids)
    path = str(tmp_path / "ckpt")
    offload.save_checkpoint(path, model, opt)
    return model, opt, path


def resume_matches(tmp_path, path: str, done: int, total: int) -> None:
    """A fresh wrapped run (another NVMe directory) loaded from ``path`` after ``done`` steps
    reaches the reference losses and weights of ``total`` steps."""
    losses, weights = reference(total)
    model, opt = offload_run(tmp_path / "resume")
    try:
        offload.load_checkpoint(path, model, opt)
        got = [step(model, opt, ids) for ids in batches(total)[done:]]
        torch.testing.assert_close(got, losses[done:])
        assert_weights(model, weights)
    finally:
        close_all(model, opt)
    assert_released(tmp_path / "resume" / "nvme")


__all__ = ["tiny_gpt2", "make_config", "batches", "step", "offload_run", "reference", "assert_weights",
           "close_all", "assert_released", "resume_matches", "save_after"]
