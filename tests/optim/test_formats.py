"""Moments kept in bf16 or 8-bit codes (``moments=``, ``offload.optim._formats``): the codes
against the 8-bit Adam paper's formulas written out here, one update against Adam's formulas
on the same coded inputs, training against torch with the same coding applied to its states,
and state dicts and checkpoints that resume bit for bit or convert."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

import offload
from offload.optim import BLOCK
from offload.optim._formats import Packing, RowCode

BETAS, EPS, LR, WD = (0.9, 0.999), 1e-8, 1e-2, 0.1


# -- the reference: the paper's block-wise scheme, written from its formulas ------------------
def ref_code(x: np.ndarray, unsigned: bool) -> tuple[np.ndarray, np.ndarray]:
    """Codes and block scales of ``x`` (float64): per block of BLOCK elements, the absolute
    maximum over the top code rounded up to a power of two; codes rounded to nearest even;
    the unsigned code is linear in the square root and never zero."""
    top = 255.0 if unsigned else 127.0
    blocks = (np.sqrt(x) if unsigned else x).reshape(-1, BLOCK)
    codes, scales = np.zeros(blocks.shape), np.zeros(len(blocks))
    for i, block in enumerate(blocks):
        peak = np.abs(block).max()
        if peak == 0:
            codes[i] = 1 if unsigned else 0
            continue
        scales[i] = 2.0 ** max(math.ceil(math.log2(peak / top)), -60)
        codes[i] = np.rint(block / scales[i])
        if unsigned:
            codes[i] = np.maximum(codes[i], 1)
    return codes.reshape(-1), scales


def ref_decode(codes: np.ndarray, scales: np.ndarray, unsigned: bool) -> np.ndarray:
    values = (codes.reshape(-1, BLOCK) * scales[:, None]).reshape(-1)
    return values * values if unsigned else values


def moments(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A first and second moment with a spread of magnitudes across blocks, a zero block and
    a few zeros inside others."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-9, -1, n // BLOCK).repeat_interleave(BLOCK)
    m = torch.randn(n, generator=g) * spread
    v = torch.rand(n, generator=g) * spread * spread
    m[:BLOCK] = 0
    v[:BLOCK] = 0
    v[BLOCK + 7] = 0
    return m, v


@pytest.mark.parametrize("code", [RowCode.SIGNED8, RowCode.SQRT8, RowCode.BF16])
def test_codes_equal_the_formulas_and_round_trip(code):
    n = 16 * BLOCK
    m, v = moments(n, 0)
    x = v if code is RowCode.SQRT8 else m
    packing = Packing((code,), n)
    packed = torch.empty(packing.nbytes, dtype=torch.uint8)
    packing.encode(x.clone().view(1, n), packed)
    decoded = torch.empty(1, n)
    packing.decode(packed, decoded)
    if code is RowCode.BF16:
        assert torch.equal(decoded[0], x.bfloat16().float())
    else:
        unsigned = code is RowCode.SQRT8
        codes, scales = ref_code(x.double().numpy(), unsigned)
        stored = packed[:n].view(torch.uint8 if unsigned else torch.int8)
        assert np.array_equal(stored.numpy().astype(np.float64), codes)
        assert np.array_equal(packed[n:].view(torch.float32).double().numpy(), scales)
        assert np.array_equal(decoded[0].double().numpy(), ref_decode(codes, scales, unsigned))
    again = torch.empty_like(packed)
    packing.encode(decoded.clone(), again)  # decoded values code back to the same bytes
    assert torch.equal(again, packed)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_one_update_equals_adam_formulas_on_coded_inputs(fmt):
    """One AdamW step of the optimizer from coded moments: its new weights and moments equal
    Adam's formulas (float64) applied to the same decoded inputs, then coded as above."""
    n = 16 * BLOCK
    m, v = moments(n, 1)
    p = torch.nn.Parameter(torch.randn(n))
    opt = offload.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, moments=fmt)
    sd = opt.state_dict()
    sd["state"] = {0: {"step": torch.tensor(4.0), "exp_avg": m, "exp_avg_sq": v}}
    opt.load_state_dict(sd)
    coded = opt.state_dict()["state"][0]  # the coded inputs, decoded
    m0, v0 = coded["exp_avg"].double(), coded["exp_avg_sq"].double()
    p0 = p.detach().clone().double()
    g = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-3
    p.grad = g.clone()
    opt.step()

    b1, b2 = BETAS
    m1 = b1 * m0 + (1 - b1) * g.double()
    v1 = b2 * v0 + (1 - b2) * g.double() ** 2
    step = 5
    want = p0 * (1 - LR * WD) - LR * (m1 / (1 - b1 ** step)) / ((v1 / (1 - b2 ** step)).sqrt() + EPS)
    torch.testing.assert_close(p.detach().double(), want, rtol=2e-6, atol=1e-9)
    got = opt.state_dict()["state"][0]
    for name, exact, unsigned in (("exp_avg", m1, False), ("exp_avg_sq", v1, True)):
        if fmt == "bf16":
            torch.testing.assert_close(got[name], exact.float().bfloat16().float(), rtol=0, atol=0)
            continue
        codes, scales = ref_code(exact.numpy(), unsigned)
        want_codes = torch.from_numpy(codes)
        mine, mine_scales = ref_code(got[name].double().numpy(), unsigned)  # (exact: decoded codes code back)
        assert np.array_equal(mine_scales, scales)
        flips = (torch.from_numpy(mine) - want_codes).abs()
        # the kernel computes in fp32: a value within its rounding of a half-code may round the other way
        assert flips.max() <= 1 and int((flips > 0).sum()) <= n // 500, f"{name}: {int((flips > 0).sum())} codes differ"


