"""Training on the simulated device against the same model trained without offload: the
helpers the simdevice tests share."""

from __future__ import annotations

import contextlib

import torch

import offload

from .sim import simulated

STEPS = 3


def make_opt(params, offloaded, **kw):
    cls = offload.AdamW if offloaded else torch.optim.AdamW
    if not offloaded:
        kw["fused"] = True  # torch's fused CPU kernel, the one offload calls
    return cls(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, **kw)


def train(model, opt, batches, *, during_backward):
    losses = []
    for micro in batches:
        total = 0.0
        for i, ids in enumerate(micro):  # (the last backward of a step inside the block)
            last = during_backward and i == len(micro) - 1
            with opt.update_during_backward() if last else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss / len(micro)
                loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


_REFERENCES: dict = {}


def reference(build, batches, key):
    """Losses and weights of ``build()`` trained on ``batches`` without offload (once per key)."""
    if key not in _REFERENCES:
        model = build()
        losses = train(model, make_opt(model.parameters(), False), batches, during_backward=False)
        _REFERENCES[key] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    return _REFERENCES[key]


def config(tmp_path, **settings):
    """Parameters and optimizer states on NVMe, a device budget of a few groups."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="nvme", device_budget="256KiB",
                host_budget="64MiB", resident_bytes="4KiB", file_size="16MiB", nvme_path=str(tmp_path / "swap"))
    args.update(settings)
    return offload.OffloadConfig(**args)


def run_and_compare(tmp_path, build, batches, reference, *, seed, optimizer_tier, during_backward,
                    max_delay=0.001, host_budget="64MiB", **opt_kw):
    """Train ``build()`` wrapped on a simulated device seeded ``seed``; losses and weights
    equal the reference's (fp32: the same kernels, so to the last bits)."""
    ref_losses, ref_weights = reference
    with simulated(seed=seed, max_delay=max_delay) as sim:
        model = offload.wrap(build(), config(tmp_path, optimizer_tier=optimizer_tier, host_budget=host_budget))
        opt = make_opt(model.parameters(), True, **opt_kw)
        try:
            losses = train(model, opt, batches, during_backward=during_backward)
            opt.synchronize()
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            opt.close()
            offload.close(model)
        assert sim.pageable_copies == 0
        assert sim.allocated == 0  # every device slot given back
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, want in ref_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=name)
