"""HF Trainer with its defaults over an offloaded model and offload.AdamW, against the same
Trainer over the plain model and torch's AdamW: clipping at max_grad_norm=1.0, save_steps
and resume_from_checkpoint, bf16 autocast."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def assert_same_run(got, want, **tol):
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], msg=lambda m: f"{name}: {m}", **tol)


def test_defaults_clip_and_save_steps_resume(tmp_path, trainer_run, no_leaks):
    """Trainer's defaults clip (the norms are over 1.0, so the clip acts) exactly as without
    offload; the checkpoint save_steps wrote resumes bit-exact against the uninterrupted run."""
    plain = trainer_run(tmp_path, False, save_steps=2)
    whole = trainer_run(tmp_path, True, save_steps=2)
    assert min(plain[1]) > 1.0  # clipped at every step
    assert_same_run(whole, plain, rtol=1e-5, atol=1e-6)
    resumed = trainer_run(tmp_path, True, save_steps=2, resume=str(tmp_path / "offload" / "checkpoint-2"))
    # (its log holds the two steps before the checkpoint as saved, then the two it ran)
    assert resumed[0] == whole[0] and resumed[1] == whole[1]  # bit for bit
    assert_same_run(resumed, whole, rtol=0, atol=0)


def test_trainers_own_optimizer_with_decay_groups(tmp_path, trainer_run, no_leaks):
    """offload.AdamW built by Trainer (``optimizer_cls_and_kwargs``: its decay and no-decay
    groups, its schedule) against Trainer's default optimizer over the plain model, weight
    decay on: losses, gradient norms and weights to the bit."""
    args = dict(steps=3, trainers_optimizer=True, weight_decay=0.1, learning_rate=1e-3)
    plain, offloaded = trainer_run(tmp_path, False, **args), trainer_run(tmp_path, True, **args)
    assert min(plain[1]) > 1.0  # clipped at every step
    assert_same_run(offloaded, plain, rtol=0, atol=0)


def test_bf16_autocast(tmp_path, trainer_run, no_leaks):
    """Trainer's bf16=True (autocast) over an offloaded fp32 model: as over the plain model."""
    # bf16 products summed in another order move a few weights by bf16 rounding (5e-6 seen);
    # a wrong gradient would move them by about the learning rate (1e-3)
    assert_same_run(trainer_run(tmp_path, True, steps=3, bf16=True), trainer_run(tmp_path, False, steps=3, bf16=True),
                    rtol=1e-3, atol=1e-4)
