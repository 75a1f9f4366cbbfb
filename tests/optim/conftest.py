"""Fixtures of the optimizer tests: the optimizers compared (offload's and torch's with the
same settings), a small branchy model, parameter groups, and the comparisons with their
stated tolerances. Models, configs, batches and the training loop are tests/conftest.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload


class Branchy(nn.Module):
    """An MLP whose ``side`` layer is used on even steps only: a parameter with no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.side, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.norm = nn.LayerNorm(64)
        self.use_side = True

    def forward(self, x):
        h = torch.relu(self.inp(x))
        if self.use_side:
            h = h + torch.tanh(self.side(h))
        return self.out(self.norm(h))


@pytest.fixture
def branchy():
    """``branchy()``: a seeded :class:`Branchy` (its ``side`` layer switched by ``use_side``)."""
    return Branchy


@pytest.fixture
def decay_groups():
    """``decay_groups(model, wd=0.1)``: weight decay on matrices, none on biases and norms."""
    def groups(model, wd=0.1):
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in model.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]
    return groups


@pytest.fixture
def make_opt():
    """``make_opt(kind, params, offloaded, **kw)``: "adamw", "adam" or "sgd", offload's or
    torch's (fused: the CPU kernel offload's optimizers call) with the same settings."""
    return _make_opt


def _make_opt(kind, params, offloaded, **kw):
    if not offloaded and kind != "sgd":
        kw["fused"] = True  # torch's fused CPU kernel, the one offload's optimizers call
    if kind == "adamw":
        cls = offload.AdamW if offloaded else torch.optim.AdamW
        return cls(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, **kw)
    if kind == "adam":
        cls = offload.Adam if offloaded else torch.optim.Adam
        return cls(params, lr=1e-2, weight_decay=0.01, **kw)
    cls = offload.SGD if offloaded else torch.optim.SGD
    return cls(params, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01, **kw)


@pytest.fixture
def adamw_pair(tiny_gpt2, offload_config):
    """``adamw_pair(path, tier="host", **settings)`` -> (model, opt, ref, ref_opt): the tiny
    GPT-2 wrapped with both tiers on ``tier`` and offload's AdamW, and the same model
    without offload with torch's; with tier "nvme" the gradient sums rest on NVMe too
    (grad_tier="nvme"; "auto" would keep them in host memory)."""
    def pair(path, tier="host", **settings):
        ref = tiny_gpt2()
        ref_opt = _make_opt("adamw", ref.parameters(), offloaded=False)
        model = offload.wrap(tiny_gpt2(), offload_config(path, param_tier=tier, optimizer_tier=tier, **settings))
        opt = _make_opt("adamw", model.parameters(), offloaded=True, grad_tier="nvme" if tier == "nvme" else "auto")
        return model, opt, ref, ref_opt
    return pair


@pytest.fixture
def assert_losses():
    """``assert_losses(got, want, rtol=1e-5, atol=1e-6)``: per-step losses (Python floats, so
    float64 tolerances by default) of fp32 models."""
    def check(got, want, rtol=1e-5, atol=1e-6):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return check


@pytest.fixture
def assert_same_weights():
    """``assert_same_weights(model, ref, **tol)``: every parameter equal, to fp32 tolerance
    by default.

    The trajectories are bit-identical to torch's fused kernel, clipping included, unless a
    parameter is split across shards: its norm is then summed from the pieces, and Adam
    turns a last-bit difference of the clip factor into single elements off by up to ~1e-4
    after 5 steps at lr 1e-2 on near-zero gradients. Tests that pin bits pass 0 tolerances."""
    def check(model, ref, **tol):
        tol = tol or dict(rtol=1e-4, atol=1e-4)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m, name=name: f"{name}: {m}", **tol)
    return check


@pytest.fixture
def assert_bf16_master_close():
    """``assert_bf16_master_close(got, want, lr=1e-2)``: the bf16 path's stated tolerance.
    Forward and backward in bf16 differ from the reference's in the last bits, and Adam can
    turn that into a different update for a near-zero gradient; so every element within one
    learning-rate step, and 99.9% within a fifth of one."""
    def check(got, want, lr=1e-2):
        torch.testing.assert_close(got, want, rtol=0, atol=lr)
        close = (got - want).abs().le(lr / 5).float().mean().item()
        assert close >= 0.999, close
    return check
