"""Demand fetch at its edges: writes inside a module's own forward, views that outlive the
forward, saved tensors changed before backward, copies used after a step, other threads,
and what is refused with a message instead of computing on stale or placeholder bytes."""

from __future__ import annotations

import copy
import threading
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload


def nvme_config(tmp_path, budget="8KiB", **kw):
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="host", nvme_path=str(tmp_path / "nvme"),
                device_budget=budget, host_budget="64MiB", file_size="16MiB", resident_bytes=0)
    args.update(kw)
    return offload.OffloadConfig(**args)


def pair(make, tmp_path, **kw):
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    offload.wrap(model, nvme_config(tmp_path, **kw))
    return model, ref


class ClampsItself(nn.Linear):
    """Weight clipping inside forward, through .data and through a view."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.data.clamp_(-0.1, 0.1)
            self.weight[0].zero_()
        return super().forward(x)


class SlicesItself(nn.Module):
    """Returns a view of its own weight (a learned positional table)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(32, 16))

    def forward(self, n):
        return self.table[:n]


def test_writes_inside_a_modules_forward_are_kept(tmp_path, no_leaks):
    model, ref = pair(lambda: nn.Sequential(ClampsItself(16, 16), nn.Linear(16, 16)), tmp_path)
    try:
        x = torch.randn(3, 16)
        with torch.no_grad():
            model(x)
            ref(x)
        weights = offload.state_dict(model)
        for n, q in ref.state_dict().items():
            torch.testing.assert_close(weights[n], q, msg=n)
    finally:
        offload.close(model)


def test_a_view_of_a_weight_returned_by_its_module_outlives_the_release(tmp_path, no_leaks):
    model, ref = pair(lambda: nn.ModuleDict({"pos": SlicesItself(), "other": nn.Linear(32, 32)}), tmp_path)
    try:
        rows = model["pos"](5)
        model["other"](torch.randn(2, 32))  # its group may take the released buffer
        torch.testing.assert_close(rows, ref["pos"](5))
        rows.sum().backward()
        ref["pos"](5).sum().backward()
        torch.testing.assert_close(model["pos"].table.grad, ref["pos"].table.grad)
    finally:
        offload.close(model)


def test_a_parameter_written_between_forward_and_backward_is_refused_like_torch(tmp_path, no_leaks):
    model, ref = pair(lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)), tmp_path)
    try:
        for m in (ref, model):
            loss = m(torch.randn(2, 16)).sum()
            with torch.no_grad():
                m[2].weight.mul_(2)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
    finally:
        offload.close(model)


def test_a_second_order_backward_is_refused(tmp_path, no_leaks):
    model, _ = pair(lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)), tmp_path)
    try:
        x = torch.randn(4, 16, requires_grad=True)
        with pytest.raises(RuntimeError, match="second-order backward.*create_graph"):
            torch.autograd.grad(model(x).sum(), x, create_graph=True)
    finally:
        offload.close(model)


def test_saved_tensors_read_outside_backward_are_copies(tmp_path, no_leaks):
    model, ref = pair(lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)), tmp_path)
    try:
        x = torch.randn(2, 16)
        out = model(x).sum()
        saved = out.grad_fn.next_functions[0][0]._saved_mat2  # debugging tools read these
        torch.testing.assert_close(saved, ref[2].weight.t())
        out.backward()  # and backward still runs
        coordinator = offload.params.manager_of(model).coordinator
        assert not any(coordinator.in_use(g) for g in coordinator.groups)  # nothing left held
    finally:
        offload.close(model)


@pytest.mark.parametrize("resident", [0, "1MiB"], ids=["streamed", "resident"])
def test_copies_used_after_the_parameter_changed_are_refused(tmp_path, resident, no_leaks):
    """(Resident groups, updated where they rest, left their copies silently stale.)"""
    model, _ = pair(lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), tmp_path, resident_bytes=resident)
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        before = model[0].weight.detach()
        sd = model.state_dict()
        kept = before.clone()  # an explicit clone is the user's own tensor
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        if resident:  # (p.detach() of a resident parameter is a view: it follows, as torch's)
            assert torch.equal(before, model[0].weight.detach())
        else:
            with pytest.raises(RuntimeError, match="taken before the parameter changed"):
                before.norm()
        with pytest.raises(RuntimeError, match="taken before the parameter changed"):
            torch.save(sd, str(tmp_path / "sd.pt"))
        kept.norm()
        model[0].weight.detach().norm()  # taken again: fine
        opt.close()
    finally:
        offload.close(model)


