"""p.grad of wrapped parameters whose gradients an offload optimizer holds: what torch code
(clip_grad_norm_, GradScaler, model.zero_grad(), logging) reads and writes, against the
same model and torch optimizer without offload."""

from __future__ import annotations

import gc
import logging
import math

import pytest
import torch

import offload


def backward(model, ids, scale=1.0):
    (model(input_ids=ids, labels=ids).loss * scale).backward()


def close(model, opt):
    opt.close()
    offload.unwrap(model)


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_torch_clip_grad_norm_clips(tmp_path, tier, norm_type, adamw_pair, lm_batches, assert_same_weights, no_leaks):
    """torch.nn.utils.clip_grad_norm_ over the wrapped model (what Accelerate and Trainer
    call): the same norms and the same clipped trajectory as without offload, bit for bit
    (no parameter here is split across shards)."""
    model, opt, ref, ref_opt = adamw_pair(tmp_path, tier)
    for (ids,) in lm_batches(211, steps=3, micro=1):
        backward(model, ids)
        backward(ref, ids)
        limit = 0.5 if norm_type == 2.0 else 0.1
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), limit, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), limit, norm_type=norm_type)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert float(want) > limit  # the clip changed something
        opt.step()
        ref_opt.step()
        # p.grad's norms after the step (a log line): the host tier's update multiplied the
        # sums in place, and their noted norms, divided to follow, were a last bit off
        norms = [[p.grad.norm(norm_type) for p in m.parameters() if p.grad is not None] for m in (model, ref)]
        torch.testing.assert_close(*norms, rtol=0, atol=0)
        model.zero_grad()
        ref_opt.zero_grad()
    assert_same_weights(model, ref, rtol=0, atol=0)
    close(model, opt)


def test_grad_values_and_inplace_writes(tmp_path, adamw_pair, lm_batches, assert_same_weights, no_leaks):
    """p.grad reads the accumulated values; an in-place write other than a scale
    (clip_grad_value_'s clamp) and an assignment are what the step then uses."""
    model, opt, ref, ref_opt = adamw_pair(tmp_path, "nvme")
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    for _ in range(2):  # two micro-batches: the accumulated sum
        backward(model, ids)
        backward(ref, ids)
    named = dict(model.named_parameters())
    for n, q in ref.named_parameters():
        assert named[n].grad is named[n].grad  # one object, as torch's
        torch.testing.assert_close(named[n].grad.clone(), q.grad, msg=n)
        assert named[n].grad.shape == q.grad.shape and named[n].grad.is_contiguous()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
    key = "transformer.h.0.mlp.c_fc.weight"
    named[key].grad = torch.ones_like(named[key].grad)
    dict(ref.named_parameters())[key].grad = torch.ones_like(named[key].grad)
    key = "transformer.h.1.attn.c_attn.weight"  # (.data assigned: the values taken, as torch's)
    named[key].grad.data = torch.full_like(named[key].grad, 0.5)
    dict(ref.named_parameters())[key].grad.data = torch.full_like(named[key].grad, 0.5)
    with pytest.raises(RuntimeError, match=r"p.grad.data = Tensor of shape \(3,\).*assign values of that shape"):
        named[key].grad.data = torch.ones(3)
    for n, q in ref.named_parameters():
        torch.testing.assert_close(named[n].grad.clone(), q.grad, msg=n)
    opt.step()
    ref_opt.step()
    assert_same_weights(model, ref)
    close(model, opt)


