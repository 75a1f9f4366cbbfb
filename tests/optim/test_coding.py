"""The 8-bit coding's compiled loop (``offload.optim._coding``): the codes and scales it
writes equal the paper's formulas exactly (ties, scales at exact powers of two, the
smallest scale, subnormals included) and the eager path's, a row with an inf or NaN moment
is coded as the eager path codes it, and a failure to compile falls back to eager with a
warning that names the cause and the fix; the eager path gives the loop's bytes."""

from __future__ import annotations

import logging
import shutil
import threading

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

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


def with_ties(n: int, unsigned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments with every tenth element exactly half way between two codes of its block (for
    the unsigned code: its root half way, the square exact in fp32), and blocks of special
    peaks; and where the ties are."""
    m, v = moments(n, 3)
    x = v if unsigned else m
    _, scales = ref_code(x.double().numpy(), unsigned)
    k = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(4)).double() + 0.5
    root = k * torch.from_numpy(scales).repeat_interleave(BLOCK)
    tie = (torch.arange(n) % 10 == 3) & (root > 0)
    tied = (root * root if unsigned else root * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)).float()
    x = torch.where(tie, tied, x)
    top = 255.0 if unsigned else 127.0
    # a peak exactly a power of two times the top code; one below the smallest scale; a large one
    for i, peak in enumerate([top * 2.0 ** -20, top * 2.0 ** -70, 3e4]):
        block = x[(2 + i) * BLOCK: (3 + i) * BLOCK]
        block.copy_(torch.linspace(0, 1, BLOCK) * peak)
        if unsigned:
            block.mul_(block.clone())  # (the root's peak is then the one above)
        tie[(2 + i) * BLOCK: (3 + i) * BLOCK] = False
    x[5 * BLOCK: 6 * BLOCK] = torch.linspace(0, 1, BLOCK) * 1e-39  # subnormal moments
    tie[5 * BLOCK: 6 * BLOCK] = False
    return x, tie


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler: the loop cannot be compiled here")
@pytest.mark.parametrize("code", [RowCode.SIGNED8, RowCode.SQRT8])
def test_compiled_codes_equal_the_formulas_ties_included(code):
    unsigned = code is RowCode.SQRT8
    n = 64 * BLOCK
    x, _ = with_ties(n, unsigned)
    codes, scales = coded(code, x)
    assert _coding._LOOPS[unsigned].state is _coding._State.COMPILED, "a compiler is here but the loop did not compile"
    want_codes, want_scales = ref_code(x.double().numpy(), unsigned)
    assert np.array_equal(scales, want_scales)
    assert np.array_equal(codes, want_codes)
    scale = np.repeat(want_scales, BLOCK)
    scaled = (np.sqrt(x.double().numpy()) if unsigned else x.double().numpy())[scale > 0] / scale[scale > 0]
    assert (np.abs(np.modf(scaled)[0]) == 0.5).sum() >= n // 20  # the ties are there
    one = coded(code, x[:BLOCK])  # a row of one block (dynamo compiles that shape apart)
    assert np.array_equal(one[0], want_codes[:BLOCK]) and np.array_equal(one[1], want_scales[:1])
    graphs = counters["stats"]["unique_graphs"]
    for blocks in (3, 17, 40):  # rows of other lengths: the loop compiled for any number of blocks
        part = coded(code, x[: blocks * BLOCK])
        assert np.array_equal(part[0], want_codes[: blocks * BLOCK])
    assert counters["stats"]["unique_graphs"] == graphs, "the loop was compiled again for another row length"
    eager_codes, eager_scales = coded(code, x, eager=True)
    assert np.array_equal(eager_scales, scales) and np.array_equal(eager_codes, codes)


def fresh_loops(monkeypatch) -> dict:
    loops = {flag: _coding._Loop(flag, _coding._LOCK) for flag in (False, True)}  # (the module's lock)
    for loop in loops.values():
        loop.state = _coding._State.UNTRIED
    monkeypatch.setattr(_coding, "_LOOPS", loops)
    return loops


def test_a_failure_to_compile_codes_eagerly_and_says_why(monkeypatch, caplog):
    loops = fresh_loops(monkeypatch)

    class InvalidCxxCompiler(RuntimeError):
        pass

    def no_compiler(*args, **kwargs):  # as inductor raises it: the cause on the wrapper's second line
        try:
            raise InvalidCxxCompiler("No working C++ compiler found in torch._inductor.config.cpp.cxx")
        except InvalidCxxCompiler as exc:
            raise RuntimeError(f"backend='inductor' raised:\nInvalidCxxCompiler: {exc}") from exc

    monkeypatch.setattr(torch, "compile", no_compiler)
    m, v = moments(8 * BLOCK, 5)
    with caplog.at_level(logging.WARNING, logger="offload.optim._coding"):
        codes, scales = coded(RowCode.SIGNED8, m)
        again = coded(RowCode.SIGNED8, m)
        coded(RowCode.SQRT8, v)  # (the other code's loop is not tried again)
    assert loops[False].state is _coding._State.EAGER and loops[True].state is _coding._State.EAGER
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # said once, not per row or per code
    assert "No working C++ compiler found" in warnings[0] and "gcc or clang" in warnings[0]
    want_codes, want_scales = ref_code(m.double().numpy(), False)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    assert np.array_equal(again[0], codes)


def test_a_compile_stopped_by_dynamo_s_recompile_limit_names_that_setting(monkeypatch, caplog):
    """A user's ``torch._dynamo.config.recompile_limit`` below the loop's two graphs stops the
    compile: the warning names that setting, not a missing C++ compiler."""
    loops = fresh_loops(monkeypatch)

    def limited(*args, **kwargs):  # (dynamo's message, as a user's recompile_limit = 1 gives it)
        raise RuntimeError("Unsupported: Dynamo recompile limit exceeded Explanation: Dynamo attempted to "
                           "recompile the code object too many times (currently set to 1).")

    monkeypatch.setattr(torch, "compile", limited)
    m, _ = moments(8 * BLOCK, 12)
    with caplog.at_level(logging.WARNING, logger="offload.optim._coding"):
        codes, _ = coded(RowCode.SIGNED8, m)
    assert loops[False].state is _coding._State.EAGER
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "recompile_limit" in warning and "C++ compiler" not in warning
    assert np.array_equal(codes, ref_code(m.double().numpy(), False)[0])


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler: the loop cannot be compiled here")
def test_a_loop_that_disagrees_with_the_reference_is_not_used(monkeypatch, caplog):
    """The check before first use: a loop rounding half up (as a careless build might) is
    refused, and the row is coded eagerly."""
    loops = fresh_loops(monkeypatch)

    def half_up(blocks, out):
        absmax = blocks.abs().amax(1)
        s = _coding._scales(absmax, 127.0)
        out.copy_(torch.floor(blocks * torch.where(s > 0, 1.0 / s, 0.0)[:, None] + 0.5).to(torch.int8))
        return absmax, s

    monkeypatch.setattr(_coding, "_signed", half_up)
    m, _ = moments(8 * BLOCK, 7)
    with caplog.at_level(logging.WARNING, logger="offload.optim._coding"):
        codes, scales = coded(RowCode.SIGNED8, m)
    assert loops[False].state is _coding._State.EAGER
    assert any("differ from the float64 reference" in r.getMessage() for r in caplog.records)
    want_codes, want_scales = ref_code(m.double().numpy(), False)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler: the loop cannot be compiled here")
def test_the_loop_is_not_compiled_again_under_the_callers_modes(caplog):
    """An update owed to an evaluation under no_grad or inference_mode, or a step under
    autocast, codes with the loop as compiled (dynamo guards on those modes); a new thread
    count compiles it again, once, with a log line, and it stays general."""
    m, _ = moments(16 * BLOCK, 8)
    want = coded(RowCode.SIGNED8, m)
    packing = Packing((RowCode.SIGNED8,), m.numel())
    graphs = counters["stats"]["unique_graphs"]
    for mode in (torch.no_grad, torch.inference_mode, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        rows, packed = m.clone().view(1, -1), torch.empty(packing.nbytes, dtype=torch.uint8)  # (the pools' are
        with mode():  # ordinary tensors, made outside any mode: _tensors.lasting)
            packing.encode(rows, packed)
        assert torch.equal(packed[: m.numel()].view(torch.int8).double(), torch.from_numpy(want[0]))
    with torch.inference_mode():  # tensors made in inference mode: coded (eagerly), nothing given up
        rows, packed = m.clone().view(1, -1), torch.empty(packing.nbytes, dtype=torch.uint8)
        packing.encode(rows, packed)
    assert torch.equal(packed[: m.numel()].view(torch.int8).double(), torch.from_numpy(want[0]))
    assert _coding._LOOPS[False].state is _coding._State.COMPILED
    assert counters["stats"]["unique_graphs"] == graphs
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        with caplog.at_level(logging.INFO, logger="offload.optim._coding"):
            for blocks in (16, 5):
                got = coded(RowCode.SIGNED8, m[: blocks * BLOCK])
                assert np.array_equal(got[0], want[0][: blocks * BLOCK])
    finally:
        torch.set_num_threads(threads)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # (one compile, for any number of blocks)
    assert sum("compiled again" in r.getMessage() for r in caplog.records) == 1
    assert _coding._LOOPS[False].state is _coding._State.COMPILED


def test_a_loop_given_up_after_compiling_says_so_without_blaming_the_compiler(monkeypatch, caplog):
    loops = fresh_loops(monkeypatch)
    loops[False].state = _coding._State.COMPILED

    def limit(blocks, out):
        raise RuntimeError("Unsupported: Dynamo recompile limit exceeded")

    loops[False].compiled = limit
    m, _ = moments(8 * BLOCK, 9)
    with caplog.at_level(logging.WARNING, logger="offload.optim._coding"):
        codes, scales = coded(RowCode.SIGNED8, m)
    assert loops[False].state is _coding._State.EAGER
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "recompile limit" in warning and "gave up" in warning
    assert _coding._RERUN in warning and _coding._COMPILER not in warning
    want_codes, want_scales = ref_code(m.double().numpy(), False)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)


def test_torch_compile_disabled_is_said_and_codes_eagerly(monkeypatch, caplog):
    loops = fresh_loops(monkeypatch)
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # (TORCHDYNAMO_DISABLE=1)
    m, _ = moments(8 * BLOCK, 10)
    with caplog.at_level(logging.INFO, logger="offload.optim._coding"):
        codes, scales = coded(RowCode.SIGNED8, m)
        coded(RowCode.SQRT8, m * m)  # (the other code: nothing more said)
    assert loops[False].state is _coding._State.EAGER and loops[True].state is _coding._State.EAGER
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "TORCHDYNAMO_DISABLE" in said[0] and "eagerly" in said[0]
    want_codes, want_scales = ref_code(m.double().numpy(), False)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)

def test_switched_off_by_the_environment(monkeypatch, caplog):
    monkeypatch.setenv("OFFLOAD_COMPILE_CODES", "0")
    loop = _coding._Loop(False, threading.Lock())
    blocks = torch.ones(2, BLOCK)
    with caplog.at_level(logging.INFO, logger="offload.optim._coding"):
        assert loop.run(blocks, torch.empty(2, BLOCK, dtype=torch.int8)) is None
        assert loop.run(blocks, torch.empty(2, BLOCK, dtype=torch.int8)) is None
    assert loop.state is _coding._State.EAGER
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "OFFLOAD_COMPILE_CODES=0" in said[0]  # said once, and nothing compiled


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler: the loop cannot be compiled here")
@pytest.mark.parametrize("code", [RowCode.SIGNED8, RowCode.SQRT8])
def test_eager_coding_gives_the_loop_s_bytes(code):
    """The eager path (rows with an inf or NaN, tensors made in inference mode, no compiler)
    codes as the loop does: over a million random moments a few roots land within an ulp of
    a tie, where eager ``torch.sqrt``, an ulp off on this CPU, would code one apart."""
    n = 4096 * BLOCK
    m, v = moments(n, 11)
    x = v if code is RowCode.SQRT8 else m
    codes, scales = coded(code, x)
    assert _coding._LOOPS[code is RowCode.SQRT8].state is _coding._State.COMPILED
    eager_codes, eager_scales = coded(code, x, eager=True)
    assert np.array_equal(eager_scales, scales) and np.array_equal(eager_codes, codes)


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


def test_the_plan_counts_what_compiling_adds_until_it_is_done(monkeypatch, tmp_path):
    """Compiling adds to the process's RSS beside the pools (dynamo's and inductor's own
    memory): the plan of an int8 optimizer counts it until a loop is compiled (then the
    baseline holds it), and never where the coding stays eager."""
    import offload

    loops = fresh_loops(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=str(tmp_path),
                                host_budget="8MiB")

    def row(moments):
        p = offload.plan(model, cfg, optimizer="adamw", moments=moments)
        rows = [r for r in p.rows if "compiling" in r.item]
        return p, (rows[0] if rows else None)

    p8, compiling = row("int8")
    assert compiling is not None and compiling.nbytes == _coding.compile_bytes() > 0 and not compiling.pooled
    assert p8.ram_need > compiling.nbytes > cfg.host_budget  # (beside host_budget, not within it)
    assert row("fp32")[1] is None
    loops[True].state = _coding._State.COMPILED
    assert row("int8")[1] is None
    loops[True].state = loops[False].state = _coding._State.EAGER
    assert row("int8")[1] is None