def test_writes_that_cannot_reach_the_parameter_are_refused(tmp_path, no_leaks):
    model, ref = pair(lambda: nn.Sequential(nn.Linear(16, 16)), tmp_path)
    try:
        with torch.no_grad():
            F.hardtanh(model[0].weight, -0.05, 0.05, inplace=True)  # an in-place functional
            F.hardtanh(ref[0].weight, -0.05, 0.05, inplace=True)
        torch.testing.assert_close(offload.state_dict(model)["0.weight"], ref[0].weight.detach())
        array = model[0].weight.detach().numpy()
        np.testing.assert_allclose(array, ref[0].weight.detach().numpy())
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1.0  # a copy's array: a write could not reach the parameter
        # layout questions are answered for the real (contiguous) layout, without a fetch
        fetched = offload.stats(model)["demand_fetches"]
        w = model[0].weight
        assert w.is_contiguous() and w.stride() == (16, 1) and torch.zeros_like(w).stride() == (16, 1)
        assert offload.stats(model)["demand_fetches"] == fetched
    finally:
        offload.close(model)


def test_other_threads_are_refused(tmp_path, no_leaks):
    model, _ = pair(lambda: nn.Sequential(nn.Linear(16, 16)), tmp_path)
    errors = []

    def read():
        try:
            model[0].weight.sum()
        except RuntimeError as err:
            errors.append(str(err))

    try:
        reader = threading.Thread(target=read)
        reader.start()
        reader.join()
        assert errors and "another thread" in errors[0] and "offload.state_dict" in errors[0]
    finally:
        offload.close(model)


def test_copying_or_pickling_the_wrapped_model_is_refused_with_the_ways_to_do_it(tmp_path, no_leaks):
    model, ref = pair(lambda: nn.Sequential(nn.Linear(16, 16)), tmp_path)
    try:
        with pytest.raises(TypeError, match=r"offload.state_dict\(model\).*offload.save_checkpoint.*"
                                            r"copy of one of its modules .* is an ordinary module"):
            copy.deepcopy(model)
        with pytest.raises(TypeError, match="offload.unwrap"):
            torch.save(model, str(tmp_path / "model.pt"))
        plain = copy.deepcopy(ref)
        plain.load_state_dict(offload.state_dict(model))  # the way the message names
        torch.testing.assert_close(plain[0].weight, ref[0].weight)
    finally:
        offload.close(model)


def test_a_copy_of_one_module_is_an_ordinary_module_in_memory(tmp_path, no_leaks):
    """copy.deepcopy of a module below the root (PEFT's modules_to_save copies the ones it
    names) gives plain parameters with the values and no offload hooks; the original stays
    wrapped, and the copy trains on its own."""
    def build():
        m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16)))
        m[2][0].forward = types.MethodType(lambda self, x: F.linear(x, self.weight, self.bias) * 2, m[2][0])
        return m  # (a forward patched onto one instance, as kernel libraries bind theirs: copies keep it)

    model, ref = pair(build, tmp_path)
    try:
        head = copy.deepcopy(model[2])
        assert all(type(p) is nn.Parameter for p in head.parameters()) and not head[0]._forward_pre_hooks
        assert vars(head[0])["forward"].__self__ is head[0] and "__deepcopy__" not in vars(head[0])
        torch.testing.assert_close(head[0].weight, ref[2][0].weight, rtol=0, atol=0)
        with torch.no_grad():
            head[0].weight.add_(1)  # (the copy's own: the wrapped module keeps its values)
        x = torch.randn(3, 16)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
        torch.testing.assert_close(head(x), ref[2](x) + 2 * x.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
    finally:
        offload.close(model)
    assert "__deepcopy__" not in vars(model[2][0])  # (unwrapped: copies as torch copies)


def test_a_torch_optimizer_over_frozen_wrapped_parameters_runs(tmp_path, no_leaks):
    model, _ = pair(lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), tmp_path)
    try:
        for p in model[0].parameters():
            p.requires_grad_(False)
        model[1].weight.requires_grad_(False)
        model[1].bias.requires_grad_(False)
        adapter = nn.Linear(16, 16)
        opt = torch.optim.AdamW(list(model.parameters()) + list(adapter.parameters()), lr=1e-3)
        adapter(model(torch.randn(2, 16))).sum().backward()
        opt.step()  # the frozen ones are skipped by torch, as without offload
    finally:
        offload.close(model)