def test_a_pass_over_p_grad_reads_each_nvme_sum_once(tmp_path, adamw_pair, lm_batches, no_leaks):
    """A loop over p.grad (a per-layer norm for a log) with the sums on NVMe reads each shard
    once, not once per parameter in it, and sees every change made in between."""
    model, opt, ref, ref_opt = adamw_pair(tmp_path, "nvme")
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    backward(model, ids)
    backward(ref, ids)
    named, want = dict(model.named_parameters()), dict(ref.named_parameters())
    held = sum(p.numel() * 4 for p in model.parameters())

    def read_bytes():
        return opt.stats["gradients_read_bytes"]

    before = read_bytes()
    for n, q in want.items():
        torch.testing.assert_close(named[n].grad.clone(), q.grad, rtol=0, atol=0, msg=n)
    assert 0 < read_bytes() - before < 1.5 * held  # (each parameter's read of its shard: several times more)
    key = "transformer.h.1.mlp.c_proj.weight"
    named[key].grad.clone()
    again = read_bytes()
    named[key].grad.sum()  # (a call on its elements: read from the sums, unless kept)
    assert read_bytes() == again  # the same shard, unchanged: not read again
    for grad in (named[key].grad, want[key].grad):
        grad.clamp_(-1e-3, 1e-3)  # (rewritten, not noted: the kept copy is older now)
    named["transformer.h.1.mlp.c_fc.bias"].grad = torch.ones_like(want["transformer.h.1.mlp.c_fc.bias"])
    want["transformer.h.1.mlp.c_fc.bias"].grad = torch.ones_like(want["transformer.h.1.mlp.c_fc.bias"])
    for n, q in want.items():
        torch.testing.assert_close(named[n].grad.clone(), q.grad, rtol=0, atol=0, msg=n)
    # the other writers of a sum: the optimizer's clip by a factor that is no power of two
    # (settled into the sums by the next clip), and zero_grad(set_to_none=False)
    opt.clip_grad_norm_(0.3)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
    opt.clip_grad_norm_(0.1)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    for n, q in want.items():
        torch.testing.assert_close(named[n].grad.clone(), q.grad, msg=n)
    opt.zero_grad(set_to_none=False)
    ref_opt.zero_grad(set_to_none=False)
    for n, q in want.items():
        torch.testing.assert_close(named[n].grad.clone(), q.grad, rtol=0, atol=0, msg=n)
    close(model, opt)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_zero_element_parameter_as_torch_has_it(tmp_path, tier, offload_config, no_leaks):
    """p.grad of a 0-element parameter is an empty tensor after a backward, as torch's (it
    was None), and the model's load_state_dict of it (a 0-byte group written) no longer
    crashes the next forward."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.empty = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.zeros(0, 4))

        def forward(self, x):
            return self.lin(x).sum() + self.empty.sum()

    torch.manual_seed(0)
    ref = Model()
    model = offload.wrap(Model(), offload_config(tmp_path, param_tier=tier, optimizer_tier=tier, resident_bytes=0))
    model.load_state_dict(ref.state_dict())
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(2):
        x = torch.randn(2, 4)
        for m, o in ((model, opt), (ref, ref_opt)):
            assert m.empty.grad is None
            m(x).backward()
            assert m.empty.grad is not None and m.empty.grad.shape == (0, 4)
            o.step()
            o.zero_grad(set_to_none=step == 0)
        assert (model.empty.grad is None) == (ref.empty.grad is None)
        if step == 0:
            continue
        model.empty.grad = None
        ref.empty.grad = None
    got = offload.state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    close(model, opt)


def test_zero_grad_between_backward_and_step_drops(tmp_path, adamw_pair, lm_batches, assert_same_weights, no_leaks):
    """model.zero_grad() (p.grad = None) drops what backward accumulated, as in torch; one
    parameter's gradient set to None leaves it out of the step."""
    model, opt, ref, ref_opt = adamw_pair(tmp_path, "nvme")
    batches = lm_batches(211, steps=2, micro=1)
    for m in (model, ref):
        backward(m, batches[0][0])
        m.zero_grad()
        backward(m, batches[1][0])
        dict(m.named_parameters())["transformer.h.1.attn.c_attn.weight"].grad = None
    assert dict(model.named_parameters())["transformer.h.1.attn.c_attn.weight"].grad is None
    opt.step()
    ref_opt.step()
    assert_same_weights(model, ref)
    close(model, opt)


