"""HF Trainer with its defaults over an offloaded model and offload.AdamW, against the same
Trainer over the plain model and torch's AdamW: clipping at max_grad_norm=1.0, save_steps
and resume_from_checkpoint, bf16 autocast."""

from __future__ import annotations

import pytest
import torch

import offload

from .conftest import offload_config, tiny_gpt2, token_batches, weights

transformers = pytest.importorskip("transformers")


def dataset():
    return [{"input_ids": ids[0], "labels": ids[0].clone()} for ids in token_batches(16, batch=1)]


def run(tmp_path, offloaded: bool, *, steps=4, resume=None, **args):
    """Train with Trainer's defaults (clipping at 1.0 included); returns the logged losses and
    gradient norms, and the final weights."""
    model = tiny_gpt2()
    if offloaded:
        offload.wrap(model, offload_config(tmp_path / "run"))
        opt = offload.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    out = tmp_path / ("offload" if offloaded else "plain")
    training = transformers.TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=2,
                                              logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                                              **args)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset(), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = [h["loss"] for h in logs], [h["grad_norm"] for h in logs], weights(model)
    if offloaded:
        opt.close()
        offload.unwrap(model)
    return result


def assert_same_run(got, want, **tol):
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], msg=lambda m: f"{name}: {m}", **tol)


def test_defaults_clip_and_save_steps_resume(tmp_path, no_leaks):
    """Trainer's defaults clip (the norms are over 1.0, so the clip acts) exactly as without
    offload; the checkpoint save_steps wrote resumes bit-exact against the uninterrupted run."""
    plain = run(tmp_path, False, save_steps=2)
    whole = run(tmp_path, True, save_steps=2)
    assert min(plain[1]) > 1.0  # clipped at every step
    assert_same_run(whole, plain, rtol=1e-5, atol=1e-6)
    resumed = run(tmp_path, True, save_steps=2, resume=str(tmp_path / "offload" / "checkpoint-2"))
    # (its log holds the two steps before the checkpoint as saved, then the two it ran)
    assert resumed[0] == whole[0] and resumed[1] == whole[1]  # bit for bit
    assert_same_run(resumed, whole, rtol=0, atol=0)


def test_bf16_autocast(tmp_path, no_leaks):
    """Trainer's bf16=True (autocast) over an offloaded fp32 model: as over the plain model."""
    # bf16 products summed in another order move a few weights by bf16 rounding (5e-6 seen);
    # a wrong gradient would move them by about the learning rate (1e-3)
    assert_same_run(run(tmp_path, True, steps=3, bf16=True), run(tmp_path, False, steps=3, bf16=True),
                    rtol=1e-3, atol=1e-4)
