"""The update in the next forward (``offload.optim._deferred``, on by default): ``step()``
decides the step (clip factor, fp16 overflow) and each wrapped group is updated just before
the next forward uses it. Compared bit for bit with the same optimizer updating inside
``step()`` (``update_in_next_forward=False``), and with torch's to the stated tolerance."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch._dynamo.utils import counters

import offload
from offload.optim import OptimizerPhase


def _norms(model, batches):
    """The total gradient norm of each step of ``batches`` on a copy of ``model`` without
    updates (what a clip threshold is chosen against)."""
    norms = []
    for micro in batches:
        model.zero_grad()
        for ids in micro:
            (model(input_ids=ids, labels=ids).loss / len(micro)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)))
    return norms


def _run(model, opt, batches, clip):
    """Train with clipping, an LR scheduler stepping after each step (it must not change the
    step whose update is still owed) and ``model.zero_grad()`` (Trainer's way)."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses = []
    for micro in batches:
        total = 0.0
        for ids in micro:  # two micro-batches: accumulation
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        model.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("host", "host"), ("nvme", "host")])
def test_same_bits_as_updating_in_step(tmp_path, tiers, tiny_gpt2, lm_batches, make_opt, decay_groups,
                                       offload_config, assert_losses, assert_same_weights, no_leaks):
    """5 steps, two micro-batches each, two param groups, a clip that triggers on some steps
    and not others: weights, states and losses equal to the in-step update's bit for bit."""
    batches = lm_batches(211, steps=5)
    norms = _norms(tiny_gpt2(), batches)
    clip = sorted(norms)[2]  # the middle step's norm: the larger ones are clipped
    ref = tiny_gpt2()
    ref_opt = make_opt("adamw", decay_groups(ref), False)
    ref_losses = _run(ref, ref_opt, batches, clip)
    runs = []
    for later in (False, True):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / str(later), param_tier=tiers[0],
                                                         optimizer_tier=tiers[1]))
        opt = make_opt("adamw", decay_groups(model), True, shard_size=6000, update_in_next_forward=later)
        losses = _run(model, opt, batches, clip)
        assert opt.phase is (OptimizerPhase.UPDATING_IN_FORWARD if later else OptimizerPhase.IDLE)
        state = opt.state_dict()["state"]
        assert opt.phase is OptimizerPhase.IDLE  # (state_dict() finished the owed update)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert all(p.grad is None for p in model.parameters())
        runs.append((losses, state, weights))
        assert_losses(losses, ref_losses)
        assert_same_weights(model, ref)
        opt.close()
        offload.close(model)
    (losses_a, state_a, weights_a), (losses_b, state_b, weights_b) = runs
    assert sum(n > clip for n in norms) >= 2 and sum(n < clip for n in norms) >= 2
    assert losses_a == losses_b
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    for i in state_a:
        for key, value in state_a[i].items():
            assert torch.equal(value, state_b[i][key]), (i, key)


def test_each_group_is_updated_before_its_use(tmp_path, tiny_gpt2, lm_batches, offload_config, record_schedule,
                                              no_leaks):
    """The trace of a step: no shard is updated inside step(); in the next forward each
    shard's update ends before the first group it covers is materialized, and the reads of
    the next shards are issued before it."""
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-3, shard_size=6000)
        log = record_schedule(model)
        opt.events = log  # one list: the optimizer's events among the coordinator's
        batches = lm_batches(211, steps=2, micro=1)
        for (ids,) in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            del log[:]
            opt.step()
            assert not [e for e in log if e[0] == "update_start"]
            opt.zero_grad()
        model(input_ids=batches[0][0], labels=batches[0][0])
        events = log
        pos = {e: i for i, e in enumerate(events)}
        shards = opt._book.shards
        assert sum(("ready", seg.owner.group.key, "forward") in pos for s in shards for seg in s.segments) > 0
        assert opt.phase is OptimizerPhase.IDLE
        for shard in shards:
            keys = {seg.owner.group.key for seg in shard.segments}
            ready = [pos[("ready", k, "forward")] for k in keys if ("ready", k, "forward") in pos]
            if ready:
                assert pos[("update_end", shard.index)] < min(ready), shard.index
        updates = [e[1] for e in events if e[0] == "update_end"]
        assert updates == sorted(updates) == [s.index for s in shards]
        opt.close()
    finally:
        offload.close(model)