def test_grad_scaler_unscale_and_skip(tmp_path, tiny_gpt2, make_opt, offload_config, lm_batches, assert_same_weights,
                                      no_leaks):
    """torch.amp.GradScaler over the offload optimizer (loss_scale=None: the scaler scales):
    unscale_, clipping and the overflow skip as with torch's optimizer, bit for bit."""
    ref = tiny_gpt2()
    ref_opt = make_opt("adamw", ref.parameters(), offloaded=False)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, param_tier="host", optimizer_tier="host"))
    opt = make_opt("adamw", model.parameters(), offloaded=True, loss_scale=None)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    batches = lm_batches(211, steps=3, micro=1)
    unscaled = ([], [])  # p.grad after unscale_: the gradient itself, not 1024 times it
    for step, (ids,) in enumerate(batches):
        for m, o, scaler, seen in ((model, opt, scalers[0], unscaled[0]), (ref, ref_opt, scalers[1], unscaled[1])):
            loss = m(input_ids=ids, labels=ids).loss
            scaler.scale(loss * (math.inf if step == 1 else 1.0)).backward()  # step 1 overflows
            scaler.unscale_(o)
            seen.append(dict(m.named_parameters())["transformer.h.0.mlp.c_fc.weight"].grad.clone())
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    assert scalers[0].get_scale() == scalers[1].get_scale() == 512.0
    for got, want in zip(*unscaled):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert_same_weights(model, ref, rtol=0, atol=0)
    close(model, opt)


def test_refusals(tmp_path, adamw_pair, lm_batches, no_leaks):
    model, opt, ref, ref_opt = adamw_pair(tmp_path)
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    backward(model, ids)
    with pytest.raises(ValueError, match="already belongs to an open AdamW .* that holds its gradient"):
        offload.SGD(model.parameters(), lr=0.1)
    grad = next(model.parameters()).grad
    opt.step()
    opt.zero_grad()
    assert next(model.parameters()).grad is None
    with pytest.raises(RuntimeError, match="dropped"):
        grad.norm()
    opt.close()
    second = offload.SGD(model.parameters(), lr=0.1)  # the first closed: allowed
    second.close()
    offload.unwrap(model)


def test_an_optimizer_that_holds_no_gradient_gives_its_parameters_up(tmp_path, adamw_pair, lm_batches, caplog,
                                                                     assert_same_weights,
                                                                     no_leaks):
    """A Trainer built again over the same model, or an optimizer dropped without close()
    (the model's hooks keep it alive): a new optimizer takes the parameters, as in torch, and
    the old one is closed, its last step's update (owed to the next forward) applied first."""
    model, opt, ref, ref_opt = adamw_pair(tmp_path)
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    for m, o in ((model, opt), (ref, ref_opt)):
        backward(m, ids)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # (the update waits for the next forward)
        o.step()
        o.zero_grad()
    del opt
    gc.collect()
    with caplog.at_level(logging.WARNING, logger="offload"):
        second = offload.SGD(model.parameters(), lr=0.1)
    assert "held no gradient: closing it" in caplog.text
    assert_same_weights(model, ref, rtol=0, atol=0)  # (the first one's update was applied)
    ref_second = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((model, second), (ref, ref_second)):  # (the new optimizer sees the gradients, as torch's)
        backward(m, ids)
        o.step()
        o.zero_grad()
    assert_same_weights(model, ref, rtol=0, atol=0)
    second.close()
    offload.unwrap(model)


def test_grads_live_like_torchs(tmp_path, adamw_pair, lm_batches, assert_same_weights, no_leaks):
    """p.grad stays after step() and a backward without zero_grad adds to it (as torch's);
    a post-accumulate-grad hook reads it final during backward; p.grad.zero_() is a zero
    gradient that the step still takes (moments decay, weight decay applies)."""
    model, opt, ref, ref_opt = adamw_pair(tmp_path, "nvme")
    seen = {"offload": [], "torch": []}
    for m, key in ((model, "offload"), (ref, "torch")):
        dict(m.named_parameters())["transformer.h.1.mlp.c_proj.weight"].register_post_accumulate_grad_hook(
            lambda p, key=key: seen[key].append(float(p.grad.norm())))
    batches = lm_batches(211, steps=3, micro=1)
    for i, (ids,) in enumerate(batches):
        for m, o in ((model, opt), (ref, ref_opt)):
            backward(m, ids)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            if i == 1:
                dict(m.named_parameters())["transformer.h.0.attn.c_attn.weight"].grad.zero_()
            o.step()
            if i > 0:  # no zero_grad after the first step: the second backward adds
                o.zero_grad()
        if i == 0:  # and p.grad is still there after the step
            torch.testing.assert_close(next(model.parameters()).grad.norm(), next(ref.parameters()).grad.norm())
    torch.testing.assert_close(seen["offload"], seen["torch"], rtol=1e-5, atol=1e-6)  # (Python floats: fp32 tolerance)
    assert_same_weights(model, ref)
    close(model, opt)