ADAM_ROWS = {"exp_avg": False, "exp_avg_sq": True}  # a state row's name: whether its code is unsigned


def fake_coded(opt: torch.optim.Optimizer, fmt: str, rows: dict[str, bool] = ADAM_ROWS) -> None:
    """Code and decode a torch optimizer's state ``rows`` as ``moments=fmt`` keeps them
    (blocks from each parameter's first element, as in an offload shard)."""
    for state in opt.state.values():
        for name, unsigned in rows.items():
            flat = state[name].reshape(-1)
            if fmt == "bf16":
                flat.copy_(flat.bfloat16().float())
                continue
            padded = np.zeros(-(-flat.numel() // BLOCK) * BLOCK)
            padded[: flat.numel()] = flat.double().numpy()
            codes, scales = ref_code(padded, unsigned)
            flat.copy_(torch.from_numpy(ref_decode(codes, scales, unsigned)[: flat.numel()]).float())


@pytest.mark.parametrize("fmt,tiers", [("int8", ("nvme", "nvme")), ("bf16", ("nvme", "host")),
                                       ("int8", ("host", "host"))])
def test_training_equals_torch_with_the_same_coding(tmp_path, fmt, tiers, tiny_gpt2, lm_batches, offload_config,
                                                    assert_losses, assert_same_weights, no_leaks):
    """Tiny GPT-2 wrapped, 4 steps with accumulation and clipping: losses and weights equal
    torch's AdamW whose moments are coded and decoded the same way after each step."""
    batches = lm_batches(211, steps=4)
    ref = tiny_gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, param_tier=tiers[0], optimizer_tier=tiers[1]))
    opt = offload.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, moments=fmt)
    try:
        losses = {"ref": [], "ours": []}
        for micro in batches:
            for net, o, key in ((ref, ref_opt, "ref"), (model, opt, "ours")):
                total = 0.0
                for ids in micro:
                    loss = net(input_ids=ids, labels=ids).loss / len(micro)
                    loss.backward()
                    total += float(loss.detach())
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                o.step()
                o.zero_grad()
                losses[key].append(total)
            fake_coded(ref_opt, fmt)
        assert_losses(losses["ours"], losses["ref"])
        assert_same_weights(model, ref)
    finally:
        offload.close(model)
        opt.close()


def _stored(opt) -> list[torch.Tensor]:
    opt.synchronize()
    return [s.store.read_copy(s.state_key) for s in opt._book.shards if s.rows]


