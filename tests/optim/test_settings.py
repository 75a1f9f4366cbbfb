"""Torch's optimizer arguments and settings as code written for torch passes and changes
them: kernel choices, sparse gradients, a setting that needs a state row the optimizer was
not laid out with (refused where the update is decided) or one that drops a row (runs as
torch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload


def test_a_setting_that_needs_a_row_it_was_not_built_with_is_refused_and_one_that_drops_a_row_runs(no_leaks):
    """OneCycleLR (cycle_momentum) sets SGD's momentum after the optimizer laid out no
    momentum rows: refused at the first step with the fix. Built with a momentum, the same
    schedule follows torch's SGD; turning amsgrad off keeps following torch's Adam."""
    def run(make, sched=None, steps=3, change=None):
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = make(model.parameters())
        s = sched(opt) if sched else None
        for i in range(steps):
            if change is not None and i == 1:
                change(opt)
            model(torch.randn(5, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            if s is not None:
                s.step()
        return [p.detach().clone() for p in model.parameters()]

    def cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)

    with pytest.raises(ValueError, match=r"momentum_buffer.*laid out with \[\].*non-zero momentum"):
        run(lambda ps: offload.SGD(ps, lr=0.05), cycle)
    for ours, ref in zip(run(lambda ps: offload.SGD(ps, lr=0.05, momentum=0.9), cycle),
                         run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), cycle)):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)

    def amsgrad_off(opt):
        opt.param_groups[0]["amsgrad"] = False

    for ours, ref in zip(run(lambda ps: offload.Adam(ps, lr=0.01, amsgrad=True), change=amsgrad_off),
                         run(lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, fused=True), change=amsgrad_off)):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_torch_kernel_arguments_and_sparse_gradients(tmp_path, offload_config, no_leaks):
    """Code written for torch's optimizers passes kernel choices: accepted (the update is
    torch's fused kernel's), or refused where they need what offload cannot give. A sparse
    gradient, which torch's SGD takes, is refused with the fix, wrapped or not."""
    for kwargs in (dict(fused=True), dict(foreach=False), dict(capturable=False, differentiable=False)):
        offload.AdamW(nn.Linear(2, 2).parameters(), **kwargs).close()
    offload.SGD(nn.Linear(2, 2).parameters(), fused=True, foreach=None).close()
    for kwargs, match in ((dict(capturable=True), "CUDA graph"), (dict(differentiable=True), "outside autograd")):
        with pytest.raises(ValueError, match=match):
            offload.AdamW(nn.Linear(2, 2).parameters(), **kwargs)

    def sparse_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(64, 8, sparse=True), nn.Linear(8, 4))

    plain = sparse_model()
    opt = offload.SGD(plain.parameters(), lr=0.1)
    plain(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="dense gradients.*sparse=False"):
        opt.step()
    opt.close()
    wrapped = offload.wrap(sparse_model(), offload_config(tmp_path, resident_bytes=0))
    try:
        opt = offload.SGD(wrapped.parameters(), lr=0.1)
        with pytest.raises(RuntimeError, match="dense gradients.*sparse=False"):
            wrapped(torch.tensor([1, 2])).sum().backward()
        opt.close()
    finally:
        offload.unwrap(wrapped)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_settings_changed_after_a_step_of_a_wrapped_model(tmp_path, kind, offload_config, no_leaks):
    """In the usual order (step, then a scheduler changes a setting): a row dropped keeps
    following torch through the update in the next forward; a row added, in any param group
    of a shard, is refused by step() and by update_during_backward(), never met inside an
    update."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))

    def build(ps, ours, on):
        if kind == "sgd":
            return (offload.SGD if ours else torch.optim.SGD)(ps, lr=0.1, momentum=0.9 if on else 0.0)
        return offload.Adam(ps, lr=0.01, amsgrad=on) if ours else torch.optim.Adam(ps, lr=0.01, amsgrad=on, fused=True)

    def flip(opt, group, on):
        opt.param_groups[group]["momentum" if kind == "sgd" else "amsgrad"] = 0.9 if kind == "sgd" and on else on

    xs = [torch.randn(4, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref, model = make(), offload.wrap(make(), offload_config(tmp_path, resident_bytes=0))
    try:
        for m, ours in ((ref, False), (model, True)):
            opt = build(m.parameters(), ours, True)
            for x in xs:
                m(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
                flip(opt, 0, False)  # (a row no longer used)
            with torch.no_grad():
                m(xs[0])  # (the last update, in the next forward)
            if ours:
                opt.close()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        halves = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
        opt = build(halves, True, False)  # (one shard holds both groups)
        model(xs[0]).square().sum().backward()
        opt.step()
        opt.zero_grad()
        flip(opt, 1, True)
        model(xs[1]).square().sum().backward()
        with pytest.raises(ValueError, match="param group 1's settings now need the state rows"):
            opt.step()
        with pytest.raises(ValueError, match="param group 1's settings now need the state rows"):
            with opt.update_during_backward():
                pass
        opt.close()
    finally:
        offload.unwrap(model)


@pytest.mark.parametrize("where", ["plain", "plain-bf16", "resident"])
def test_a_graph_saved_before_the_step_is_refused_after_it_like_torch(where, tmp_path, offload_config, no_leaks):
    """The update writes parameters it holds as themselves through ``.data``: their version
    counters move as torch's optimizers' in-place updates move them, so a retained graph's
    second backward after ``step()`` is refused as torch refuses it, not run on new weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if where == "plain-bf16":
        model = model.to(torch.bfloat16)
    if where == "resident":  # (the update in step(): in the next forward, none happened before backward)
        model = offload.wrap(model, offload_config(tmp_path))
    opt = offload.AdamW(model.parameters(), lr=0.1, update_in_next_forward=False)
    ref = torch.optim.AdamW(nn.Linear(1, 1).parameters())  # (torch's behaviour, asserted alongside)
    try:
        x = torch.randn(5, 8, dtype=next(model.parameters()).dtype)
        loss = model(x).float().square().sum()
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        loss = ref.param_groups[0]["params"][0].square().sum()  # (square saves its input)
        loss.backward(retain_graph=True)
        ref.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    finally:
        opt.close()
        if where == "resident":
            offload.unwrap(model)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64])
