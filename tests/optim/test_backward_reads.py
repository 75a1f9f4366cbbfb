"""State rows read during the backward, ahead of the update (``offload.optim._ahead``): the
update takes them from memory and the result is bit for bit the run without them; rows of a
shard that takes no step are dropped; a state dict loaded after the backward is the one the
update starts from; the host budget keeps the plan's room for the step."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

import offload
from offload.optim._ahead import BackwardReads, _loading
from offload.store import Residency, Tier, TensorStore


@contextlib.contextmanager
def _state_loads(opt):
    """The shard indices of the loads of the optimizer's state rows from NVMe into host memory."""
    keys = {s.state_key: s.index for s in opt._book.shards}
    loads = []
    start = TensorStore._start_load

    def counting(store, record, copy, source):
        if record.key in keys and copy.tier is Tier.HOST and source.tier is Tier.NVME:
            loads.append(keys[record.key])
        return start(store, record, copy, source)

    TensorStore._start_load = counting
    try:
        yield loads
    finally:
        TensorStore._start_load = start


@contextlib.contextmanager
def _without_reads_ahead():
    advance = BackwardReads.advance
    BackwardReads.advance = lambda self: None
    try:
        yield
    finally:
        BackwardReads.advance = advance


def _train(model, opt, batches, clip):
    losses = []
    for micro in batches:
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        model.zero_grad()
    return losses


def _read_to_the_end(ahead):
    """Go on reading ahead as later gradient hooks would (one shard at a time), until the
    last shard is asked for or the room is taken."""
    deadline = time.monotonic() + 30
    while ahead._next < len(ahead.book.shards) and time.monotonic() < deadline:
        at = ahead._next
        ahead.advance()
        if ahead._next == at and not (ahead.read and _loading(ahead.read[-1])):
            return  # (no room: stopped short)
        time.sleep(0.001)


def _state(opt):
    return {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("later", [True, False])
def test_the_same_bits_as_without_reading_ahead(tmp_path, later, tiny_gpt2, lm_batches, make_opt, decay_groups,
                                               offload_config, assert_losses, assert_same_weights, no_leaks):
    """4 steps, two micro-batches each, two param groups, clipping that triggers on some
    steps: weights, states, losses and the bytes counted by kind equal to the same run with
    nothing read ahead, and torch's; the rows were read during the backwards."""
    batches = lm_batches(211, steps=4)
    ref = tiny_gpt2()
    ref_losses = _train(ref, make_opt("adamw", decay_groups(ref), False), batches, 0.5)
    runs = []
    for ahead in (True, False):
        log_path = tmp_path / f"{ahead}.jsonl"
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / str(ahead), log_path=str(log_path)))
        opt = make_opt("adamw", decay_groups(model), True, shard_size=6000, update_in_next_forward=later)
        with contextlib.nullcontext() if ahead else _without_reads_ahead(), _state_loads(opt) as loads:
            losses = _train(model, opt, batches, 0.5)
            opt.synchronize()
        records = [json.loads(line) for line in log_path.read_text().splitlines()]
        logged = sum(r.get("optimizer_read_in_backward_bytes", 0) for r in records)
        assert logged == opt.stats["backward_read_bytes"]  # (the step log says what was read ahead)
        state = _state(opt)
        assert_losses(losses, ref_losses)
        assert_same_weights(model, ref)
        stats = dict(opt.stats, loads=sorted(loads))
        runs.append((losses, state, {n: p.detach().clone() for n, p in model.named_parameters()}, stats))
        opt.close()
        offload.close(model)
    (losses_a, state_a, weights_a, stats_a), (losses_b, state_b, weights_b, stats_b) = runs
    assert losses_a == losses_b
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    for i in state_a:
        for key in state_a[i]:
            assert torch.equal(state_a[i][key], state_b[i][key]), (i, key)
    assert stats_b["backward_read_bytes"] == 0
    assert stats_a["backward_read_bytes"] > 0
    for key in stats_a:
        if key.endswith("_bytes") and key != "backward_read_bytes":
            assert stats_a[key] == stats_b[key], key
    # the update took the rows read ahead (a copy dropped before its update is read twice)
    assert stats_a["loads"] == stats_b["loads"]


