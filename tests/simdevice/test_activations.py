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


def test_a_write_stopped_half_way_keeps_the_other_graph_whole(tmp_path, tiny_gpt2, lm_batches):
    """A forward whose saves push an earlier graph's activations out, and whose copy out fails
    half way (a Ctrl-C while waiting for a buffer): the earlier graph's record goes back in
    place, and its backward gives the gradients of the run without offload."""
    first, second = lm_batches(211, steps=1, micro=2)[0]
    ref = tiny_gpt2()
    ref(input_ids=first, labels=first).loss.backward()
    act = dict(activation_tier="nvme", activation_budget="1MiB", activation_min_bytes=0,
               activation_prefetch="64KiB", activation_host_budget="8MiB")
    with simulated(seed=0) as sim:
        model = offload.wrap(tiny_gpt2(), config(tmp_path, **act))
        kept = model(input_ids=first, labels=first).loss  # (all of it within the budget)
        writer = offload.params.manager_of(model).activations.writer
        acquire, calls = writer.pool.acquire, []

        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return acquire(*args, **kwargs)

        writer.pool.acquire = interrupted
        more = []
        with pytest.raises(KeyboardInterrupt):
            for _ in range(64):  # graphs kept alive: their saves push the first graph's records out
                more.append(model(input_ids=second, labels=second).loss)
        del more
        writer.pool.acquire = acquire
        kept.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        offload.close(model)
        assert sim.allocated == 0
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7, msg=name)