def test_parameters_the_fp32_rows_cannot_train_as_torch_are_refused(dtype, no_leaks):
    """A complex parameter lost its imaginary part and a float64 one trained at float32
    precision, silently: refused when given to the optimizer, with the way round."""
    p = nn.Parameter(torch.randn(4, dtype=dtype))
    with pytest.raises(TypeError, match=r"float32 rows and would (drop its imaginary part|train it at float32 "
                                        r"precision).*torch optimizer of its own"):
        offload.AdamW([p], lr=0.1)
    opt = offload.SGD([nn.Parameter(torch.randn(2))], lr=0.1)
    with pytest.raises(TypeError, match="float32 rows"):
        opt.add_param_group({"params": iter([p])})
    assert len(opt.param_groups) == 1  # (the refused group is not kept)
    opt.close()


def test_a_parameter_split_across_shards_updates_as_torchs_whole(no_leaks):
    """A split parameter's pieces hold whole vectors: cut at 700 elements, the fused kernel
    ran each piece's last few as scalars and their last bits drifted from torch's run on the
    whole tensor (from the third step here)."""
    torch.manual_seed(0)
    w = torch.randn(70_000)
    ours, ref = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt = offload.AdamW([ours], lr=1e-2, weight_decay=0.1, shard_size=700)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    try:
        assert len(opt._book.shards) > 1
        for _ in range(5):
            g = torch.randn(70_000)
            ours.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            ref_opt.step()
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=0)
    finally:
        opt.close()


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_parameter_frozen_when_the_optimizer_was_built_trains_once_unfrozen(tmp_path, tier, tiny_gpt2,
                                                                               offload_config, lm_batches, no_leaks):
    """As torch's optimizer updates any parameter that has a gradient, one frozen when the
    optimizer was built trains from the backward after requires_grad_(True), bit for bit;
    a gradient set by hand on one still frozen is refused by name at step()."""
    runs = []
    for offloaded in (False, True):
        model = tiny_gpt2()
        model.transformer.wpe.weight.requires_grad_(False)
        model.transformer.ln_f.requires_grad_(False)  # (frozen throughout)
        if offloaded:
            model = offload.wrap(model, offload_config(tmp_path, param_tier=tier, optimizer_tier=tier))
        opt = (offload.AdamW if offloaded else torch.optim.AdamW)(model.parameters(), lr=1e-2, fused=True)
        for step, (ids,) in enumerate(lm_batches(211, steps=4, micro=1)):
            if step == 2:
                model.transformer.wpe.requires_grad_(True)
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        runs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if offloaded:
            frozen = model.transformer.ln_f.weight
            frozen.grad = torch.ones_like(frozen)
            with pytest.raises(RuntimeError, match=r"'transformer.ln_f.weight' .* did not take"):
                opt.step()
            opt.close()
            offload.close(model)
    for key in runs[0]:
        assert torch.equal(runs[1][key], runs[0][key]), key