def test_rows_of_a_shard_without_a_step_are_dropped(tmp_path, branchy, offload_config, no_leaks):
    """A layer used on some steps only: its rows, read during a backward that gave it no
    gradient, are dropped at step(); nothing read ahead is left in host memory after it, and
    the optimizer's counters are those of the run without reading ahead."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    stats = []
    for ahead in (True, False):
        model = offload.wrap(branchy(), offload_config(tmp_path / str(ahead)))
        opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=1024)
        try:
            shards = opt._book.shards
            with contextlib.nullcontext() if ahead else _without_reads_ahead():
                for use_side in (True, False, True):
                    model.use_side = use_side
                    model(x).square().mean().backward()
                    _read_to_the_end(opt._sink.ahead)
                    read = list(opt._sink.ahead.read)
                    opt.step()
                    opt.zero_grad()
                    opt.synchronize()
                    side = [s for s in read if s.segments[0].param is model.side.weight]
                    assert bool(side) == ahead, "the side layer's rows were read ahead, with a gradient or without"
                    for shard in shards:
                        assert shard.store.state(shard.state_key, Tier.HOST) is Residency.ABSENT, shard.index
            stats.append(dict(opt.stats))
        finally:
            opt.close()
            offload.close(model)
    assert stats[0]["backward_read_bytes"] > 0
    for key in stats[0]:
        if key.endswith("_bytes") and key != "backward_read_bytes":
            assert stats[0][key] == stats[1][key], key


def test_a_state_dict_loaded_after_the_backward_is_updated(tmp_path, tiny_gpt2, lm_batches, offload_config,
                                                           no_leaks):
    """Rows read during a backward, then the optimizer's state dict of another step loaded
    before step(): the update starts from the loaded states, as without reading ahead."""
    (ids,), (ids2,) = lm_batches(211, steps=2, micro=1)
    results = []
    for ahead in (True, False):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / str(ahead)))
        opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=6000)
        with contextlib.nullcontext() if ahead else _without_reads_ahead():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            saved = opt.state_dict()
            model(input_ids=ids2, labels=ids2).loss.backward()
            opt.step()
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            read = opt.stats["backward_read_bytes"]
            opt.load_state_dict(saved)
            opt.step()
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        results.append((weights, _state(opt), read))
        opt.close()
        offload.close(model)
    (weights_a, state_a, read_a), (weights_b, state_b, _) = results
    assert read_a > 0
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    for i in state_a:
        for key in state_a[i]:
            assert torch.equal(state_a[i][key], state_b[i][key]), (i, key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("grad_tier", ["auto", "nvme"])
def test_reads_ahead_leave_the_plans_room(tmp_path, grad_tier, tiny_gpt2, lm_batches, offload_config, no_leaks):
    """A host budget with little beyond what the plan reserves for the step, two
    micro-batches (with gradients on NVMe a second backward reads each sum back beside its
    accumulator): the reads ahead take some shards' rows and give way where the backward
    needs the room; training goes on, bit for bit the run without reading ahead."""
    batches = lm_batches(211, steps=3)
    runs = []
    for ahead in (True, False):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / str(ahead), host_budget="3MiB"))
        opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=6000, grad_tier=grad_tier)
        try:
            rows = sum(s.state_bytes for s in opt._book.shards)
            with contextlib.nullcontext() if ahead else _without_reads_ahead():
                _train(model, opt, batches, 0.5)
            opt.synchronize()
            read = opt.stats["backward_read_bytes"]
            assert (0 < read < rows * len(batches)) if ahead else read == 0
            runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
        finally:
            opt.close()
            offload.close(model)
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def test_an_update_during_backward_after_micro_batches_read_ahead(tmp_path, tiny_gpt2, lm_batches, offload_config,
                                                                 no_leaks):
    """Rows read during the first micro-batch's backward, the last one inside
    update_during_backward(): the same bits and counters as without reading ahead."""
    batches = lm_batches(211, steps=2)
    runs = []
    for ahead in (True, False):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / str(ahead)))
        opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=6000)
        try:
            with contextlib.nullcontext() if ahead else _without_reads_ahead():
                for first, last in batches:
                    model(input_ids=first, labels=first).loss.backward()
                    _read_to_the_end(opt._sink.ahead)
                    with opt.update_during_backward():
                        model(input_ids=last, labels=last).loss.backward()
                    opt.step()
                    opt.zero_grad()
            opt.synchronize()
            runs.append(({n: p.detach().clone() for n, p in model.named_parameters()}, dict(opt.stats)))
        finally:
            opt.close()
            offload.close(model)
    (weights_a, stats_a), (weights_b, stats_b) = runs
    assert stats_a["backward_read_bytes"] > 0 == stats_b["backward_read_bytes"]
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    for key in stats_a:
        if key.endswith("_bytes") and key != "backward_read_bytes":
            assert stats_a[key] == stats_b[key], key


def test_the_backward_takes_room_back_from_rows_read_ahead(tmp_path, tiny_gpt2, lm_batches, offload_config,
                                                           no_leaks):
    """Where the backward needs more of the pool than is free (gradient accumulators resting
    on NVMe), the rows read ahead give it back, the newest first, and no more are read until
    the next step; the step after reads ahead again."""
    (ids,), (ids2,) = lm_batches(211, steps=2, micro=1)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, host_budget="3MiB"))
    opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=6000)
    try:
        ahead, store = opt._sink.ahead, opt._book.shards[0].store
        pool = store.staging
        model(input_ids=ids, labels=ids).loss.backward()
        _read_to_the_end(ahead)
        copies = list(ahead.read)
        assert len(copies) >= 3
        need = pool.budget - pool.in_use_bytes + copies[-1].state_bytes + copies[-2].state_bytes // 2
        read = opt.stats["backward_read_bytes"]
        ahead.shed(store, need)
        deadline = time.monotonic() + 10
        while pool.budget - pool.in_use_bytes < need:  # (a load under way gives its room back as it lands)
            assert time.monotonic() < deadline, "the room was not given back"
            time.sleep(0.001)
        assert ahead.read == copies[:-2]
        for shard in copies[-2:]:
            assert store.state(shard.state_key, Tier.HOST) is Residency.ABSENT
        for shard in copies[:-2]:
            assert store.state(shard.state_key, Tier.HOST) is not Residency.ABSENT
        ahead.advance()
        assert opt.stats["backward_read_bytes"] == read  # (stopped until the next step)
        opt.step()
        opt.zero_grad()
        loss = model(input_ids=ids2, labels=ids2).loss
        opt.synchronize()  # (the weights the update held in host memory go home: that room is the rows' again)
        loss.backward()
        assert opt.stats["backward_read_bytes"] > read
        opt.step()
        opt.synchronize()
    finally:
        opt.close()
        offload.close(model)


@pytest.mark.timeout(120)
def test_gradients_on_nvme_take_room_back_when_the_margin_is_thin(tmp_path, tiny_gpt2, lm_batches, offload_config,
                                                                  monkeypatch, no_leaks):
    """The margin cut to the update's own need (one shard in flight), gradients resting on
    NVMe and two micro-batches: the pool fills with rows read ahead, the backward's
    accumulators and their staging for NVMe take room back (shed), and the result is bit for
    bit the run without reading ahead."""
    batches = lm_batches(211, steps=3)
    sheds = []
    shed = BackwardReads.shed

    def counting(self, store, nbytes):
        sheds.append(nbytes)
        return shed(self, store, nbytes)

    monkeypatch.setattr(BackwardReads, "shed", counting)
    # (no margin at all: the rows read ahead fill the pool whatever the timing, so an
    # accumulator opening must always take room back; one shard's margin left it to timing)
    monkeypatch.setattr(BackwardReads, "_margin", lambda self, store: 0)
    runs = []
    for ahead in (True, False):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / str(ahead), host_budget="768KiB"))
        opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=6000, grad_tier="nvme")
        try:
            with contextlib.nullcontext() if ahead else _without_reads_ahead():
                _train(model, opt, batches, 0.5)
            opt.synchronize()
            runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
        finally:
            opt.close()
            offload.close(model)
    assert sheds, "the backward took no room back"
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def test_the_plan_counts_the_rows_read_in_the_backward(tmp_path, monkeypatch, tiny_gpt2, lm_batches, offload_config,
                                                     no_leaks):
    """The host pool's peak, reads ahead included, within the host rows of the plan (its
    promise about RSS). Shards are cut at most DEFAULT_SHARD long: made small here, the
    host budget leaves room for rows read ahead beyond the shards in flight, as a 355M
    model's do under 4 GiB (without the row, 11.5 MiB held against 10.7 MiB planned)."""
    monkeypatch.setattr(offload.optim._layout, "DEFAULT_SHARD", 100_000)
    cfg = offload_config(tmp_path, host_budget="64MiB")
    plan = offload.plan(tiny_gpt2(n_layer=4, n_embd=128), cfg, optimizer="adamw")
    ranks = offload.plan(tiny_gpt2(n_layer=4, n_embd=128), cfg.replace(world_size=2), optimizer="adamw")
    assert not any(r.item == "optimizer: states read in the backward" for r in ranks.rows)  # (ranks read none)
    model = offload.wrap(tiny_gpt2(n_layer=4, n_embd=128), cfg)
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    try:
        assert len(opt._book.shards) > 4  # (more than the shards in flight: the rest are read ahead)
        _train(model, opt, lm_batches(211, steps=2), 1.0)
        opt.synchronize()
        assert opt.stats["backward_read_bytes"] > 0
        assert offload.stats(model)["host_peak_bytes"] <= min(cfg.host_budget, plan.bytes_on("host")), str(plan)
    finally:
        opt.close()
        offload.close(model)