def test_fp16_step_without_scale_loss_refused(tmp_path, tiny_gpt2, offload_config, lm_batches, no_leaks):
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, param_tier="host", optimizer_tier="host",
                                                     compute_dtype="fp16"))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    backward(model, ids)
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()
    opt.zero_grad()
    opt.scale_loss(model(input_ids=ids, labels=ids).loss).backward()
    opt.step()
    assert opt.stats["steps"] == 1
    close(model, opt)


def test_views_of_a_grad_refuse_writes(tmp_path, adamw_pair, lm_batches, no_leaks):
    model, opt, ref, ref_opt = adamw_pair(tmp_path)
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    backward(model, ids)
    backward(ref, ids)
    p, q = next(model.parameters()), next(ref.parameters())
    torch.testing.assert_close(p.grad.view(-1)[:5].sum(), q.grad.view(-1)[:5].sum())  # reads are fine
    with pytest.raises(RuntimeError, match="would be lost"):
        p.grad.view(-1)[:5].mul_(2)
    p.grad.data.mul_(0.5)  # .data is p.grad itself
    q.grad.data.mul_(0.5)
    torch.testing.assert_close(p.grad.clone(), q.grad)
    close(model, opt)


def test_checkpoint_load_and_zero_grad_keep_the_books(tmp_path, adamw_pair, lm_batches, no_leaks):
    """A checkpoint load drops held gradients with their noted factors (a clip noted before
    the load must not scale the next backward's); zero_grad(set_to_none=False) leaves zeros."""
    model, opt, ref, ref_opt = adamw_pair(tmp_path, "nvme")
    (a,), (b,) = lm_batches(211, steps=2, micro=1)
    backward(model, a)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    opt.step()
    offload.save_checkpoint(tmp_path / "ckpt", model, opt)
    backward(model, b)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # noted, then dropped by the load
    offload.load_checkpoint(tmp_path / "ckpt", model, opt)
    ref.load_state_dict(offload.state_dict(model))
    backward(model, b)
    backward(ref, b)
    named = dict(model.named_parameters())
    for n, q in ref.named_parameters():
        torch.testing.assert_close(named[n].grad.clone(), q.grad, msg=n)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.clone().any() for p in model.parameters())
    close(model, opt)


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("api", ["optimizer", "torch"])
def test_clipping_equals_torchs_bit_for_bit(tmp_path, tier, api, tiny_llama, make_opt, decay_groups, offload_config,
                                            lm_batches, assert_same_weights, no_leaks):
    """Clipping by opt.clip_grad_norm_ or torch's over the optimizer's parameters, a limit
    that clips on some steps only, two micro-batches, two param groups, a GradScaler: norms
    and weights are torch's to the bit (the factor multiplies the gradients as p.grad.mul_
    would, and the total is the norm of the parameters' fp32 norms, as torch sums it)."""
    ref, model = tiny_llama(), tiny_llama()
    ref_opt = make_opt("adamw", decay_groups(ref), False)
    offload.wrap(model, offload_config(tmp_path, param_tier=tier, optimizer_tier=tier))
    opt = make_opt("adamw", decay_groups(model), True, loss_scale=None, grad_tier=tier if tier == "nvme" else "auto")
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2)]
    limits = [0.5, 1e9, 0.5, 1e9]  # (1e9: a factor of exactly 1)
    for step, micro in enumerate(lm_batches(model.config.vocab_size, steps=len(limits))):
        norms = []
        for m, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            for ids in micro:
                scaler.scale(m(input_ids=ids, labels=ids).loss / len(micro)).backward()
            scaler.unscale_(o)
            params = [p for g in o.param_groups for p in g["params"]]
            if api == "optimizer" and o is opt:
                norms.append(opt.clip_grad_norm_(limits[step]))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(params, limits[step]))
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        torch.testing.assert_close(norms[0], norms[1], rtol=0, atol=0)
        assert (float(norms[1]) > limits[step]) == (step % 2 == 0)
    assert_same_weights(model, ref, rtol=0, atol=0)
    close(model, opt)


