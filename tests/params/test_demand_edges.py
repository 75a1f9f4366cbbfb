"""Demand fetch at its edges: writes inside a module's own forward, views that outlive the
forward, saved tensors changed before backward, copies used after a step, other threads,
and what is refused with a message instead of computing on stale or placeholder bytes."""

from __future__ import annotations

import copy
import dataclasses
import threading

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


class _SavesItsOwn(nn.Module):
    """Saves, for backward, its output (exp), a buffer and a small parameter."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.register_buffer("scale", torch.rand(8) + 0.5)

    def forward(self, x):
        self.out = self.norm(self.lin(x)).exp()
        return self.out * self.scale


@pytest.mark.parametrize("changed", ["output", "scale", "norm.weight"])
@pytest.mark.parametrize("kept", [dict(resident_bytes=0), dict(resident_bytes="1MiB"),
                                  dict(activation_tier="nvme", activation_min_bytes="1MiB")],
                         ids=["streamed", "resident", "small-activations"])
def test_a_tensor_kept_as_saved_and_changed_before_backward_is_refused_like_torch(tmp_path, changed, kept,
                                                                                  no_leaks):
    """Torch checks the version of what it saves, not of what saved-tensor hooks return:
    what offload's hooks keep as itself (an activation, a buffer, a resident parameter) is
    checked by them."""
    model, ref = pair(_SavesItsOwn, tmp_path, **kept)
    try:
        for m in (ref, model):
            loss = m(torch.randn(4, 8)).sum()
            target = m.out if changed == "output" else dict([*m.named_parameters(), *m.named_buffers()])[changed]
            with torch.no_grad():
                target.mul_(2)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
    finally:
        offload.close(model)


class _KeepsATransposedWeight(torch.autograd.Function):
    """Keeps a view of the weight on ctx rather than saving it (no saved-tensor hook sees it)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        ctx.wt = w.t()
        return x @ ctx.wt

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g @ ctx.wt.t(), g.t() @ x


class _CustomLinear(nn.Module):
    def __init__(self, din, dout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) / 8)

    def forward(self, x):
        return torch.tanh(_KeepsATransposedWeight.apply(x, self.weight))


@dataclasses.dataclass
class _Rows:
    rows: torch.Tensor


class _RowsOfItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, n):
        return _Rows(self.w[:n])  # (a container the hooks cannot look into)


class _UsesRowsLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = _RowsOfItsWeight(), nn.Linear(16, 16)

    def forward(self, x):
        out = self.emb(4)
        h = self.lin(x)  # (its group may take the buffer emb's was in)
        return (out.rows ** 2).sum() + h.sum()


def test_views_of_a_weight_kept_past_its_forward_keep_its_bytes(tmp_path, no_leaks):
    """Views of a group's buffer the hooks cannot see (a custom Function's ctx attribute, an
    output in a plain dataclass) keep the weight's bytes: the buffer is not reused under
    them, through an evaluation pass between forward and backward."""
    dims = [64, 64, 32, 48, 64]
    model, ref = pair(lambda: nn.Sequential(*[_CustomLinear(dims[i], dims[i + 1]) for i in range(4)]), tmp_path,
                      budget="40KiB")
    try:
        x, held_out = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64)
        grads = []
        for m in (ref, model):
            x.grad = None
            y = m(x)
            with torch.no_grad():
                m(held_out)
            y.sum().backward()
            grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
        for ours, torchs in zip(*reversed(grads)):
            torch.testing.assert_close(ours, torchs, rtol=0, atol=0)
    finally:
        offload.close(model)
    (tmp_path / "rows").mkdir()
    model, ref = pair(_UsesRowsLater, tmp_path / "rows", budget="4KiB", prefetch_bytes=0)
    try:
        x = torch.ones(2, 16)
        losses = [m(x) for m in (ref, model)]
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(model.emb.w.grad, ref.emb.w.grad, rtol=0, atol=0)
    finally:
        offload.close(model)


def test_forward_mode_ad_and_torch_func_run_or_are_refused(tmp_path, no_leaks):
    import torch.autograd.forward_ad as fwAD

    model, ref = pair(lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), tmp_path)
    try:
        x, tangent = torch.randn(4, 8), torch.ones(4, 8)

        def jvp_forward_ad(m):
            with fwAD.dual_level():
                return fwAD.unpack_dual(m(fwAD.make_dual(x, tangent))).tangent

        with torch.no_grad():
            torch.testing.assert_close(jvp_forward_ad(model), jvp_forward_ad(ref), rtol=0, atol=0)
        torch.testing.assert_close(torch.func.vmap(model)(x.view(2, 2, 8)), torch.func.vmap(ref)(x.view(2, 2, 8)),
                                   rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="forward-mode AD.*with gradients on.*offload.unwrap"):
            jvp_forward_ad(model)
        for call in (lambda: torch.func.jvp(model, (x,), (tangent,)),
                     lambda: torch.func.grad(lambda x: model(x).sum())(x)):
            with pytest.raises(RuntimeError, match="inside torch.func's (jvp|grad) transform.*offload.unwrap"):
                call()
    finally:
        offload.close(model)


class _CheckpointsItsBlocks(nn.Module):
    """torch's reentrant checkpoint called around wrapped blocks (not switched on before wrap)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return x


@pytest.mark.parametrize("io_backend", ["direct", "mmap"])
def test_no_buffer_of_offloads_own_is_left_to_views(tmp_path, io_backend, no_leaks):
    """The pools find no view of a buffer alive when they reuse it, across training steps,
    a reentrant checkpoint's recompute, a state dict and unwrap: none is left out of the
    budget, and no buffer is mapped anew after the first step."""
    from offload.io._registry import _POOLS

    # (a budget with room beside the blocks: under a tighter one, the reentrant recompute's graph
    # still views a released block's buffer when the prefetch wants its room, and it is left)
    before = {id(p) for p in list(_POOLS)}
    model, _ = pair(_CheckpointsItsBlocks, tmp_path, budget="64KiB", io_backend=io_backend)
    pools = [p for p in list(_POOLS) if id(p) not in before]
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        mapped = []
        for step in range(3):
            model(torch.randn(8, 64, requires_grad=True)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            model.state_dict()
            mapped.append(sum(p.mapped for p in pools))
        opt.close()
        offload.unwrap(model)
        assert mapped[1] == mapped[2]
        assert pools and all(p.left_to_holders == 0 for p in pools)
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


def test_copies_used_after_the_parameter_changed_are_refused(tmp_path, no_leaks):
    model, _ = pair(lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), tmp_path)
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        before = model[0].weight.detach()
        sd = model.state_dict()
        kept = before.clone()  # an explicit clone is the user's own tensor
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
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
        with pytest.raises(RuntimeError, match="data_ptr.*outside its module's forward"):
            model[0].weight.data_ptr()
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
                                            r"modules_to_save.*get_peft_model before offload.wrap"):
            copy.deepcopy(model)  # (PEFT's modules_to_save deep-copies a module of a wrapped base)
        with pytest.raises(TypeError, match="offload.unwrap"):
            torch.save(model, str(tmp_path / "model.pt"))
        plain = copy.deepcopy(ref)
        plain.load_state_dict(offload.state_dict(model))  # the way the message names
        torch.testing.assert_close(plain[0].weight, ref[0].weight)
    finally:
        offload.close(model)


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