def _train(model, opt, batches):
    for micro in batches:
        for ids in micro:
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_checkpoint_and_state_dict_resume_bit_for_bit(tmp_path, fmt, tiny_gpt2, lm_batches, offload_config, no_leaks):
    batches = lm_batches(211, steps=4)
    cfg = offload_config(tmp_path / "a")
    model = offload.wrap(tiny_gpt2(), cfg)
    opt = offload.AdamW(model.parameters(), lr=LR, moments=fmt)
    other = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "b"))
    other_opt = offload.AdamW(other.parameters(), lr=LR, moments=fmt, shard_size=3000)  # cut differently
    again = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "c"))
    again_opt = offload.AdamW(again.parameters(), lr=LR, moments=fmt)
    try:
        _train(model, opt, batches[:2])
        offload.save_checkpoint(tmp_path / "ckpt", model, opt)
        sd = opt.state_dict()
        assert sd["moments"] == fmt
        saved = _stored(opt)
        assert all(s.dtype == torch.uint8 for s in saved)
        _train(model, opt, batches[2:])

        offload.load_checkpoint(tmp_path / "ckpt", again, again_opt)
        assert all(torch.equal(a, b) for a, b in zip(_stored(again_opt), saved))
        _train(again, again_opt, batches[2:])
        for a, b in zip(model.parameters(), again.parameters()):
            assert torch.equal(a.detach(), b.detach())
        assert all(torch.equal(a, b) for a, b in zip(_stored(again_opt), _stored(opt)))

        # into an optimizer cut in other shards (parameters split elsewhere), from the checkpoint
        # and from torch's format: the decoded states equal (blocks count from each parameter's start)
        offload.load_checkpoint(tmp_path / "ckpt", other, other_opt)
        assert len(other_opt._book.shards) > len(opt._book.shards)
        for loaded in (other_opt.state_dict()["state"], None):
            if loaded is None:
                other_opt.load_state_dict(sd)
                loaded = other_opt.state_dict()["state"]
            for i, entry in sd["state"].items():
                for name in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(loaded[i][name], entry[name]), f"{i} {name}"
    finally:
        for m in (model, other, again):
            offload.close(m)
        for o in (opt, other_opt, again_opt):
            o.close()


def test_loading_another_format_converts_and_says_so(tmp_path, tiny_gpt2, lm_batches, offload_config, caplog):
    batches = lm_batches(211, steps=2)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "a"))
    opt = offload.AdamW(model.parameters(), lr=LR)
    target = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "b"))
    target_opt = offload.AdamW(target.parameters(), lr=LR, moments="int8")
    try:
        _train(model, opt, batches)
        offload.save_checkpoint(tmp_path / "ckpt", model, opt)
        with caplog.at_level(logging.INFO):
            offload.load_checkpoint(tmp_path / "ckpt", target, target_opt)
        assert any("kept as fp32" in r.getMessage() and "converted" in r.getMessage() for r in caplog.records)
        want = opt.state_dict()["state"]
        got = target_opt.state_dict()["state"]
        for i, entry in want.items():
            for name, unsigned in ADAM_ROWS.items():  # the codes of the fp32 rows (decoded codes code back)
                pad = lambda t: np.pad(t.reshape(-1).double().numpy(), (0, -t.numel() % BLOCK))  # noqa: E731
                codes, scales = ref_code(pad(entry[name]), unsigned)
                mine, mine_scales = ref_code(pad(got[i][name]), unsigned)
                assert np.array_equal(mine_scales, scales), f"{i} {name}"
                flips = mine != codes
                if not unsigned:
                    assert not flips.any(), f"{i} {name}"
                    continue
                # the second moment's code is its root's: torch's fp32 root may be an ulp off float64's,
                # so a root within that of a half-code may round the other way (on an AMD EPYC: 1 of 16,384)
                at = np.sqrt(pad(entry[name])) / np.repeat(np.where(scales > 0, scales, 1.0), BLOCK)
                assert np.abs(mine - codes).max() <= 1, f"{i} {name}"
                assert np.all(np.abs(at[flips] % 1 - 0.5) < 1e-4), f"{i} {name}: a flip away from a half-code"
        caplog.clear()
        with caplog.at_level(logging.INFO):
            target_opt.load_state_dict(opt.state_dict())
        assert any("converted" in r.getMessage() for r in caplog.records)
    finally:
        for m in (model, target):
            offload.close(m)
        for o in (opt, target_opt):
            o.close()


