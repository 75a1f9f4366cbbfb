"""Accelerate's prepare over an offloaded model and offload.AdamW, against the same loop over
the plain model and torch's AdamW: clipping through accelerator.clip_grad_norm_, and
offload.save_checkpoint / load_checkpoint given the prepared (wrapped) optimizer."""

from __future__ import annotations

import pytest
import torch

import offload

accelerate = pytest.importorskip("accelerate")


def loop(accelerator, model, opt, batches, save=None):
    losses = []
    for i, ids in enumerate(batches):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if save is not None and i == 2:
            offload.save_checkpoint(save, model, opt)
    return losses


def test_prepared_training_checkpoint_and_resume(tmp_path, token_batches, accelerate_build, weights, no_leaks):
    batches = token_batches(6)
    acc, model, prepared, _ = accelerate_build(tmp_path / "ref", False)
    ref_losses, ref_weights = loop(acc, model, prepared, batches), weights(model)

    acc, model, prepared, opt = accelerate_build(tmp_path / "a", True)
    assert type(prepared).__name__ == "AcceleratedOptimizer"
    losses = loop(acc, model, prepared, batches, save=tmp_path / "ckpt")
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)  # clipped as without offload
    final = weights(model)
    for name, value in ref_weights.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=name)
    opt.close()
    offload.unwrap(model)

    acc, model, prepared, opt = accelerate_build(tmp_path / "b", True)
    offload.load_checkpoint(tmp_path / "ckpt", model, prepared)
    assert loop(acc, model, prepared, batches[3:]) == losses[3:]  # bit for bit
    for name, value in weights(model).items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0, msg=name)
    opt.close()
    offload.unwrap(model)


class Holder:
    """A wrapper of its own (like many training frameworks have) around an optimizer."""

    def __init__(self, opt):
        self.inner = opt
        self.param_groups = opt.param_groups

    def step(self):
        self.inner.step()


def test_checkpoint_finds_or_refuses_the_optimizer(tmp_path, tiny_gpt2, offload_config, token_batches, no_leaks):
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    opt = offload.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    ids = token_batches(6)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    offload.save_checkpoint(tmp_path / "found", model, Holder(opt))  # looked through
    assert offload.load_checkpoint(tmp_path / "found", model, opt) is None
    with pytest.raises(offload.CheckpointError, match="cannot be reached"):
        offload.save_checkpoint(tmp_path / "none", model, object())
    with pytest.raises(TypeError, match="wrapped by offload.wrap"):  # (refused when built, not at its step)
        torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():  # (built over frozen ones it is allowed: torch would skip them)
        p.requires_grad_(False)
    stray = torch.optim.SGD(model.parameters(), lr=0.1)  # its parameters' state is the AdamW's
    for p in model.parameters():
        p.requires_grad_(True)
    with pytest.raises(offload.CheckpointError, match="open AdamW"):
        offload.save_checkpoint(tmp_path / "stray", model, stray)
    opt.close()
    offload.unwrap(model)
