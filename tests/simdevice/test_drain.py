"""The gradient drain on a device under a tight host budget.

Gradients leave the device through pinned copies that the drain worker adds into host
accumulators. The copies used to come from the host pool, where the worker's own add may
wait for room (an accumulator, the stage of a write to NVMe): with the pool full of copies
queued behind it, the worker and the autograd thread waited on each other for good. The
copies now have buffers of their own, counted in the optimizer's host budget; and reads of
optimizer shards ahead of their need leave the room a parameter group needs on its way to
the device.
"""

from __future__ import annotations

import pytest

import offload
from offload.io import BudgetError

from .sim import simulated
from .training import STEPS, config, make_opt, reference, run_and_compare


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host_budget", ["320KiB", "448KiB", "512KiB", "600KiB"])
@pytest.mark.parametrize("during_backward", [False, True])
def test_tight_host_budget_trains_without_waiting_for_ever(tmp_path, host_budget, during_backward, tiny_gpt2,
                                                           lm_batches):
    batches = lm_batches(211, steps=STEPS)
    run_and_compare(tmp_path, tiny_gpt2, batches, reference(tiny_gpt2, batches, "gpt2"), seed=1, max_delay=0.003,
                    optimizer_tier="nvme", during_backward=during_backward, host_budget=host_budget,
                    grad_tier="nvme")


def test_a_budget_without_room_for_the_copies_is_refused_at_construction(tmp_path, tiny_gpt2):
    # (256 KiB: at 320-384 KiB the layout now fits with shards cut at groups' edges or smaller, cut_to_fit)
    with simulated(seed=0):
        model = offload.wrap(tiny_gpt2(), config(tmp_path, host_budget="256KiB"))
        try:
            with pytest.raises(BudgetError, match="to copy gradients and a parameter group between host and device"):
                make_opt(model.parameters(), True, grad_tier="nvme")
        finally:
            offload.close(model)
