"""Activation offload on a real CUDA device (marked ``cuda``, skipped without one): the copy
stream, events and pinned buffers of ``DeviceWriter`` against the same training with the
activations kept in device memory, and the device memory it saves. The simulated device
runs the same path in CI (tests/simdevice/test_activations.py)."""

from __future__ import annotations

import pytest
import torch

import offload

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# every saved tensor moves, in pieces through a small window
ALL_OUT = dict(activation_budget=0, activation_min_bytes=0, activation_prefetch="64KiB",
               activation_host_budget="8MiB")


def _train(model, cfg, batches):
    """Three steps of two micro-batches on the GPU: the losses, the stats and the weights."""
    offload.wrap(model, cfg)
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for micro in batches:
        for ids in micro:
            ids = ids.cuda()
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    torch.cuda.synchronize()
    stats = offload.stats(model)
    offloader = offload.params.manager_of(model).activations
    on_device_path = offloader is not None and offloader.writer is not None
    weights = {n: p.detach().cpu().clone() for n, p in offload.unwrap(model).named_parameters()}
    return losses, stats, weights, on_device_path


@pytest.mark.parametrize("ckpt", [False, True], ids=["saved", "checkpointed"])
@pytest.mark.parametrize("tier", ["nvme", "host"])
def test_gpu_training_equals_the_run_that_keeps_activations(tmp_path, tier, ckpt, tiny_gpt2, offload_config,
                                                            lm_batches):
    def build():
        model = tiny_gpt2()
        if ckpt:
            model.gradient_checkpointing_enable()
        return model

    batches = lm_batches(211, steps=3)
    ref = _train(build(), offload_config(tmp_path / "a", device="cuda"), batches)
    got = _train(build(), offload_config(tmp_path / "b", device="cuda", activation_tier=tier, **ALL_OUT), batches)
    assert got[3]  # (the device path: copy stream, pinned buffers)
    assert got[0][0] == ref[0][0]  # the first forward: the same kernels on the same bytes
    # the backward kernels (atomics in embedding's) may add in another order
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for name, want in ref[2].items():
        torch.testing.assert_close(got[2][name], want, rtol=1e-4, atol=1e-5, msg=name)
    stats = got[1]
    assert stats["act_written_bytes"] > 0 and stats["act_read_bytes"] == stats["act_written_bytes"]
    assert stats["act_records"] == 0 and stats["act_held_bytes"] == 0


def test_gpu_memory_of_offloaded_activations(tmp_path, offload_config):
    """A deep MLP whose saved inputs (16 MiB each) dwarf its weights: with the activations
    on the host tier beyond a 32 MiB budget, the device's peak during forward and backward
    falls by most of what the run keeping them needs, and the gradients are the same."""
    layers, width, batch = 12, 1024, 4096

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*(m for _ in range(layers) for m in (torch.nn.Linear(width, width),
                                                                       torch.nn.GELU())))

    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1)).cuda()
    peaks, grads = {}, {}
    for name, act in (("kept", {}), ("host", dict(activation_tier="host", activation_budget="32MiB"))):
        model = offload.wrap(build(), offload_config(tmp_path / name, device="cuda", device_budget="256MiB",
                                                     host_budget="1GiB", **act))
        try:
            model(x).square().mean().backward()  # (a first pass: groups placed, pools grown)
            model.zero_grad()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            model(x).square().mean().backward()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
            grads[name] = [p.grad.detach().cpu().clone() for p in model.parameters()]
            if act:
                stats = offload.stats(model)
                one_layer = 2 * batch * width * 4  # (a Linear's input and a GELU's)
                assert stats["act_peak_bytes"] <= (32 << 20) + (64 << 20) + one_layer  # budget, prefetch, layer
                assert stats["act_written_bytes"] > 0
        finally:
            offload.unwrap(model)
    saved = 2 * layers * batch * width * 4  # each Linear's input and each GELU's input
    assert peaks["host"] < peaks["kept"] - saved // 2, (peaks, saved)
    for a, b in zip(grads["host"], grads["kept"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
