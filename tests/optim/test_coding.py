"""The 8-bit coding's compiled loop (``offload.optim._coding``): the codes and scales it
writes equal the paper's formulas exactly (ties, scales at exact powers of two, the
smallest scale, subnormals included) and the eager path's, a row with an inf or NaN moment
is coded as the eager path codes it, and a failure to compile falls back to eager with a
warning that names the cause and the fix."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch

from offload.optim import BLOCK
from offload.optim import _coding
from offload.optim._formats import Packing, RowCode

from .test_formats import moments, ref_code

HAVE_COMPILER = any(shutil.which(c) for c in ("g++", "gcc", "clang++", "c++"))


def coded(code: RowCode, x: torch.Tensor, eager: bool = False) -> tuple[np.ndarray, np.ndarray]:
    n = x.numel()
    packing = Packing((code,), n)
    packed = torch.empty(packing.nbytes, dtype=torch.uint8)
    if eager:
        with _coding.eager_coding():
            packing.encode(x.clone().view(1, n), packed)
    else:
        packing.encode(x.clone().view(1, n), packed)
    values = packed[:n].view(torch.uint8 if code is RowCode.SQRT8 else torch.int8)
    return values.numpy().astype(np.float64), packed[n:].view(torch.float32).double().numpy()


def with_ties(n: int, unsigned: bool) -> torch.Tensor:
    """Moments with every tenth element exactly half way between two codes of its block (for
    the unsigned code: its root half way, the square exact in fp32)."""
    m, v = moments(n, 3)
    x = v if unsigned else m
    _, scales = ref_code(x.double().numpy(), unsigned)
    half = torch.arange(n) % 10 == 3
    k = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(4)).double() + 0.5
    root = k * torch.from_numpy(scales).repeat_interleave(BLOCK)
    tied = (root * root if unsigned else root * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)).float()
    x = torch.where(half & (root > 0), tied, x)
    top = 255.0 if unsigned else 127.0
    specials = [top * 2.0 ** -20, top * 2.0 ** -70, 1e-40, 3e4]  # a peak exactly a power of two times top;
    for i, peak in enumerate(specials):  # below the smallest scale; subnormal; large
        block = x[(2 + i) * BLOCK: (3 + i) * BLOCK]
        block.copy_(torch.linspace(0, 1, BLOCK) * peak)
        if unsigned:
            block.mul_(block.clone())  # (the root's peak is then the one above)
    return x


@pytest.mark.parametrize("code", [RowCode.SIGNED8, RowCode.SQRT8])
def test_compiled_codes_equal_the_formulas_ties_included(code):
    if not HAVE_COMPILER:
        pytest.skip("no C++ compiler: the loops cannot be compiled here")
    unsigned = code is RowCode.SQRT8
    n = 64 * BLOCK
    x = with_ties(n, unsigned)
    codes, scales = coded(code, x)
    assert _coding._KERNELS.state is _coding._State.COMPILED, "a compiler is here but the loop did not compile"
    want_codes, want_scales = ref_code(x.double().numpy(), unsigned)
    assert np.array_equal(scales, want_scales)
    assert np.array_equal(codes, want_codes)
    scale = np.repeat(want_scales, BLOCK)
    scaled = (np.sqrt(x.double().numpy()) if unsigned else x.double().numpy())[scale > 0] / scale[scale > 0]
    assert (np.abs(np.modf(scaled)[0]) == 0.5).sum() >= n // 20  # the ties are there
    eager_codes, eager_scales = coded(code, x, eager=True)
    assert np.array_equal(eager_scales, scales)
    flips = np.abs(eager_codes - codes)
    if unsigned:  # eager torch.sqrt may be an ulp off the root: a code exactly at a tie may move by one
        assert flips.max() <= 1 and (flips > 0).sum() <= n // 1000
    else:
        assert np.array_equal(eager_codes, codes)


def test_a_failure_to_compile_codes_eagerly_and_says_why(monkeypatch, caplog):
    kernels = _coding._Kernels()
    kernels.state = _coding._State.UNTRIED
    monkeypatch.setattr(_coding, "_KERNELS", kernels)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Compiler: cc is not found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    m, _ = moments(8 * BLOCK, 5)
    with caplog.at_level(logging.WARNING, logger="offload.optim._coding"):
        codes, scales = coded(RowCode.SIGNED8, m)
        again = coded(RowCode.SIGNED8, m)
    assert kernels.state is _coding._State.EAGER
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # said once, not per row
    assert "cc is not found" in warnings[0] and "C++ compiler" in warnings[0]
    want_codes, want_scales = ref_code(m.double().numpy(), False)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    assert np.array_equal(again[0], codes)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("OFFLOAD_COMPILE_CODES", "0")
    assert _coding._Kernels().state is _coding._State.EAGER


@pytest.mark.parametrize("code", [RowCode.SIGNED8, RowCode.SQRT8])
def test_a_row_with_inf_or_nan_codes_as_eagerly(code):
    n = 8 * BLOCK
    m, v = moments(n, 6)
    x = v if code is RowCode.SQRT8 else m
    x[BLOCK + 3], x[3 * BLOCK] = float("inf"), float("nan")
    got = coded(code, x)
    want = coded(code, x, eager=True)
    assert np.isnan(got[1][[1, 3]]).all() and np.isfinite(np.delete(got[1], [1, 3])).all()
    assert np.array_equal(got[1], want[1], equal_nan=True)
    keep = np.repeat(np.isfinite(want[1]), BLOCK)
    assert np.array_equal(got[0][keep], want[0][keep])
