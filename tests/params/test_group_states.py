"""The coordinator's group states: changed through one checked transition, and telling what
each group is within and between passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.params._state import GroupState, check_transition


def test_an_impossible_transition_is_refused_naming_the_group():
    check_transition("layers.3", GroupState.RELEASED, GroupState.AHEAD)
    with pytest.raises(RuntimeError, match=r"'layers.3': ahead -> materialized is not a transition"):
        check_transition("layers.3", GroupState.AHEAD, GroupState.MATERIALIZED)
    with pytest.raises(RuntimeError, match=r"'layers.3': cached -> ahead"):
        check_transition("layers.3", GroupState.CACHED, GroupState.AHEAD)


def _states(coordinator):
    return {g.key: coordinator.records[g].state for g in coordinator.groups}


def test_states_follow_the_schedule_through_training_and_inference(tmp_path, no_leaks):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # 16.6 KiB groups
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="host",
                                nvme_path=str(tmp_path / "nvme"), device_budget="192KiB", host_budget="16MiB",
                                resident_bytes=0, file_size="4MiB", prefetch_bytes="40KiB", cache_bytes="auto")
    offload.wrap(model, cfg)
    coordinator = offload.params.manager_of(model).coordinator
    inside = {}
    model[3].register_forward_pre_hook(lambda m, args: inside.update(_states(coordinator)))  # after offload's
    try:
        x = torch.randn(4, 64)
        assert set(_states(coordinator).values()) == {GroupState.RELEASED}
        for _ in range(3):
            model(x).sum().backward()
            assert inside["3"] is GroupState.MATERIALIZED
            states = _states(coordinator)
            # between passes nothing is viewed; what is on the device is read ahead or cached
            assert not {GroupState.MATERIALIZED, GroupState.PARKED} & set(states.values())
            ahead = {g.key for g in coordinator.ahead}
            assert ahead == {k for k, s in states.items() if s is GroupState.AHEAD}
            assert coordinator.ahead_bytes == sum(g.nbytes for g in coordinator.ahead)
            cached = {k for k, s in states.items() if s is GroupState.CACHED}
            assert cached <= {g.key for g in coordinator.cached}
        assert coordinator.cached  # the budget leaves room to keep some groups
        with torch.no_grad():
            model(x)
        assert not coordinator.parked
    finally:
        offload.unwrap(model)
    assert set(_states(coordinator).values()) == {GroupState.RELEASED}
