"""Shared pieces of the interop tests: a tiny GPT-2 without dropout (a resumed run must
see the same randomness as an uninterrupted one) and a config on the real disk."""

from __future__ import annotations

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")


def tiny_gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def offload_config(path, **kw):
    path.mkdir(parents=True, exist_ok=True)
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=str(path / "nvme"),
                device_budget="2MiB", host_budget="64MiB", resident_bytes="4KiB", file_size="16MiB")
    args.update(kw)
    return offload.OffloadConfig(**args)


def token_batches(count: int, batch: int = 2, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (batch, seq), generator=g) for _ in range(count)]


def weights(model) -> dict[str, torch.Tensor]:
    """The model's weights as plain tensors, wrapped or not."""
    return offload.state_dict(model)