def test_accesses_between_step_and_forward_see_the_step(tmp_path, tiny_gpt2, lm_batches, offload_config, no_leaks):
    """What reads the weights or states before the next forward finishes the update first:
    model.state_dict(), a parameter read, offload.state_dict, the optimizer's state dict,
    p.grad of a kept gradient; and a new backward's gradients go into emptied sums."""
    (ids,), (ids2,) = lm_batches(211, steps=2, micro=1)
    want = {}
    ref = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "ref"))
    ref_opt = offload.AdamW(ref.parameters(), lr=1e-2, update_in_next_forward=False)
    ref(input_ids=ids, labels=ids).loss.backward()
    ref_opt.step()
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt.close()
    offload.close(ref)

    reads = [lambda m, o: m.state_dict(), lambda m, o: offload.state_dict(m),
             lambda m, o: {"w": m.transformer.h[1].mlp.c_fc.weight * 1},
             lambda m, o: {"g": m.transformer.h[1].mlp.c_fc.weight.grad * 1}]
    for i, read in enumerate(reads):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / str(i)))
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        assert opt.phase is OptimizerPhase.UPDATING_IN_FORWARD
        read(model, opt)
        if i < 3:
            assert opt.phase is OptimizerPhase.IDLE
            got = model.state_dict()
            for k, v in want.items():
                assert torch.equal(got[k], v), k
        opt.zero_grad()
        model(input_ids=ids2, labels=ids2).loss.backward()  # a fresh sum, not added to the last
        opt.close()
        offload.close(model)


def test_zero_grad_hides_until_the_update_has_read(tmp_path, tiny_gpt2, lm_batches, offload_config, no_leaks):
    """zero_grad() right after step(): p.grad reads None and an old p.grad refuses use at
    once, while the update still reads the sums; the step is the one without offload's."""
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    ref = tiny_gpt2()
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
        old = model.transformer.wte.weight.grad
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        assert model.transformer.wte.weight.grad is None
        assert opt.phase is OptimizerPhase.UPDATING_IN_FORWARD
        with pytest.raises(RuntimeError, match="dropped"):
            old.sum()  # (a call on a p.grad finishes the update first: then it is gone)
        got = model.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
        assert all(p.grad is None for p in model.parameters())
        opt.close()
    finally:
        offload.close(model)