def test_plan_and_refusals(tmp_path, tiny_gpt2, offload_config):
    model = tiny_gpt2()
    cfg = offload_config(tmp_path)
    rows = {fmt: next(r for r in offload.plan(model, cfg, moments=fmt).rows if r.item.startswith("optimizer: exp_avg"))
            for fmt in ("fp32", "bf16", "int8")}
    params = sum(p.numel() for p in model.parameters())
    assert rows["fp32"].nbytes >= 8 * params
    assert rows["bf16"].nbytes < 0.52 * rows["fp32"].nbytes
    assert rows["int8"].nbytes < 0.27 * rows["fp32"].nbytes
    assert "8-bit codes" in rows["int8"].note
    with pytest.raises(ValueError, match="moments='fp8'"):
        offload.AdamW([torch.nn.Parameter(torch.zeros(3))], moments="fp8")


def test_bytes_moved_by_kind(tmp_path, tiny_gpt2, lm_batches, offload_config):
    """The optimizer's stats and the step log count what it moved per step by kind: coded
    moments move about a quarter (int8) of fp32's bytes, the other kinds the same."""
    batches = lm_batches(211, steps=3)
    moved = {}
    for fmt in ("fp32", "int8"):
        log_path = tmp_path / f"{fmt}.jsonl"
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / fmt, log_path=str(log_path)))
        opt = offload.AdamW(model.parameters(), lr=LR, moments=fmt, update_in_next_forward=False)
        try:
            _train(model, opt, batches)
            opt.synchronize()
            moved[fmt] = dict(opt.stats)
        finally:
            offload.close(model)
            opt.close()
        records = [json.loads(line) for line in log_path.read_text().splitlines()]
        last = records[-1]["optimizer_bytes_per_param"]
        assert set(last) == {"parameters", "master", "moments", "gradients"}
        assert last["moments"] > 0 and last["master"] == 0  # (an fp32 model: no master rows)
    fp32, int8 = moved["fp32"], moved["int8"]
    assert fp32["moments_read_bytes"] == fp32["moments_write_bytes"] > 0
    ratio = int8["moments_write_bytes"] / fp32["moments_write_bytes"]
    assert 0.24 < ratio < 0.28, ratio
    for kind in ("parameters", "gradients"):
        assert int8[f"{kind}_read_bytes"] == fp32[f"{kind}_read_bytes"]
        assert int8[f"{kind}_write_bytes"] == fp32[f"{kind}_write_bytes"]


@pytest.mark.parametrize("kind", ["adamw_amsgrad", "sgd_momentum"])
def test_plain_parameters_with_amsgrad_and_momentum(kind):
    """Parameters of no wrapped model, states in host memory: int8 AdamW with amsgrad (its
    max row unsigned) and SGD with momentum (signed) against torch's with the same coding."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 7))
    ours = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 7))
    ours.load_state_dict(ref.state_dict())
    if kind == "adamw_amsgrad":
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, amsgrad=True, fused=True)
        opt = offload.AdamW(ours.parameters(), lr=LR, amsgrad=True, moments="int8")
        rows = {"exp_avg": False, "exp_avg_sq": True, "max_exp_avg_sq": True}
    else:
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        opt = offload.SGD(ours.parameters(), lr=0.1, momentum=0.9, moments="int8")
        rows = {"momentum_buffer": False}
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(16, 40, generator=g)
        for net, o in ((ref, ref_opt), (ours, opt)):
            net(x).square().mean().backward()
            o.step()
            o.zero_grad()
        fake_coded(ref_opt, "int8", rows)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    opt.close()


def test_update_during_backward_with_int8(tmp_path, tiny_gpt2, lm_batches, offload_config, assert_same_weights):
    """The update during backward decodes and codes the shards as step() does."""
    batches = lm_batches(211, steps=3, micro=1)
    ref = tiny_gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, moments="int8")
    try:
        for (ids,) in batches:
            ref(input_ids=ids, labels=ids).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            fake_coded(ref_opt, "int8")
            loss = model(input_ids=ids, labels=ids).loss
            with opt.update_during_backward():
                loss.backward()
            opt.step()
            opt.zero_grad()
        assert_same_weights(model, ref)
    finally:
        offload.close(model)
        opt.close()