class _KeepsWeight(torch.autograd.Function):
    """Keeps the weight itself for backward (not as a saved tensor): backward reads the
    parameter, which must be fetched then."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.x, ctx.w = x, w
        return x @ w

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.w.t(), ctx.x.t() @ g


class _CustomMatmul(nn.Linear):
    def forward(self, x):
        return _KeepsWeight.apply(x, self.weight) + self.bias


def test_parameters_as_autograd_inputs_are_not_fetched(tmp_path, no_leaks):
    """autograd.grad(loss, params) and backward(inputs=params) name the parameters as graph
    leaves: nothing is fetched for the call (all of them at once would pass the 8 KiB
    budget), a backward that reads a parameter fetches it as in any backward, and the
    gradients are torch's."""
    def make():
        return nn.Sequential(*(nn.Linear(32, 32) for _ in range(5)), _CustomMatmul(32, 32))

    model, ref = pair(make, tmp_path)
    try:
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
        params, ref_params = list(model.parameters()), list(ref.parameters())
        got = torch.autograd.grad(model(x).square().mean(), params)
        want = torch.autograd.grad(ref(x).square().mean(), ref_params)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        later = params[6:]
        model(x).square().mean().backward(inputs=later)
        ref(x).square().mean().backward(inputs=ref_params[6:])
        assert all(p.grad is None for p in params[:6])
        for p, q in zip(later, ref_params[6:]):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        assert offload.stats(model)["demand_fetches"] == 0
    finally:
        offload.unwrap(model)


def test_a_parameter_set_to_other_storage_takes_its_new_values(tmp_path, no_leaks):
    """p.set_(t) does not pass torch's dispatch (parametrize uses it to register on a wrapped
    module and to assign a parametrized weight): it was silently undone by the next fetch.
    The values it set become the group's; another shape is refused."""
    from torch.nn.utils import parametrizations

    model, ref = pair(lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), tmp_path)
    try:
        x = torch.randn(3, 8)
        for m in (model, ref):
            parametrizations.orthogonal(m[1])  # (sets the original to -I through set_)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
        with torch.no_grad():
            model[0].weight.set_(torch.full((8, 8), 0.5))
            ref[0].weight.set_(torch.full((8, 8), 0.5))
        assert torch.equal(model.state_dict()["0.weight"], ref.state_dict()["0.weight"])
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
        with pytest.raises(RuntimeError, match=r"nn.Parameter\(p\) of a parameter offload manages.*clone\(\)"):
            parametrizations.weight_norm(model[0])  # (makes a Parameter of the weight itself)
        with torch.no_grad():
            model[0].bias.set_(torch.zeros(3))
        with pytest.raises(RuntimeError, match=r"set to a \(3,\).*keeps the shape \(8,\)"):
            model(x)
    finally:
        offload.close(model)


@pytest.mark.parametrize("resident", [0, "1MiB"], ids=["streamed", "resident"])
def test_a_parameter_set_to_other_storage_then_loaded_or_unwrapped(tmp_path, resident, no_leaks):
    """A load overwrites what p.set_() gave (as torch's load_state_dict does; it was refused
    as if an optimizer update, and a resident group kept it), and unwrap keeps it (it was lost)."""
    model, ref = pair(lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), tmp_path, resident_bytes=resident)
    offload.save_checkpoint(tmp_path / "ckpt", model)
    with torch.no_grad():
        model[0].weight.set_(torch.full((8, 8), 0.5))
    offload.load_checkpoint(tmp_path / "ckpt", model)
    assert torch.equal(model[0].weight.detach(), ref[0].weight.detach())
    with torch.no_grad():
        model[1].weight.set_(torch.full((8, 8), 0.25))
    offload.unwrap(model)
    assert torch.equal(model[1].weight.detach(), torch.full((8, 8), 0.25))