@pytest.mark.parametrize("tier,api", [("host", "torch"), ("nvme", "torch"), ("nvme", "optimizer")])
def test_divisions_and_several_scalings_of_p_grad_round_as_torchs(tmp_path, tier, api, tiny_llama, make_opt,
                                                                 offload_config, lm_batches, assert_same_weights,
                                                                 no_leaks):
    """Hand-written loops scale ``p.grad`` themselves: ``p.grad /= micro`` to average an
    accumulation, ``div_(3)``, a factor then torch's clip, the clip then a factor, two
    factors. Dividing by 3 is not multiplying by 1/3 in the last bit, and two factors
    applied in turn round twice: these used to be noted as one multiplication inside the
    step and parted from torch's weights by up to 6e-5. Now losses, norms and weights are
    torch's to the bit on every step."""
    def div3(params, clip):
        for p in params:
            p.grad.div_(3)

    def average_then_clip(params, clip):
        for p in params:
            p.grad /= 3
        return clip(params, 0.5)

    def factor_then_clip(params, clip):
        for p in params:
            p.grad.mul_(0.7)
        return clip(params, 0.5)

    def clip_then_factor(params, clip):  # (and p.grad's norms under the clip's factor, as a log reads them)
        norms = [float(clip(params, 0.5))] + [float(p.grad.norm()) for p in params]
        for p in params:
            p.grad.mul_(0.3)
        return norms

    def two_factors_and_a_power_of_two(params, clip):
        for p in params:
            p.grad.mul_(0.7).mul_(0.25)
            p.grad.mul_(0.3)

    def factor_then_max_norm_clip(params, clip):
        for p in params:
            p.grad.mul_(0.7)
        return clip(params, 0.01, norm_type=math.inf)

    ref, model = tiny_llama(), tiny_llama()
    ref_opt = make_opt("adamw", ref.parameters(), False)
    offload.wrap(model, offload_config(tmp_path, param_tier=tier, optimizer_tier=tier))
    opt = make_opt("adamw", model.parameters(), True, grad_tier=tier if tier == "nvme" else "auto")
    edits = [div3, average_then_clip, factor_then_clip, clip_then_factor, two_factors_and_a_power_of_two,
             factor_then_max_norm_clip]

    def opt_clip(params, max_norm, norm_type=2.0):  # (the optimizer's own, over the same parameters)
        return opt.clip_grad_norm_(max_norm, norm_type)

    for edit, micro in zip(edits, lm_batches(model.config.vocab_size, steps=len(edits))):
        got = []
        for m, o in ((model, opt), (ref, ref_opt)):
            losses = [m(input_ids=ids, labels=ids).loss for ids in micro]
            for loss in losses:
                loss.backward()
            params = [p for g in o.param_groups for p in g["params"]]
            norm = edit(params, opt_clip if api == "optimizer" and o is opt else torch.nn.utils.clip_grad_norm_)
            o.step()
            o.zero_grad()
            got.append([float(loss) for loss in losses] + ([] if norm is None else norm if isinstance(norm, list)
                                                            else [float(norm)]))
        assert got[0] == got[1], edit.__name__
    assert_same_weights(model, ref, rtol=0, atol=0)
    close(model, opt)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("micro", [1, 2])
