"""Checkpoint calls made within ``torch.inference_mode()`` (an evaluation loop that saves its
best model, a resume inside a serving process): training after them equals the run that
made the same calls outside it."""

from __future__ import annotations

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_save_and_load_within_inference_mode(tmp_path, moments, tiny_gpt2, offload_config, lm_batches, train):
    """Train 2 steps, save within inference mode; a fresh model loads it within inference
    mode (and reads its state dicts there) and trains 2 more: losses and weights equal
    the unbroken run's, and a save after that loads again."""
    batches = lm_batches(211, steps=4)
    cfg = dict(resident_bytes="1MiB")  # (resident parameters too: restored in place by the load)
    ref = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "a", **cfg))
    opt = offload.AdamW(ref.parameters(), lr=1e-2, moments=moments)
    train(ref, opt, batches[:2])
    with torch.inference_mode():
        offload.save_checkpoint(str(tmp_path / "ckpt"), ref, opt)
    want = train(ref, opt, batches[2:])

    other = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "b", **cfg))
    opt2 = offload.AdamW(other.parameters(), lr=1.0, moments=moments)
    with torch.inference_mode():
        offload.load_checkpoint(str(tmp_path / "ckpt"), other, opt2)
        opt2.load_state_dict(opt2.state_dict())
        other.load_state_dict(offload.state_dict(other))
    assert train(other, opt2, batches[2:]) == want
    a, b = offload.state_dict(ref), offload.state_dict(other)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    offload.save_checkpoint(str(tmp_path / "again"), other, opt2)
    offload.load_checkpoint(str(tmp_path / "again"), other, opt2)
    for m, o in ((ref, opt), (other, opt2)):
        offload.unwrap(m)
        o.close()