@pytest.mark.parametrize("tier,moments", [("host", "fp32"), ("nvme", "int8")])
def test_reset_state_is_torchs_cleared_state_and_optimizer_state_refuses_use(tmp_path, tier, moments, tiny_gpt2,
                                                                             lm_batches, offload_config, no_leaks):
    """Training loops reset Adam's moments by clearing ``optimizer.state`` (ReLoRA-style
    restarts); an offload optimizer keeps them in its own tiers, where that changed nothing
    and the run went on as if untouched. ``optimizer.state`` now refuses every read and
    change with the fix, and ``reset_state(params)`` after the second step (the update
    still owed to the next forward) gives torch's trajectory with ``del opt.state[p]``:
    bit for bit in fp32; with 8-bit moments, equal to the same run reset through a state
    dict without those entries."""
    batches = [ids for (ids,) in lm_batches(211, steps=4, micro=1)]

    def run(make, reset, path=None):
        model = tiny_gpt2() if path is None else offload.wrap(tiny_gpt2(), offload_config(
            path, param_tier=tier, optimizer_tier=tier))
        opt = make(model)
        chosen = [model.transformer.h[0].mlp.c_fc.weight, model.lm_head.weight]
        for i, ids in enumerate(batches):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                reset(opt, chosen)
        weights = [p.detach().clone() for p in model.parameters()]
        if path is not None:
            opt.close()
            offload.close(model)
        return weights

    def torch_reset(opt, chosen):
        for p in chosen:
            del opt.state[p]

    def by_state_dict(opt, chosen):  # (what reset_state saves a user from: the whole state in memory)
        sd = opt.state_dict()
        order = [p for g in opt.param_groups for p in g["params"]]
        for p in chosen:
            del sd["state"][next(i for i, q in enumerate(order) if q is p)]
        opt.load_state_dict(sd)

    ours = run(lambda m: offload.AdamW(m.parameters(), lr=1e-2, moments=moments),
               lambda opt, chosen: opt.reset_state(chosen), tmp_path / "ours")
    if moments == "fp32":
        want = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), torch_reset)
    else:
        want = run(lambda m: offload.AdamW(m.parameters(), lr=1e-2, moments=moments), by_state_dict, tmp_path / "sd")
    untouched = run(lambda m: offload.AdamW(m.parameters(), lr=1e-2, moments=moments), lambda o, c: None,
                    tmp_path / "none")
    for got, ref in zip(ours, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert any(not torch.equal(got, other) for got, other in zip(ours, untouched))  # (the reset did something)

    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "refusals", param_tier=tier, optimizer_tier=tier))
    opt = offload.AdamW(model.parameters(), lr=1e-2, moments=moments)
    try:
        p = model.lm_head.weight
        for use in (lambda: opt.state[p], lambda: opt.state.clear(), lambda: opt.state.__setitem__(p, {}),
                    lambda: setattr(opt, "state", {}), lambda: opt.state.pop(p), lambda: len(opt.state),
                    lambda: p in opt.state, lambda: list(opt.state.values()), lambda: bool(opt.state)):
            with pytest.raises(offload.optim.OptimizerStateError, match=r"reset_state\(params\)"):
                use()
        with pytest.raises(ValueError, match="not one of this AdamW's"):
            opt.reset_state([torch.nn.Parameter(torch.zeros(3))])
        with opt.update_during_backward():  # (shards updated with the old states: refused, not half reset)
            model(input_ids=batches[0], labels=batches[0]).loss.backward()
        with pytest.raises(RuntimeError, match="within update_during_backward"):
            opt.reset_state()
        opt.step()
    finally:
        opt.close()
        offload.close(model)


def test_torchs_state_dict_hooks_run_around_the_whole_dict(no_leaks):
    """Hooks registered as on torch's optimizers run on an offload optimizer's state dicts:
    a save post-hook sees the states (it used to see an empty ``state``), a load pre-hook's
    changes are what loads, and the load post-hook runs (neither load hook used to)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    try:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        seen = []
        opt.register_state_dict_pre_hook(lambda o: seen.append("save pre"))
        opt.register_state_dict_post_hook(lambda o, sd: seen.append(("save post", sorted(sd["state"][0]))))

        def slower(o, sd):
            sd["param_groups"] = [{**g, "lr": 1e-5} for g in sd["param_groups"]]
            return sd

        opt.register_load_state_dict_pre_hook(slower)
        opt.register_load_state_dict_post_hook(lambda o: seen.append(("load post", o.param_groups[0]["lr"])))
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        assert seen == ["save pre", ("save post", ["exp_avg", "exp_avg_sq", "step"]), ("load post", 1e-5)]
        assert sd["param_groups"][0]["lr"] == 1e-2  # (the hook changed a copy, as torch's load does)
        reference = torch.optim.AdamW(nn.Linear(4, 3).parameters())
        assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in reference.state_dict()["param_groups"]]
    finally:
        opt.close()
