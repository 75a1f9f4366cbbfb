"""Activation offload on the simulated asynchronous device: saved tensors copied out on the
offloader's copy stream into pinned buffers, written by its thread, read back through the
device tier; the training equals the reference run's, with no race the simulator sees."""

from __future__ import annotations

import pytest
import torch

import offload

from .sim import simulated
from .training import STEPS, config, make_opt, reference, train


@pytest.mark.parametrize("tier", ["nvme", "host"])
def test_training_with_activations_offloaded_equals_the_reference(tmp_path, tier, tiny_gpt2, lm_batches):
    batches = lm_batches(211, steps=STEPS)
    ref_losses, ref_weights = reference(tiny_gpt2, batches, "gpt2")
    act = dict(activation_tier=tier, activation_budget=0, activation_min_bytes=0, activation_prefetch="64KiB",
               activation_host_budget="8MiB")
    with simulated(seed=0, max_delay=0.002) as sim:
        model = offload.wrap(tiny_gpt2(), config(tmp_path, **act))
        assert offload.params.manager_of(model).activations.writer is not None  # (the device path)
        opt = make_opt(model.parameters(), True)
        try:
            losses = train(model, opt, batches, during_backward=False)
            opt.synchronize()
            stats = offload.stats(model)
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            opt.close()
            offload.close(model)
        assert sim.pageable_copies == 0  # (the copies out go to pinned buffers)
        assert sim.allocated == 0
    assert stats["act_written_bytes"] > 0 and stats["act_read_bytes"] == stats["act_written_bytes"]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, want in ref_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_a_failed_write_stops_the_run_with_its_cause(tmp_path, tiny_gpt2, lm_batches):
    """A piece the writer's thread cannot put (a disk error) is raised at the next save or
    read, naming the cause; the model closes cleanly."""
    ids = lm_batches(211, steps=1)[0][0]
    act = dict(activation_tier="nvme", activation_budget=0, activation_min_bytes=0, activation_prefetch="64KiB",
               activation_host_budget="8MiB")
    with simulated(seed=0) as sim:
        model = offload.wrap(tiny_gpt2(), config(tmp_path, **act))
        store = offload.params.manager_of(model).activations.store
        put, calls = store.put, []

        def failing(key, *args, **kwargs):
            calls.append(key)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            return put(key, *args, **kwargs)

        store.put = failing
        with pytest.raises(offload.activations.ActivationOffloadError, match="No space left"):
            model(input_ids=ids, labels=ids).loss.backward()
        offload.close(model)
        assert sim.allocated == 0
