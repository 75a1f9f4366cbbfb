"""Where gradients rest (grad_tier) and updates during backward (update_during_backward),
each against torch's optimizer on the same model without offload."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.io import BudgetError

transformers = pytest.importorskip("transformers")


def train_squares(m, opt, xs, *, overlapped, before=None, clear_grads=False) -> list[float]:
    """Steps on the mean square of ``m(x)`` for each ``x``: backward inside
    ``update_during_backward()`` when ``overlapped``; ``before(step)`` runs before each
    forward; ``clear_grads`` drops every ``p.grad`` after each step. The losses."""
    out = []
    for step, x in enumerate(xs):
        if before is not None:
            before(step)
        loss = m(x).pow(2).mean()
        if overlapped:
            with opt.update_during_backward():
                loss.backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        if clear_grads:
            for p in m.parameters():
                p.grad = None
        out.append(float(loss.detach()))
    return out


def train_overlapped(model, opt, batches, *, sched=None, events=None):
    """Like ``train``: every micro-batch but the last backward outside the block, the last
    inside it. Records how many updates had begun when each step's backward returned."""
    losses, during = [], []
    for micro in batches:
        total = 0.0
        for i, ids in enumerate(micro):
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            if i == len(micro) - 1:
                before = len(events) if events is not None else 0
                with opt.update_during_backward():
                    loss.backward()
                if events is not None:
                    during.append(sum(1 for e, _ in events[before:] if e == "update_start"))
            else:
                loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total)
    return losses, during


