"""The fault-injection suite's fixtures: a small real model trained with offload against the
same model trained in memory, faults injected into the file engine's system calls, and a
check that a run which failed released everything it held.

Every case in this directory asserts four things: the exception's type and a message that
names the culprit (and, where there is one, the fix); no hang (each test is bounded by a
timeout); no thread, descriptor or file left behind once the user closes; and that what was
saved before the fault (a checkpoint) still loads and continues the reference trajectory.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

import offload
import offload.optim._shards as optimizer_module
import offload.params._manager as manager_module
from offload.store import create_store

LR, WD = 1e-3, 0.01  # the runs' AdamW, offloaded and in memory

# each pass reads most of its parameters from NVMe: a device budget of a few groups, no
# cache, the direct backend, the engine's built-in settings
_FAULTS = dict(device_budget="160KiB", cache_bytes=0, io="manual", io_backend="direct")


@pytest.fixture
def offload_config(offload_config):
    """The suite's ``offload_config(path, **settings)``: tests/conftest.py's with a 160 KiB
    device budget, no cache, ``io="manual"`` and ``io_backend="direct"``."""
    def make(path, **settings):
        return offload_config(path, _FAULTS, **settings)
    return make


@pytest.fixture
def inject(monkeypatch):
    """``inject(backend)``: every store that wrap or an optimizer creates from now on uses
    ``backend`` (a FaultyBackend) for its system calls."""
    def use(backend):
        def faulty_store(*args, **kw):
            kw["file_backend"] = backend
            return create_store(*args, **kw)
        monkeypatch.setattr(manager_module, "create_store", faulty_store)
        monkeypatch.setattr(optimizer_module, "create_store", faulty_store)
        return backend
    return use


@pytest.fixture
def batches():
    """``batches(steps, *, vocab=211, seed=1)``: ``steps`` batches of 2 x 12 token ids."""
    def make(steps: int, *, vocab: int = 211, seed: int = 1) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (2, 12), generator=g) for _ in range(steps)]
    return make


@pytest.fixture
def step():
    """``step(model, opt, ids)``: forward, backward, step, zero_grad; returns the loss."""
    return _step


def _step(model, opt, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


@pytest.fixture
def offload_run(tiny_gpt2, offload_config):
    """``offload_run(path, **settings)`` -> (model, opt): the tiny GPT-2 (about 120k
    parameters) wrapped with the suite's config under ``path``, and its offloaded AdamW."""
    def run(path, **settings):
        os.makedirs(path, exist_ok=True)
        model = offload.wrap(tiny_gpt2(), offload_config(path, **settings))
        # small shards: the step is a pipeline of several reads, updates and writes
        return model, offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, shard_size=16384)
    return run


@pytest.fixture
def reference(tiny_gpt2, batches):
    """``reference(steps, skipped=None)`` -> (losses, weights): the same run in memory with
    torch's AdamW over ``batches(steps)``, batch ``skipped`` never applied."""
    def run(steps: int, skipped: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        losses = [_step(model, opt, ids) for i, ids in enumerate(batches(steps)) if i != skipped]
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


@pytest.fixture
def assert_weights():
    """``assert_weights(model, expected)``: the model's weights (wrapped or not) equal
    ``expected``, a state dict."""
    def check(model, expected: dict[str, torch.Tensor]) -> None:
        got = offload.state_dict(model) if offload.params.find(model) is not None else model.state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, msg=name)
    return check


@pytest.fixture
def close_all():
    """``close_all(model, opt)``: what a user does after an error: close the optimizer,
    release the model."""
    return _close_all


def _close_all(model, opt) -> None:
    opt.close()
    offload.close(model)


@pytest.fixture
def assert_released():
    """``assert_released(nvme_dir)``: no swap file and no lock left in the directory."""
    return _assert_released


def _assert_released(nvme_dir) -> None:
    left = glob.glob(os.path.join(str(nvme_dir), "offload-*"))
    assert not left, f"files left behind: {left}"


@pytest.fixture
def save_after(offload_run, batches):
    """``save_after(path, steps=2, **settings)`` -> (model, opt, checkpoint): ``steps``
    offloaded steps, then a checkpoint at ``path/ckpt``."""
    def run(path, steps: int = 2, **settings):
        model, opt = offload_run(path, **settings)
        for ids in batches(steps):
            _step(model, opt, ids)
        checkpoint = str(path / "ckpt")
        offload.save_checkpoint(checkpoint, model, opt)
        return model, opt, checkpoint
    return run


@pytest.fixture
def resume_matches(offload_run, reference, batches, assert_weights):
    """``resume_matches(path, checkpoint, done, total)``: a fresh wrapped run (in
    ``path/resume``) loaded from ``checkpoint`` after ``done`` steps reaches the reference
    losses and weights of ``total`` steps, and releases its directory."""
    def check(path, checkpoint: str, done: int, total: int) -> None:
        losses, weights = reference(total)
        model, opt = offload_run(path / "resume")
        try:
            offload.load_checkpoint(checkpoint, model, opt)
            got = [_step(model, opt, ids) for ids in batches(total)[done:]]
            torch.testing.assert_close(got, losses[done:])
            assert_weights(model, weights)
        finally:
            _close_all(model, opt)
        _assert_released(path / "resume" / "nvme")
    return check
