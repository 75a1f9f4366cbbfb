"""bf16 master weights (``master="bf16"``, ``offload.optim._formats``): stochastic rounding
unbiased per element, one update against Adam's formulas, updates below bf16's resolution
kept, refusals, and a bit-for-bit resume."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.optim import BLOCK

from .test_formats import BETAS, EPS, LR, WD, _train


def test_stochastic_rounding_is_unbiased_and_between_neighbours():
    """Each element, rounded with many seeds, lands on its two bf16 neighbours in the
    proportion of its position between them; values bf16 holds stay as they are."""
    from offload.optim._formats import Packing, RowCode

    n, seeds = 512, 400
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.nextafter(lo, torch.tensor(2.0, dtype=torch.bfloat16))
    where = torch.rand(n, generator=torch.Generator().manual_seed(4))
    x = float(lo) + where * (float(hi) - float(lo))
    packing = Packing((RowCode.BF16_SR,), n)
    ups = torch.zeros(n)
    for seed in range(seeds):
        got = x.clone().view(1, n)
        packing.round_in_place(got, [(0, n, seed * 7919)])
        assert bool(((got == float(lo)) | (got == float(hi))).all())
        ups += (got[0] == float(hi)).float()
    # binomial(400, p): 5 standard deviations at p = 0.5 is 0.125
    assert float((ups / seeds - where).abs().max()) < 0.125
    exact = torch.tensor([[1.5, -2.25, 0.0, -0.0] * (n // 4)])
    got = exact.clone()
    packing.round_in_place(got, [(0, n, 3)])
    assert torch.equal(got, exact)


def test_bf16_master_keeps_updates_below_its_resolution():
    """SGD steps of a tenth of bf16's resolution: rounded stochastically, each weight moves
    about a tenth of a resolution step per step (rounded to nearest it would never move),
    also when the first parameter of the shard gets no gradient (the dither must still
    change every step)."""
    frozen = torch.nn.Parameter(torch.zeros(BLOCK, dtype=torch.bfloat16))
    p = torch.nn.Parameter(torch.full((4 * BLOCK,), 1.5, dtype=torch.bfloat16))
    opt = offload.SGD([frozen, p], lr=1.0, master="bf16")
    ulp = 2.0 ** -7  # bf16's resolution in [1, 2)
    for _ in range(100):
        p.grad = torch.full_like(p, 0.1 * ulp)
        opt.step()
        opt.zero_grad()
    moved = (1.5 - p.detach().double()) / ulp
    # binomial(100, 0.1) per element: 10 on average, within 2 and 25 but for a few
    assert abs(float(moved.mean()) - 10) < 1.0
    assert float(((moved >= 2) & (moved <= 25)).float().mean()) > 0.98
    assert torch.equal(frozen.detach(), torch.zeros_like(frozen))


def test_bf16_master_update_equals_formula():
    n = 4 * BLOCK
    g = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter((torch.randn(n, generator=g)).bfloat16())
    opt = offload.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master="bf16")
    assert opt.master == "bf16"
    master0 = p.detach().double()
    grad = (torch.randn(n, generator=g) * 1e-2).bfloat16()
    p.grad = grad.clone()
    opt.step()
    b1, b2 = BETAS
    gd = grad.double()
    m1, v1 = (1 - b1) * gd, (1 - b2) * gd * gd
    want = master0 * (1 - LR * WD) - LR * (m1 / (1 - b1)) / ((v1 / (1 - b2)).sqrt() + EPS)
    got = opt.state_dict()["state"][0]["master_param"].double()
    nearest = want.float().bfloat16().double()  # one bf16 neighbour of Adam's value, then the other
    other = torch.where(nearest > want, nearest - _bf16_ulp(nearest), nearest + _bf16_ulp(nearest))
    lower, upper = torch.minimum(nearest, other), torch.maximum(nearest, other)
    slack = 1e-6 * want.abs()  # (the kernel computes in fp32)
    assert bool(((got >= lower - slack) & (got <= upper + slack)).all())
    assert bool((got == lower).any()) and bool((got == upper).any())  # (rounded both ways)
    assert torch.equal(p.detach().double(), got)  # the bf16 weight is the master


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 8)


def test_bf16_master_refuses_other_dtypes_and_resumes_bit_for_bit(tmp_path, tiny_gpt2, lm_batches, offload_config):
    with pytest.raises(ValueError, match="master='bf16'"):
        offload.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))], master="bf16")
    with pytest.raises(ValueError, match="master='bf16'"):
        offload.plan(tiny_gpt2(), offload_config(tmp_path / "p", compute_dtype="fp16"), master="bf16")
    batches = lm_batches(211, steps=4)
    runs = []
    for name, shard_size in (("b", None), ("c", 3000)):  # (the resume cuts shards elsewhere: the same dither)
        model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / name, compute_dtype="bf16"))
        opt = offload.AdamW(model.parameters(), lr=LR, master="bf16", moments="int8", shard_size=shard_size)
        runs.append((model, opt))
    try:
        (model, opt), (again, again_opt) = runs
        assert all(s.master_bytes == 2 * s.numel for s in opt._book.shards if s.master)
        _train(model, opt, batches[:2])
        offload.save_checkpoint(tmp_path / "ckpt", model, opt)
        _train(model, opt, batches[2:])
        offload.load_checkpoint(tmp_path / "ckpt", again, again_opt)
        _train(again, again_opt, batches[2:])
        for a, b in zip(model.parameters(), again.parameters()):
            assert torch.equal(a.detach(), b.detach())
        assert len(again_opt._book.shards) != len(opt._book.shards)
        want, got = opt.state_dict()["state"], again_opt.state_dict()["state"]
        assert all(torch.equal(got[i][k], v) for i in want for k, v in want[i].items())
    finally:
        for model, opt in runs:
            offload.close(model)
            opt.close()
