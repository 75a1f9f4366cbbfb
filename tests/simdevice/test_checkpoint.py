"""Checkpoints on the simulated device: groups resting in device memory (all of them, or
the small ones beside groups on NVMe) are saved through device-to-host copies and loaded
back through host-to-device ones; the resumed run equals the reference without offload."""

from __future__ import annotations

import pytest
import torch

import offload

from .sim import simulated
from .training import config, make_opt, reference, train


@pytest.mark.parametrize("placement", [dict(param_tier="device", device_budget="4MiB"),
                                       dict(param_tier="nvme", resident_bytes="64KiB", device_budget="512KiB")])
def test_save_and_resume_device_resident_groups(tmp_path, placement, tiny_gpt2, lm_batches):
    batches = lm_batches(211, steps=3)
    _, after_two = reference(tiny_gpt2, batches[:2], "gpt2-2")
    ref_losses, after_three = reference(tiny_gpt2, batches, "gpt2-3")
    with simulated(seed=3, max_delay=0.002):
        model = offload.wrap(tiny_gpt2(), config(tmp_path / "a", **placement))
        opt = make_opt(model.parameters(), True)
        train(model, opt, batches[:2], during_backward=False)
        offload.save_checkpoint(tmp_path / "ckpt", model, opt)
        opt.close()
        offload.close(model)

        saved = offload.load_state_dict_from(tmp_path / "ckpt")
        for name, want in after_two.items():
            torch.testing.assert_close(saved[name], want, rtol=1e-5, atol=1e-6, msg=name)

        model = offload.wrap(tiny_gpt2(), config(tmp_path / "b", **placement))
        opt = make_opt(model.parameters(), True)
        offload.load_checkpoint(tmp_path / "ckpt", model, opt)
        losses = train(model, opt, batches[2:], during_backward=False)
        opt.synchronize()
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.close()
        offload.close(model)
    torch.testing.assert_close(losses, ref_losses[2:], rtol=1e-5, atol=1e-6)
    for name, want in after_three.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=name)
