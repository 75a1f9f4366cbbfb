"""Fixtures of the checkpoint tests: a run saved half way and resumed in another layout, and
a saved checkpoint to damage. Models, configs, batches and training are tests/conftest.py's."""

from __future__ import annotations

import pytest
import torch

import offload


@pytest.fixture
def train_pair(lm_batches, train):
    """``train_pair(path, save_cfg, load_cfg, model_fn, **opt_kw)``. Reference: 3 steps, save
    under ``path``, 3 steps. Resumed: a fresh model with ``load_cfg`` loads and trains the
    last 3. Returns (reference losses, resumed losses, (ref, opt), (resumed, opt2))."""
    def run(tmp_path, save_cfg, load_cfg, model_fn, **opt_kw):
        batches = lm_batches(model_fn().config.vocab_size, steps=6)
        ref = offload.wrap(model_fn(), save_cfg)
        opt = offload.AdamW(ref.parameters(), lr=1e-2, **opt_kw)
        train(ref, opt, batches[:3])
        offload.save_checkpoint(str(tmp_path / "ckpt"), ref, opt, extra={"step": 3})
        want = train(ref, opt, batches[3:])
        torch.manual_seed(123)
        other = offload.wrap(model_fn(), load_cfg)
        opt2 = offload.AdamW(other.parameters(), lr=5.0, **opt_kw)  # lr comes from the checkpoint
        assert offload.load_checkpoint(str(tmp_path / "ckpt"), other, opt2) == {"step": 3}
        assert opt2.param_groups[0]["lr"] == 1e-2
        got = train(other, opt2, batches[3:])
        return want, got, (ref, opt), (other, opt2)
    return run


@pytest.fixture
def saved(tmp_path, tiny_gpt2, offload_config, lm_batches, train):
    """(path, model, opt): the tiny GPT-2 wrapped on NVMe, trained one step and saved at
    ``tmp_path/ckpt``; unwrapped and closed after the test."""
    m = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "w", param_tier="nvme", optimizer_tier="nvme"))
    opt = offload.AdamW(m.parameters(), lr=1e-2)
    train(m, opt, lm_batches(211, steps=1))
    path = tmp_path / "ckpt"
    offload.save_checkpoint(str(path), m, opt)
    yield path, m, opt
    opt.close()  # (first: a load the test made fail leaves weights that unwrap refuses while the optimizer is open)
    offload.unwrap(m)