def test_fp16_overflow_and_scale_follow_grad_scaler(tmp_path, branchy, offload_config, no_leaks):
    """fp16 with dynamic loss scaling: an overflow skips its step (weights unchanged) and
    halves the scale, a good step keeps it, as torch.amp.GradScaler does on the same run; the
    update in the next forward equals the one inside step() bit for bit."""
    x = torch.randn(4, 32)
    ref = branchy()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    want_scales, want_skipped = [], []
    for step in range(4):
        before = [p.detach().clone() for p in ref.parameters()]
        loss = ref(x).pow(2).mean() * (math.inf if step == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        want_skipped.append(all(torch.equal(a, b) for a, b in zip(before, ref.parameters())))
        want_scales.append(scaler.get_scale())
    outputs = []
    for later in (False, True):
        model = offload.wrap(branchy(), offload_config(tmp_path / str(later), compute_dtype="fp16",
                                                       resident_bytes=0))
        opt = offload.AdamW(model.parameters(), lr=1e-2, update_in_next_forward=later)
        assert opt.loss_scale == 2.0 ** 16
        scales, skipped = [], []
        for step in range(4):
            with torch.no_grad():
                before = model(x.half())
            loss = model(x.half()).float().pow(2).mean() * (math.inf if step == 1 else 1.0)
            opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                skipped.append(torch.equal(model(x.half()), before))
            scales.append(opt.loss_scale)
        assert scales == want_scales and skipped == want_skipped == [False, True, False, False]
        assert opt.stats["skipped_steps"] == 1
        with torch.no_grad():
            outputs.append(model(x.half()))
        opt.close()
        offload.close(model)
    assert torch.equal(outputs[0], outputs[1])


def test_a_dynamic_scale_halves_below_one_as_grad_scaler_does(tmp_path, branchy, offload_config, no_leaks):
    """Three overflows from a scale of 2 leave 0.25, as torch.amp.GradScaler's backoff does
    (no floor at 1)."""
    x = torch.randn(4, 32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    ref = branchy()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = offload.wrap(branchy(), offload_config(tmp_path, compute_dtype="fp16", resident_bytes=0))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    opt.loss_scale = 2.0
    try:
        for _ in range(3):
            scaler.scale(ref(x).pow(2).mean() * math.inf).backward()
            scaler.step(ref_opt)
            scaler.update()
            opt.scale_loss(model(x.half()).float().pow(2).mean() * math.inf).backward()
            opt.step()
            assert opt.loss_scale == scaler.get_scale()
        assert opt.loss_scale == 0.25 and opt.stats["skipped_steps"] == 3
        opt.zero_grad()
        opt.loss_scale = 5e-324  # (the least positive float: one more overflow would make it 0)
        opt.scale_loss(model(x.half()).float().pow(2).mean() * math.inf).backward()
        with pytest.raises(FloatingPointError, match="underflowed to 0 after 4 steps in a row"):
            opt.step()
    finally:
        opt.close()
        offload.close(model)


@pytest.mark.parametrize("failing", [1, 3])
def test_a_failed_update_in_the_forward_poisons(tmp_path, failing, tiny_gpt2, lm_batches, offload_config, no_leaks):
    """An error inside a shard's update (the first one, or a later one) fails the forward
    that needed it, and the optimizer refuses to step until a load, naming the cause."""
    (ids,), (ids2,) = lm_batches(211, steps=2, micro=1)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=6000)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        nf = opt._later.owed
        real = nf.pipeline.process
        calls = []

        def process(shard, *args, **kwargs):
            calls.append(shard.index)
            if len(calls) == failing:
                raise OSError("kernel failed")
            return real(shard, *args, **kwargs)

        nf.pipeline.process = process
        with pytest.raises(OSError, match="kernel failed"):
            model(input_ids=ids2, labels=ids2)
        nf.pipeline.process = real
        assert opt.phase is OptimizerPhase.POISONED
        said = rf"step\(\) stopped after updating {failing - 1} of \d+ shards \(its update, which runs in the next"
        with pytest.raises(RuntimeError, match=said):
            opt.step()
        with pytest.raises(RuntimeError, match=said):  # (a save would pass half a step off as a whole one)
            offload.save_checkpoint(tmp_path / "ckpt", model, opt)
        assert not (tmp_path / "ckpt").exists()
        with pytest.raises(RuntimeError, match=said):
            opt.state_dict()
        opt.close()
    finally:
        offload.close(model)


def test_two_optimizers_over_one_model(tmp_path, tiny_gpt2, lm_batches, decay_groups, offload_config, assert_losses,
                                       assert_same_weights, no_leaks):
    """Matrices in one optimizer, biases and norms in another (they share parameter groups):
    both updates owed to the same forward land, as two torch optimizers' steps."""
    batches = lm_batches(211, steps=3)
    ref = tiny_gpt2()
    ref_opts = [torch.optim.AdamW(g["params"], lr=1e-2, weight_decay=g["weight_decay"], fused=True)
                for g in decay_groups(ref)]
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    try:
        opts = [offload.AdamW(g["params"], lr=1e-2, weight_decay=g["weight_decay"]) for g in decay_groups(model)]
        losses = ([], [])
        for micro in batches:
            for m, os_, out in ((ref, ref_opts, losses[0]), (model, opts, losses[1])):
                total = 0.0
                for ids in micro:
                    loss = m(input_ids=ids, labels=ids).loss / len(micro)
                    loss.backward()
                    total += float(loss.detach())
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                for o in os_:
                    o.step()
                m.zero_grad()
                out.append(total)
        assert_losses(losses[1], losses[0])
        assert_same_weights(model, ref)
        for o in opts:
            o.close()
    finally:
        offload.close(model)


@pytest.mark.parametrize("shard_size,moments", [(None, "fp32"), (30000, "fp32"), (30000, "int8")])
def test_an_inference_mode_forward_between_steps(tmp_path, shard_size, moments, tiny_gpt2, lm_batches,
                                                 offload_config, no_leaks):
    """An optimizer built, and an evaluation run after each step, under torch.inference_mode():
    the owed update runs in the evaluation, and what is made there (pool buffers, staging,
    states) serves the steps and state dicts after it; the 8-bit coding loop is not compiled
    again for it. Weights equal those of the same run without inference mode."""
    batches = lm_batches(211, steps=3, micro=1)
    runs = []
    for evaluate in (False, True):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / str(evaluate)))
        with torch.inference_mode() if evaluate else contextlib.nullcontext():  # (built there too)
            opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=shard_size, moments=moments)
        graphs = counters["stats"]["unique_graphs"]  # (the coding loop compiles as the states are laid out)
        try:
            for step, (ids,) in enumerate(batches):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                if evaluate and step > 0:  # (the first update runs in the next training forward)
                    with torch.inference_mode():
                        model(input_ids=ids)
                    offload.state_dict(model)
                    opt.state_dict()
            opt.synchronize()
            assert counters["stats"]["unique_graphs"] == graphs
            runs.append({k: v.clone() for k, v in model.state_dict().items()})
        finally:
            opt.close()
            offload.close(model)
    for k, v in runs[0].items():
        assert torch.equal(runs[1][k], v), k


