"""Models, configs, batches and comparisons shared by the optimizer tests (and the
checkpoint tests): the same model trained with offload and with torch's optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload

transformers = pytest.importorskip("transformers")

STEPS = 5


def config(tmp_path, param_tier="nvme", optimizer_tier="nvme", **kw):
    nvme = "nvme" in (param_tier, optimizer_tier)
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = dict(device="cpu", param_tier=param_tier, optimizer_tier=optimizer_tier,
                nvme_path=str(tmp_path / "nvme") if nvme else None, device_budget="2MiB",
                host_budget="64MiB", resident_bytes="4KiB", file_size="16MiB")
    args.update(kw)
    return offload.OffloadConfig(**args)


def tiny_gpt2(dropout: float = 0.0):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=64,
                                  tie_word_embeddings=True, resid_pdrop=dropout, embd_pdrop=dropout,
                                  attn_pdrop=dropout)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def tiny_llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=197,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


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


def decay_groups(model, wd=0.1):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def make_opt(kind, params, offloaded, **kw):
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


def lm_batches(vocab, steps=STEPS, micro=2):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, vocab, (2, 12), generator=g) for _ in range(micro)] for _ in range(steps)]


def train(model, opt, batches, *, clip=None, sched=None, set_branch=None, scale=None):
    losses = []
    for step, micro in enumerate(batches):
        if set_branch is not None:
            set_branch(model, step)
        total = 0.0
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            (scale(loss) if scale else loss).backward()
            total += float(loss.detach())
        if clip is not None:
            if isinstance(opt, offload.optim.OffloadOptimizer):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total)
    return losses


def assert_losses(got, want, rtol=1e-5, atol=1e-6):
    # losses are Python floats (float64 tolerances by default); they come from fp32 models
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def assert_same_weights(model, ref, **tol):
    # fp32 tolerance: without clipping the trajectories are bit-identical to torch's fused
    # kernel; with clipping the factor is applied as a division inside the kernel (and the
    # norm summed in another order), and Adam turns those last-bit differences on near-zero
    # gradients into single elements off by up to ~6e-5 after 5 steps at lr 1e-2
    tol = tol or dict(rtol=1e-4, atol=1e-4)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name, **tol)


def wide_gpt2():
    """GPT-2 with a 4099 x 128 embedding: shards with rows of 1 MiB and more, so padded."""
    cfg = transformers.GPT2Config(n_layer=1, n_embd=128, n_head=4, vocab_size=4099, n_positions=32,
                                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def assert_rows_padded(opt):
    """Some shard has rows of 1 MiB or more, each padded to 4 KiB past a multiple of 2 MiB
    (128 KiB under 16 MiB), and holds fewer elements than its rows."""
    padded = [s for s in opt._book.shards if s.numel * 4 >= 1 << 20]
    assert padded
    for shard in padded:
        period = 2 << 20 if shard.numel * 4 >= 16 << 20 else 128 << 10
        assert shard.numel * 4 % period == 4096
        assert sum(seg.length for seg in shard.segments) < shard.numel


def assert_bf16_master_close(got, want, lr=1e-2):
    """The bf16 path's stated tolerance: forward and backward in bf16 differ from the
    reference's in the last bits, and Adam can turn that into a different update for a
    near-zero gradient; so every element within one learning-rate step, and 99.9% within
    a fifth of one."""
    torch.testing.assert_close(got, want, rtol=0, atol=lr)
    close = (got - want).abs().le(lr / 5).float().mean().item()
    assert close >= 0.999, close