def test_split_parameters_clip_as_torch(tmp_path, micro, set_to_none, tiny_llama, make_opt, offload_config, lm_batches,
                                        assert_same_weights, no_leaks):
    """Shards small enough that most parameters straddle two or more: with one backward per
    step each split parameter's norm is taken over its whole gradient, so the clip is
    torch's to the bit (under a GradScaler too), also where zero_grad(set_to_none=False)
    left zeros for the gradient to add to (it was not: summed from the pieces); with two
    backwards (the sum exists only in pieces) it is summed from the pieces, a few units in
    the last place off."""
    ref, model = tiny_llama(), tiny_llama()
    ref_opt = make_opt("adamw", ref.parameters(), False)
    offload.wrap(model, offload_config(tmp_path, param_tier="nvme", optimizer_tier="nvme"))
    opt = make_opt("adamw", model.parameters(), True, shard_size=3000)
    assert sum(len(e.segments) > 1 for e in opt._book.entries.values()) >= 5
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2)]
    for step, batches in enumerate(lm_batches(model.config.vocab_size, steps=4, micro=micro)):
        norms = []
        for m, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            for ids in batches:
                scaler.scale(m(input_ids=ids, labels=ids).loss / micro).backward()
            scaler.unscale_(o)
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5 if step % 2 == 0 else 1e9))
            scaler.step(o)
            scaler.update()
            o.zero_grad(set_to_none=set_to_none)
        exact = dict(rtol=0, atol=0) if micro == 1 else {}
        torch.testing.assert_close(norms[0], norms[1], **exact)
    assert_same_weights(model, ref, **exact)
    close(model, opt)


class _Skips(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))

    def forward(self, x, use_b=True):
        h = self.a(x)
        return self.c(self.b(h) if use_b else h).square().mean()


def test_a_clipped_split_sum_kept_through_a_backward_that_skips_it(no_leaks):
    """A split parameter's sum, clipped, then kept through a backward in which it gets no
    gradient (the others reopen its shards, which applies the factor to it): its norm is
    the clipped gradient's, as torch's."""
    torch.manual_seed(0)
    ref, model = _Skips(), _Skips()
    model.load_state_dict(ref.state_dict())
    offload.wrap(model, offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host",
                                              device_budget="2MiB", host_budget="64MiB", resident_bytes=0))
    opt = offload.AdamW(model.parameters(), lr=1e-3, shard_size=1500)
    assert len(opt._book.entries[id(model.b.weight)].segments) > 1
    x = torch.randn(4, 32)
    for m in (model, ref):
        m(x).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
        m(x, use_b=False).backward()
    torch.testing.assert_close(torch.linalg.vector_norm(model.b.weight.grad), ref.b.weight.grad.norm())
    opt.close()
    offload.unwrap(model)


def test_loss_scaled_fp16_norms_stay_finite(no_leaks):
    """Plain fp16 parameters under offload's own loss scaling: each loss-scaled gradient's
    norm is beyond fp16's range, yet the total is the true one (taken in fp32), not an inf
    that would clip every gradient to zero."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256)).half()
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    opt.scale_loss(30 * model(torch.randn(64, 256).half()).float().pow(2).mean()).backward()
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in model.parameters()]
    assert max(norms) > torch.finfo(torch.float16).max  # (in fp16 they would be inf)
    want = torch.linalg.vector_norm(torch.stack(norms)) / opt.loss_scale
    torch.testing.assert_close(opt.clip_grad_norm_(1.0), want)
    opt.close()


def test_a_post_accumulate_hook_registered_before_the_optimizer_is_refused_when_sums_accumulate(
        tmp_path, tiny_gpt2, offload_config, lm_batches, no_leaks):
    """A hook registered before the optimizer runs ahead of the optimizer's own, on the
    backward's gradient alone; with accumulation torch's p.grad there is the step's sum
    (a trial's hook saw values up to 0.055 apart). Refused at the backward that would
    differ, before its gradient is added; a single backward per step is as torch's."""
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    seen = []
    dict(model.named_parameters())["transformer.h.1.mlp.c_proj.weight"].register_post_accumulate_grad_hook(
        lambda p: seen.append(float(p.grad.norm())))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    try:
        (first, second), = lm_batches(211, steps=1, micro=2)
        backward(model, first)
        opt.step()
        opt.zero_grad()
        backward(model, first)
        with pytest.raises(RuntimeError, match="registered before the offload optimizer.*sum of the step's"):
            backward(model, second)
        assert len(seen) == 3  # (the hook ran; nothing of the refused backward was added)
    finally:
        close(model, opt)