@pytest.mark.parametrize("grad_tier", ["auto", "nvme"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_update_during_backward_matches_torch(tmp_path, arch, tier, grad_tier, tiny_gpt2, tiny_llama, lm_batches,
                                              make_opt, decay_groups, train, offload_config, assert_losses,
                                              assert_same_weights, no_leaks):
    """5 steps of 2 accumulated micro-batches, LambdaLR, decay groups, small shards (groups
    span several shards, shards several groups): the same trajectory as torch's AdamW."""
    build = tiny_gpt2 if arch == "gpt2" else tiny_llama
    ref, model = build(), build()
    batches = lm_batches(model.config.vocab_size)
    ref_opt = make_opt("adamw", decay_groups(ref), False)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    ref_losses = train(ref, ref_opt, batches, sched=ref_sched)

    offload.wrap(model, offload_config(tmp_path, optimizer_tier=tier))
    try:
        events = []
        opt = make_opt("adamw", decay_groups(model), True, shard_size=6000, grad_tier=grad_tier)
        opt.events = events
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        losses, during = train_overlapped(model, opt, batches, sched=sched, events=events)
        assert_losses(losses, ref_losses, rtol=0, atol=0)
        assert len(opt._book.shards) > 4
        if tier == "host":  # states in memory: every shard is updated inside backward
            assert during == [len(opt._book.shards)] * len(batches), during
        # on NVMe a shard is updated inside backward once its states have been read (the
        # backward does not wait for them); step() updates the rest: how many is timing
        opt.close()
    finally:
        offload.unwrap(model)
    assert_same_weights(model, ref, rtol=0, atol=0)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_settings_changed_after_update_during_backward_began_are_refused(tmp_path, tier, branchy, offload_config,
                                                                          assert_losses, assert_same_weights,
                                                                          no_leaks):
    """A learning rate set between the backward and step() (a warmup placed there) was taken
    by the shards step() updated and not by those the backward had: host tier's steps ran
    whole with the old rate, silently. Now, where the backward updated a shard before the
    change, every shard of that step takes the earlier settings and step() raises
    SettingsChangedError naming the change; where it had updated none (states still being
    read on NVMe), the step takes the new ones, as torch's. A rate set inside the block
    before the backward is simply taken. The run equals torch's with the rates each step
    took."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 32, generator=g) for _ in range(5)]
    rates = [1e-2, 2e-2, 2e-2, 5e-3, 1e-3]  # (step 2 sets the rate it has: nothing to refuse)
    model = branchy()
    # (host: parameters too, so that nothing waits on a disk and every shard is updated
    # inside the backward, which makes the refusals certain)
    offload.wrap(model, offload_config(tmp_path, param_tier=tier, optimizer_tier=tier))
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, shard_size=1500)
        losses, refused = [], []
        for i, x in enumerate(xs):
            loss = model(x).pow(2).mean()
            with opt.update_during_backward():
                if i == 4:  # (set before the backward, inside the block)
                    opt.param_groups[0]["lr"] = rates[i]
                loss.backward()
            opt.param_groups[0]["lr"] = rates[i]
            try:
                opt.step()
            except offload.optim.SettingsChangedError as err:
                assert "group 0's lr changed from" in str(err) and "before the backward" in str(err), err
                refused.append(i)
            opt.zero_grad()
            losses.append(float(loss.detach()))
        assert set(refused) <= {1, 3}
        if tier == "host":
            assert refused == [1, 3]
        assert opt.param_groups[0]["lr"] == rates[-1]  # (the user's setting stays, for the next step)
        opt.close()
    finally:
        offload.unwrap(model)
    ref = branchy()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_losses = []
    for i, x in enumerate(xs):  # a refused step took the rate from before the change
        ref_opt.param_groups[0]["lr"] = (rates[i - 1] if i else 1e-2) if i in refused else rates[i]
        loss = ref(x).pow(2).mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    assert_losses(losses, ref_losses, rtol=0, atol=0)
    assert_same_weights(model, ref, rtol=0, atol=0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("host_budget", [299008, 409600, 1048576])
def test_update_during_backward_at_a_tight_host_budget_never_waits_for_ever(tmp_path, host_budget, tiny_llama, train,
                                                                            offload_config, assert_losses, no_leaks):
    """At host budgets the plain step runs at, the backward's first gradient sums waited
    for host room that the update during backward held for its queued shards, whose turn
    comes only in a later gradient hook: the process hung without using the CPU (found by a
    new user's trial). Now the queued shards are updated when the backward needs their
    room, and reads ahead leave the backward's gradients room: the run equals torch's, or
    stops with a BudgetError that names host_budget (which of the two, at the two tight
    budgets, depends on when reads land; at 1 MiB it runs)."""
    ref, model = tiny_llama(vocab_size=128), tiny_llama(vocab_size=128)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(3)]
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True), [[ids] for ids in batches])
    offload.wrap(model, offload_config(tmp_path, device_budget="100KiB", host_budget=host_budget, resident_bytes=0,
                                       cache_bytes=0))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    try:
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            with opt.update_during_backward():
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        assert_losses(losses, ref_losses, rtol=0, atol=0)
    except BudgetError as err:
        assert "host_budget" in str(err) and host_budget < 1 << 20, err
    finally:
        opt.close()
        offload.unwrap(model)


def test_update_during_backward_with_a_parameter_without_gradient(tmp_path, branchy, offload_config, assert_losses,
                                                                  assert_same_weights, no_leaks):
    """The side layer gets no gradient on odd steps; its shards are not updated, and the
    parameter groups they share with updated layers keep its current bytes."""
    ref, model = branchy(), branchy()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 32, generator=g) for _ in range(5)]

    def run(m, opt, overlapped):
        def side(step):
            m.use_side = step % 2 == 0
        return train_squares(m, opt, xs, overlapped=overlapped, before=side)

    ref_losses = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True), False)
    # one group for the whole model: shards of updated and not-updated layers share it
    offload.wrap(model, offload_config(tmp_path, resident_bytes=0, group_bytes="1MiB"))
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, shard_size=1500)
        assert_losses(run(model, opt, True), ref_losses, rtol=0, atol=0)
        opt.close()
    finally:
        offload.unwrap(model)
    # the side layer's segments are updated with a step count that lags the others' (as in
    # torch); the fused kernel then rounds one element in a last bit differently
    assert_same_weights(model, ref, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("param_tier", ["nvme", "host"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_update_during_backward_with_activation_checkpointing(tmp_path, reentrant, tier, param_tier, tiny_gpt2, train,
                                                              lm_batches, make_opt, offload_config, assert_losses,
                                                              assert_same_weights, no_leaks):
    """Reentrant checkpointing runs a nested backward per block inside the outer one: that
    is not an interrupted backward, and each parameter still reports once. fp32 groups are
    updated in place, in a host copy (parameters on NVMe) or in their home (in host memory),
    while the recomputation still uses some groups."""
    ref, model = tiny_gpt2(), tiny_gpt2()
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    batches = lm_batches(model.config.vocab_size, steps=3, micro=1)
    ref_losses = train(ref, make_opt("adamw", ref.parameters(), False), batches)
    offload.wrap(model, offload_config(tmp_path, param_tier=param_tier, optimizer_tier=tier))
    try:
        opt = make_opt("adamw", model.parameters(), True, shard_size=6000)
        assert not any(s.master for s in opt._book.shards)
        losses, _ = train_overlapped(model, opt, batches)
        assert_losses(losses, ref_losses, rtol=0, atol=0)
        opt.close()
    finally:
        offload.unwrap(model)
    assert_same_weights(model, ref, rtol=0, atol=0)


def test_update_during_backward_refuses_what_it_cannot_do_exactly(tmp_path, tiny_gpt2, offload_config, lm_batches,
                                                                  branchy, no_leaks):
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    ids = lm_batches(211, steps=1, micro=1)[0][0]
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-3, shard_size=6000)
        with opt.update_during_backward():
            model(input_ids=ids, labels=ids).loss.backward()
        with pytest.raises(RuntimeError, match="before the total norm was known"):
            opt.clip_grad_norm_(1.0)
        with pytest.raises(RuntimeError, match="To clip, leave out update_during_backward"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # (torch's, through p.grad)
        with pytest.raises(RuntimeError, match="already used in this step"):
            with opt.update_during_backward():
                pass
        # a second backward before step(): refused, and the step cannot complete any more
        with pytest.raises(RuntimeError, match="received a gradient after its shard was final"):
            model(input_ids=ids, labels=ids).loss.backward()
        with pytest.raises(RuntimeError, match="stopped after updating"):
            opt.step()
        opt.close()
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.clip_grad_norm_(1.0)
        with pytest.raises(ValueError, match="clip_grad_norm_.. was called before"):
            with opt.update_during_backward():
                pass
        opt.close()
    finally:
        offload.close(model)
    fp16 = offload.wrap(branchy(), offload_config(tmp_path / "h", compute_dtype="fp16", resident_bytes=0))
    try:
        opt = offload.AdamW(fp16.parameters())
        with pytest.raises(ValueError, match="fp16 loss scaling"):
            with opt.update_during_backward():
                pass
        opt.close()
    finally:
        offload.close(fp16)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_interrupted_backward_with_updates_during_it(tmp_path, tier, lm_batches, tiny_gpt2, make_opt, train,
                                                     offload_config, no_leaks):
    """An exception in the middle of an update_during_backward() pass: when no shard was
    updated yet, going on drops the batch and equals the reference that never saw it; when
    some were, step() refuses until states are loaded."""
    batches = lm_batches(211, steps=3, micro=1)
    ref = tiny_gpt2()
    ref_opt = make_opt("adamw", ref.parameters(), False)
    train(ref, ref_opt, [batches[0], batches[2]])

    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, optimizer_tier=tier))
    try:
        opt = make_opt("adamw", model.parameters(), True, shard_size=6000)
        train_overlapped(model, opt, [batches[0]])
        (ids,) = batches[1]

        def boom(*_):
            raise KeyboardInterrupt

        # the last layer's backward hook fires before any gradient reaches the optimizer
        handle = model.lm_head.register_full_backward_pre_hook(boom)
        with pytest.raises(KeyboardInterrupt):
            with opt.update_during_backward():
                model(input_ids=ids, labels=ids).loss.backward()
        handle.remove()
        opt.zero_grad()
        train_overlapped(model, opt, [batches[2]])
        got = offload.state_dict(model)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)

        if tier == "nvme":  # whether a shard's states were read before the interrupt is timing
            opt.close()
            return
        # now interrupt after some shards were updated: the first block's backward
        handle = model.transformer.h[0].register_full_backward_pre_hook(boom)
        with pytest.raises(KeyboardInterrupt):
            with opt.update_during_backward():
                model(input_ids=ids, labels=ids).loss.backward()
        handle.remove()
        with pytest.raises(RuntimeError, match="shards during backward"):
            opt.step()
        opt.close()
    finally:
        offload.close(model)


@pytest.mark.parametrize("grad_tier", ["auto", "host", "nvme"])
def test_grad_tier(tmp_path, grad_tier, tiny_gpt2, lm_batches, train, make_opt, decay_groups, offload_config,
                   assert_losses, assert_same_weights, no_leaks):
    """Gradients of a model whose states are on NVMe: in host memory under "auto" when the
    budget holds them (nothing written for them), on NVMe under "nvme"; the trajectory is
    torch's either way."""
    ref, model = tiny_gpt2(), tiny_gpt2()
    batches = lm_batches(model.config.vocab_size, steps=3)
    ref_losses = train(ref, make_opt("adamw", decay_groups(ref), False), batches, clip=0.5)
    offload.wrap(model, offload_config(tmp_path))
    try:
        opt = make_opt("adamw", decay_groups(model), True, shard_size=6000, grad_tier=grad_tier)
        homes = {s.grad_home for s in opt._book.shards}
        assert homes == ({offload.store.Tier.NVME} if grad_tier == "nvme" else {offload.store.Tier.HOST})
        assert_losses(train(model, opt, batches, clip=0.5), ref_losses)
        state = sum(s.state_bytes for s in opt._book.shards)
        grads = sum(s.grad_bytes for s in opt._book.shards)
        groups = offload.params.manager_of(model).groups
        params = sum(g.nbytes for g in groups if not g.resident)  # fp32 groups updated in place
        opt.synchronize()  # (the last step's update runs in the next forward: finish it before counting)
        stats = opt.stats
        # states each step; gradients once per micro-batch (2) only when they rest on NVMe;
        # parameters at most each step: a group held in host memory between updates is
        # written once when the room is needed or at synchronize()
        assert (stats["master_write_bytes"] + stats["moments_write_bytes"]) / 3 == state
        assert stats["gradients_write_bytes"] / 3 == (2 * grads if grad_tier == "nvme" else 0)
        assert params <= stats["parameters_write_bytes"] <= 3 * params
        assert offload.params.manager_of(model).store.behind_bytes == 0
        opt.close()
    finally:
        offload.unwrap(model)
    assert_same_weights(model, ref)


def test_grad_tier_auto_keeps_what_fits_and_host_refuses(tmp_path, tiny_gpt2, lm_batches, train, make_opt,
                                                         offload_config, assert_losses, assert_same_weights, no_leaks):
    """A host budget that holds some of the gradients: auto keeps the first shards' in host
    memory and the rest on NVMe (training still equals torch's); "host" is refused with
    the figures."""
    ref, model = tiny_gpt2(), tiny_gpt2()
    batches = lm_batches(model.config.vocab_size, steps=2)
    ref_losses = train(ref, make_opt("adamw", ref.parameters(), False), batches)
    offload.wrap(model, offload_config(tmp_path, host_budget="1600KiB", device_budget="1MiB"))
    try:
        with pytest.raises(BudgetError, match="grad_tier='host' keeps"):
            make_opt("adamw", model.parameters(), True, shard_size=6000, grad_tier="host")
        opt = make_opt("adamw", model.parameters(), True, shard_size=6000)
        homes = [s.grad_home for s in opt._book.shards]
        assert offload.store.Tier.HOST in homes and offload.store.Tier.NVME in homes
        assert_losses(train(model, opt, batches), ref_losses)
        opt.close()
    finally:
        offload.unwrap(model)
    assert_same_weights(model, ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlapped", [False, True], ids=["clipped_step", "update_during_backward"])
def test_training_on_cuda(tmp_path, overlapped, tiny_gpt2, lm_batches, train, offload_config, make_opt,
                          assert_losses, no_leaks):
    """On CUDA gradients are added on the drain worker; the queue advances from the gradient
    hooks on backward's thread and step() finishes it (or, clipped, step() after
    clip_grad_norm_): the same trajectory as torch's on the GPU."""
    ref, model = tiny_gpt2().cuda(), tiny_gpt2()
    batches = lm_batches(model.config.vocab_size, steps=3)
    clip = None if overlapped else 2.0  # (the norms are 2.9, 1.9, 1.9: the first step clips)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    ref_losses = train(ref, ref_opt, [[ids.cuda() for ids in micro] for micro in batches], clip=clip)
    offload.wrap(model, offload_config(tmp_path, device="cuda"))
    try:
        opt = make_opt("adamw", model.parameters(), True, shard_size=6000)
        on_gpu = [[ids.cuda() for ids in micro] for micro in batches]
        if overlapped:
            losses, _ = train_overlapped(model, opt, on_gpu)
        else:
            losses = train(model, opt, on_gpu, clip=clip)
        assert_losses(losses, ref_losses, rtol=1e-4, atol=1e-5)  # GPU kernels against the CPU update
        opt.close()
    finally:
        offload.unwrap(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("param_tier", ["nvme", "host"])
def test_update_during_backward_with_parameters_left_out_of_the_optimizer(tmp_path, param_tier, branchy, offload_config,
                                                                          assert_losses, assert_same_weights, no_leaks):
    """The optimizer is given all but the norm's parameters, which share the one parameter
    group with the others: the group written back keeps their bytes unchanged (updated in
    place on NVMe; assembled from master rows and the current bytes on the host tier)."""
    ref, model = branchy(), branchy()
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(4, 32, generator=g) for _ in range(3)]

    def trained(m):
        return [p for n, p in m.named_parameters() if not n.startswith("norm")]

    def run(m, opt, overlapped):  # (clearing the norm's gradients, which no optimizer consumes)
        return train_squares(m, opt, xs, overlapped=overlapped, clear_grads=True)

    ref_losses = run(ref, torch.optim.AdamW(trained(ref), lr=1e-2, weight_decay=0.1, fused=True), False)
    offload.wrap(model, offload_config(tmp_path, param_tier=param_tier, resident_bytes=0, group_bytes="1MiB"))
    try:
        opt = offload.AdamW(trained(model), lr=1e-2, weight_decay=0.1, shard_size=1500)
        assert_losses(run(model, opt, True), ref_losses, rtol=0, atol=0)
        opt.close()
    finally:
        offload.unwrap(model)
    assert_same_weights(model, ref, rtol=0, atol=0)
