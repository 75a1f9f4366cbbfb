"""What the optimizer is doing (``opt.phase``) and what it refuses after a step, an update
during backward or a load stopped half way, whatever else goes wrong while it cleans up."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.io import DiskFullError
from offload.optim import OptimizerPhase, _early, _pipeline, _writeback
from offload.params import manager_of
from offload.store import Residency, TensorStore, Tier


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 8))


def _steps(opt) -> list[float]:
    return [float(s.segments[0].step) for s in opt._book.shards]


@pytest.fixture
def interrupt(monkeypatch):
    """``interrupt(nth)``: Ctrl-C in the ``nth`` shard update, and again in the clean-up's
    first wait for a copy (a second Ctrl-C while the first is handled)."""
    def arm(nth: int) -> None:
        process, wait, calls = _pipeline.Pipeline.process, TensorStore.wait, [0]

        def interrupted(self, shard, *args, **kw):
            calls[0] += 1
            if calls[0] == nth:
                raise KeyboardInterrupt("first")
            return process(self, shard, *args, **kw)

        def second(self, key, tier, *, timeout=None):
            if timeout is not None:  # (the clean-up's bounded waits)
                raise KeyboardInterrupt("second")
            return wait(self, key, tier, timeout=timeout)

        monkeypatch.setattr(_pipeline.Pipeline, "process", interrupted)
        monkeypatch.setattr(TensorStore, "wait", second)
    return arm


def test_a_second_interrupt_in_the_clean_up_keeps_the_step_refused(tmp_path, offload_config, interrupt,
                                                                   monkeypatch, no_leaks):
    lin = torch.nn.Linear(64, 64)
    opt = offload.AdamW(lin.parameters(), lr=1e-2, shard_size=1024,
                        config=offload_config(tmp_path, param_tier="host", optimizer_tier="nvme"))
    try:
        lin(torch.randn(4, 64)).sum().backward()
        interrupt(3)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        monkeypatch.undo()
        assert opt.phase is OptimizerPhase.POISONED
        before = _steps(opt)
        with pytest.raises(RuntimeError, match=r"stopped after updating \d+ of \d+ shards.*load_checkpoint"):
            opt.step()
        assert _steps(opt) == before  # nothing updated twice
    finally:
        opt.close()


def test_a_second_interrupt_while_an_update_in_backward_is_abandoned(tmp_path, offload_config, interrupt,
                                                                     monkeypatch, no_leaks):
    model = offload.wrap(_mlp(), offload_config(tmp_path))
    opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=4096, grad_tier="nvme")
    advance = _early.EarlyUpdate.advance
    # each final shard updated in the hook that finalised it, waiting for its reads (as step()
    # does): a backward that outran the reads left every update to step(), and the test to chance
    monkeypatch.setattr(_early.EarlyUpdate, "advance", lambda self, *, block: advance(self, block=True))
    try:
        interrupt(2)
        with pytest.raises(KeyboardInterrupt):
            with opt.update_during_backward():
                model(torch.randn(4, 64)).pow(2).mean().backward()
        monkeypatch.undo()
        assert opt.phase is OptimizerPhase.POISONED and opt._early is None
        with pytest.raises(RuntimeError, match="shards during backward"):
            opt.step()
    finally:
        opt.close()
        offload.close(model)


def test_a_step_that_fails_finishing_an_update_in_backward_is_refused_after(tmp_path, offload_config,
                                                                             monkeypatch, no_leaks):
    model = offload.wrap(_mlp(), offload_config(tmp_path))
    opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=4096)
    try:
        with opt.update_during_backward():
            model(torch.randn(4, 64)).pow(2).mean().backward()

        def failing(self, pending):
            raise OSError(5, "injected: a group write-back")
        monkeypatch.setattr(_writeback.WriteBack, "finish_rest", failing)
        with pytest.raises(OSError, match="injected"):
            opt.step()
        monkeypatch.undo()
        before = _steps(opt)
        with pytest.raises(RuntimeError, match="shards during backward"):
            opt.step()
        assert _steps(opt) == before
    finally:
        opt.close()
        offload.close(model)


def test_a_state_dict_loaded_before_the_step_drops_the_update_in_backward(tmp_path, offload_config,
                                                                          monkeypatch, no_leaks):
    """fp32 groups on NVMe are updated in a host copy of the group: a group only partly
    updated during backward is dropped with that copy (and any device copy a prefetch made
    of it), so the model keeps the weights the loaded states belong to. (The weights stay
    marked, as the optimizer cannot tell whether the update changed some already: its
    close() accepts them here, to read them.)"""
    model = offload.wrap(_mlp(), offload_config(tmp_path))
    manager = manager_of(model)
    opt = offload.AdamW(model.parameters(), lr=1e-1, shard_size=4096)
    allowed = [1]  # the first shard to become final is updated in backward; the rest wait for step()

    def in_memory(self, shard):
        allowed[0] -= 1
        return allowed[0] >= 0
    monkeypatch.setattr(_early.EarlyUpdate, "_in_memory", in_memory)
    try:
        saved = opt.state_dict()
        before = {g.key: manager.group_bytes(g) for g in manager.groups if not g.resident}
        with opt.update_during_backward():
            model(torch.randn(4, 64)).pow(2).mean().backward()
        done = next(s for s in opt._book.shards if id(s) in opt._early.done)
        group = done.segments[0].owner.group
        opt.load_state_dict(saved)
        assert opt.phase is OptimizerPhase.IDLE
        with pytest.raises(RuntimeError, match="weights may be a mix"):
            manager.group_bytes(group)
        opt.close()
        torch.testing.assert_close(manager.group_bytes(group), before[group.key], rtol=0, atol=0)
        if manager.store.state(group.key, Tier.DEVICE) is Residency.RESIDENT:
            torch.testing.assert_close(manager.store.wait(group.key, Tier.DEVICE), before[group.key], rtol=0, atol=0)
    finally:
        opt.close()
        offload.close(model)


def test_a_failure_storing_new_states_lays_them_out_again(tmp_path, offload_config, monkeypatch, no_leaks):
    a, b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
    opt = offload.AdamW(a.parameters(), lr=1e-2, shard_size=512,
                        config=offload_config(tmp_path, param_tier="host", optimizer_tier="nvme"))
    try:
        opt.add_param_group({"params": list(b.parameters())})  # laid out at the next step
        (a(torch.randn(2, 32)).sum() + b(torch.randn(2, 32)).sum()).backward()
        put, calls = TensorStore.put, [0]

        def full(self, key, *args, **kw):
            calls[0] += 1
            if calls[0] == 2:  # (the first new shard's states stored, the second refused)
                raise DiskFullError("pwrite", str(tmp_path), 0, 1, 28)
            return put(self, key, *args, **kw)
        monkeypatch.setattr(TensorStore, "put", full)
        with pytest.raises(DiskFullError):
            opt.step()
        monkeypatch.undo()
        opt.step()
        assert all(s.state_key in s.store for s in opt._book.shards)
        assert _steps(opt) == [1.0] * len(opt._book.shards)
    finally:
        opt.close()


def test_a_step_from_a_hook_of_a_running_backward(tmp_path, offload_config, no_leaks):
    """torch lets a hook step the optimizer while its backward runs; so does offload, and
    the phase says the backward is still adding, then idle once it ends."""
    model = offload.wrap(_mlp(), offload_config(tmp_path, param_tier="host", optimizer_tier="host"))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    seen = []
    x = torch.randn(4, 64, requires_grad=True)
    x.register_hook(lambda g: (opt.step(), seen.append(opt.phase)) and None)
    try:
        model(x).pow(2).mean().backward()
        assert seen == [OptimizerPhase.ACCUMULATING] and opt.phase is OptimizerPhase.IDLE
        assert opt.stats["steps"] == 1
    finally:
        opt.close()
        offload.close(model)


def test_closing_after_an_interrupted_backward_and_a_closed_model(tmp_path, offload_config, no_leaks):
    """The accumulators a stopped backward left open are dropped at close, not written into
    a store the model's close has already released."""
    model = offload.wrap(_mlp(), offload_config(tmp_path))
    opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=4096)

    def stop(grad):
        raise KeyboardInterrupt
    model[0].bias.register_hook(stop)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(4, 64)).pow(2).mean().backward()
    assert any(s.acc is not None for s in opt._book.shards)
    offload.close(model)
    opt.close()
    assert opt.closed