def test_groups_updated_in_the_forward_stay_in_memory_for_the_backward(tmp_path, tiny_gpt2, lm_batches,
                                                                        offload_config, no_leaks):
    """The update writes a group's new bytes into its host copy; the forward reads them from
    there, and the copy stays (held back) for the backward, which reads it from memory, and
    for the next update. synchronize() writes every held copy home. The weights are those of
    the update inside step() (``update_in_next_forward=False``)."""
    (ids,), (ids2,) = lm_batches(211, steps=2, micro=1)
    runs = {}
    for name, deferred in (("in step", False), ("next forward", True)):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / name, optimizer_tier="host", device_budget="128KiB"))
        opt = offload.AdamW(model.parameters(), lr=1e-2, update_in_next_forward=deferred)
        manager = offload.params.manager_of(model)
        store, nvme = manager.store, manager.store.tiers[offload.store.Tier.NVME]
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        loss = model(input_ids=ids2, labels=ids2).loss  # (the update runs in this forward)
        streamed = [g for g in manager.groups if not g.resident]
        held = [g for g in streamed if store.held_back(g.key)]
        before = nvme.read_bytes
        loss.backward()
        if deferred:
            assert held and len(held) == len(streamed)  # (the budget holds them all)
            assert nvme.read_bytes - before == 0  # (the backward read every group from memory)
            assert all(store.held_back(g.key) for g in held)  # (kept for the next update)
        else:
            assert not held and nvme.read_bytes - before > 0
        opt.step()
        opt.synchronize()
        assert store.behind_bytes == 0
        runs[name] = {k: v.clone() for k, v in model.state_dict().items()}
        opt.close()
        offload.close(model)
    for key, want in runs["in step"].items():
        assert torch.equal(runs["next forward"][key], want), key


def test_a_held_group_updated_during_the_next_backward(tmp_path, tiny_gpt2, lm_batches, offload_config, no_leaks):
    """Groups held in host memory since the last update, then updated during a backward
    (``update_during_backward``) in several shards each, while that backward still uses
    them: no write or drop of a copy being updated, and the weights are those of updates
    inside step()."""
    batches = [b for (b,) in lm_batches(211, steps=3, micro=1)]
    runs = {}
    for name, deferred in (("in step", False), ("next forward", True)):
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / name, optimizer_tier="host", device_budget="128KiB"))
        opt = offload.AdamW(model.parameters(), lr=1e-2, shard_size=6000, update_in_next_forward=deferred)
        for i, ids in enumerate(batches):
            loss = model(input_ids=ids, labels=ids).loss
            with opt.update_during_backward() if i == 1 else contextlib.nullcontext():
                loss.backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        runs[name] = {k: v.clone() for k, v in model.state_dict().items()}
        opt.close()
        offload.close(model)
    for key, want in runs["in step"].items():
        assert torch.equal(runs["next forward"][key], want), key


def test_model_state_dict_right_after_a_step_at_a_tight_host_budget(tmp_path, offload_config, no_leaks):
    """model.state_dict() between step() and the next forward finishes the update owed to
    that forward before it reads the groups: done group by group as each was read, the
    update's reads ahead and the snapshots' copies took the same host room, and a budget
    the plan accepts stopped with a BudgetError in 5 runs of 6. Weights equal torch's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    settings = dict(host_budget=131072, device_budget="64MiB", resident_bytes=0)
    assert offload.plan(model, offload_config(tmp_path, **settings), optimizer="adamw").fits
    model = offload.wrap(model, offload_config(tmp_path, **settings))
    opt = offload.AdamW(model.parameters(), lr=3e-3)
    try:
        g = torch.Generator().manual_seed(123)
        for _ in range(3):
            ids = torch.randint(0, 128, (2, 16), generator=g)
            for m, o in ((model, opt), (ref, ref_opt)):
                m(input_ids=ids, labels=ids).loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                o.step()
                o.zero_grad()
        got, want = model.state_dict(), ref.state_dict()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    finally:
        opt.close()
        offload.close(model)
