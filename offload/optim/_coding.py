"""The 8-bit coding of a row as one compiled loop.

Coding a row eagerly takes five to seven passes over it (block maxima, root, scale, round,
clamp, cast), each at memory speed, and that time lands on the optimizer's step.
``torch.compile`` (inductor's C++ backend on the CPU) fuses them: per block of ``BLOCK``
elements, the maximum, the block's scale and the codes, in one loop over the row that reads
fp32 and writes the codes.

The scale here is computed from the bits of ``absmax / top`` (its exponent, one up unless
the mantissa is zero): the same power of two as ``block_scales``' ``frexp``,
which inductor does not compile. Rounding is to nearest even, as eager ``round_``, and
the square root is correctly rounded on both paths (eager ``torch.sqrt`` on the CPU may be
an ulp off: the eager path takes the root through float64, ``exact_root_``), so the
compiled loop and the eager path give the same bytes. The eager path codes a row with an
inf or NaN, tensors made in inference mode, and every row where compiling is off (no C++
compiler, ``OFFLOAD_COMPILE_CODES=0``, ``TORCHDYNAMO_DISABLE``), fails, fails the check or
is given up. Decoding is exact and decoded values code back to the same bytes.

The loop is compiled for any number of blocks of the fixed width, as a parallel loop over
the blocks (inductor's ``cpp.dynamic_threads``: otherwise it would keep the one thread it
picks for the two blocks it is first compiled with). It is always called outside inference
mode, without grad or autocast, so that an update owed to an evaluation, or a step under
autocast, does not compile it again. Each loop is compiled the first time a row of its code
is coded (an optimizer's initial states, in its constructor), on that thread, and checked
against a float64 reference on a row with a tie, a peak exactly a power of two, a
subnormal, a zero block and a NaN before it is used: a compiler whose flags lose any of
those (a fast-math build dropping NaN) leaves the coding eager, with a warning.
Not on a background thread, though a cold compile can take a minute: dynamo restores the
process's random generator after tracing, which on another thread rewinds the user's draws
(dropout masks), and ``torch.compiler.is_compiling()`` reads true in every thread meanwhile,
on which transformers' and torch's optimizers' code branches (tried and measured: both
changed a training run's results).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import sys
import threading
import time
from typing import Callable

import torch

from .._tensors import lasting

__all__ = ["block_scales", "code_blocks", "compile_bytes", "eager_coding", "exact_root_", "MIN_SCALE", "TOP"]

log = logging.getLogger(__name__)

MIN_SCALE = 2.0 ** -60  # smallest block scale: its square (a second moment) stays a normal fp32
_MANTISSA, _EXPONENT, _ONE_UP = 0x007FFFFF, 0x7F800000, 0x00800000
TOP = {False: 127.0, True: 255.0}  # the top code: signed (first moments, momentum), unsigned (second moments)


def block_scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two ``s`` with ``absmax / s <= top`` per block (0 for a block
    of zeros); exact powers of two stay where they are, so decoded values code back to
    the same scale. (The eager path's and the check's; the loop computes it from bits.)"""
    mantissa, exp = torch.frexp(absmax / top)
    exp -= (mantissa == 0.5).to(exp.dtype)
    exp.clamp_(min=round(math.log2(MIN_SCALE)))
    scales = torch.ldexp(torch.ones_like(absmax), exp)
    return scales.masked_fill_(absmax == 0, 0.0)


def exact_root_(x: torch.Tensor) -> torch.Tensor:
    """``x``'s (contiguous) square root in place, correctly rounded as the compiled loop's (eager
    ``torch.sqrt`` on the CPU may be an ulp off), through float64 a slice at a time: the eager
    path's root, so that both paths give the same codes."""
    flat = x.view(-1)
    for i in range(0, flat.numel(), _ROOT_SLICE):
        part = flat[i: i + _ROOT_SLICE]
        part.copy_(part.double().sqrt_())
    return x


_ROOT_SLICE = 1 << 18  # elements per float64 slice: 2 MiB


def _scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two ``s`` with ``absmax / s <= top`` (0 for a zero block)."""
    bits = (absmax / top).view(torch.int32)
    exponent = bits & _EXPONENT
    s = torch.where((bits & _MANTISSA) == 0, exponent, exponent + _ONE_UP).view(torch.float32)
    return torch.where(absmax == 0, 0.0, torch.clamp(s, min=MIN_SCALE))


def _signed(blocks: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = blocks.abs().amax(1)
    s = _scales(absmax, TOP[False])
    out.copy_(torch.round(blocks * torch.where(s > 0, 1.0 / s, 0.0)[:, None]).to(torch.int8))
    return absmax, s


def _unsigned(blocks: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    root = torch.sqrt(blocks)
    absmax = root.amax(1)
    s = _scales(absmax, TOP[True])
    # no element codes to zero (a block of zeros decodes to zero through its scale 0)
    out.copy_(torch.clamp(torch.round(root * torch.where(s > 0, 1.0 / s, 0.0)[:, None]), min=1.0).to(torch.uint8))
    return absmax, s


def _reference(unsigned: bool, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of finite ``blocks`` in float64, from the formulas (the check); the
    root rounded to fp32, as the loop keeps it."""
    x = blocks.double().sqrt().float().double() if unsigned else blocks.double()
    s = block_scales(x.abs().amax(1), TOP[unsigned])
    codes = torch.round(x / torch.where(s > 0, s, 1.0)[:, None])
    return (codes.clamp(min=1.0) if unsigned else codes), s


def _probe(width: int, rows: int, unsigned: bool) -> torch.Tensor:
    """Blocks with ties, a peak exactly a power of two times the top code and, given a
    second row, subnormals and zeros."""
    peak = torch.linspace(0, 1, width, dtype=torch.float64) * TOP[unsigned] * 2.0 ** -20
    peak[1] = 2.5 * 2.0 ** -20  # a tie: 2.5 codes (linspace's halves are more)
    probe = torch.zeros(rows, width)
    probe[0] = (peak * peak if unsigned else peak).float()  # (the unsigned code's root is the peak row)
    if rows > 1:
        probe[1, :3] = torch.tensor([1e-40, 3e-41 if unsigned else -3e-41, 0.0])
    return probe


class _State(enum.Enum):
    UNTRIED = "untried"
    COMPILED = "compiled"
    SWITCHED_OFF = "switched off"  # OFFLOAD_COMPILE_CODES=0: said once at the first row, then EAGER
    EAGER = "eager"  # compiling failed, was refused by the check or is switched off: the caller codes eagerly


class _Loop:
    """One code's compiled loop, made on first use under a lock (a shard may be coded on
    autograd's device thread); a failure leaves that code eager for the process, with one
    warning that names the cause."""

    def __init__(self, unsigned: bool, lock: threading.Lock) -> None:
        self.unsigned = unsigned
        self.lock = lock
        off = os.environ.get("OFFLOAD_COMPILE_CODES", "1") == "0"
        self.state = _State.SWITCHED_OFF if off else _State.UNTRIED
        self.compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def name(self) -> str:
        return "unsigned code (second moments)" if self.unsigned else "signed code (first moments, momentum)"

    def run(self, blocks: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.state in (_State.UNTRIED, _State.SWITCHED_OFF):
            with self.lock:
                if self.state is _State.UNTRIED:
                    self._compile(blocks.shape[1])
                elif self.state is _State.SWITCHED_OFF:
                    log.info("8-bit moments: coding the %s eagerly (OFFLOAD_COMPILE_CODES=0)", self.name)
                    self.state = _State.EAGER
        if self.state is not _State.COMPILED:
            return None
        from torch._dynamo.utils import counters  # (imported by the compile already)

        graphs = counters["stats"]["unique_graphs"]
        started = time.perf_counter()
        try:
            return self._call(blocks, out)
        except Exception as exc:  # (a recompile failed, or dynamo's limit on them was reached; the caller's
            # eager path then rewrites every code and scale of the row, whatever the loop had written)
            self._give_up(exc, "torch.compile gave up on the coding loop", _RERUN)
            return None
        finally:
            if counters["stats"]["unique_graphs"] != graphs:
                # (process-wide counts: a compile of the user's on another thread meanwhile is counted too)
                log.info("8-bit moments: the coding loop of the %s was compiled again, in %.1f s (dynamo "
                         "compiles anew when a global setting of torch's, such as the thread count, changes)",
                         self.name, time.perf_counter() - started)

    def _call(self, blocks: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The loop, called in the state it was compiled in. Dynamo's guards compare grad mode,
        inference mode and autocast with the compile's, and a call in another state (an update
        owed to an evaluation under no_grad or inference_mode, a step under autocast) would
        compile the loop anew: so it runs outside inference mode, without grad or autocast,
        and with the dynamic number of blocks marked, should the thread count change. None
        for tensors made in inference mode (which cannot be written outside it): the caller
        codes those eagerly."""
        if blocks.is_inference() or out.is_inference():
            return None
        with contextlib.ExitStack() as stack:
            stack.enter_context(lasting())
            stack.enter_context(torch.no_grad())
            for device in _autocasting():
                stack.enter_context(torch.autocast(device, enabled=False))
            for tensor in (blocks, out) if blocks.shape[0] > 1 else ():
                torch._dynamo.mark_dynamic(tensor, 0)  # (any number of blocks; one block is specialised)
            return self.compiled(blocks, out)

    def _compile(self, width: int) -> None:
        if torch._dynamo.config.disable:  # (torch.compile would hand back the function as it is)
            log.info("8-bit moments: torch.compile is disabled (TORCHDYNAMO_DISABLE); coding eagerly")
            for loop in _LOOPS.values():  # (said once, for both codes)
                loop.state = _State.EAGER
            return
        log.info("8-bit moments: compiling the coding loop of the %s (once per process)", self.name)
        started = time.perf_counter()
        fn = _unsigned if self.unsigned else _signed
        try:
            with _quiet_build():
                # any number of blocks (marked dynamic at each call), each of the fixed width: a
                # loop over a known width is unrolled, one over any width takes masked tails
                self.compiled = torch.compile(fn, dynamic=False, fullgraph=True, options=_settings())
                for rows in (2, 1):  # (any number of blocks, then the one dynamo specialises: 1 block)
                    self._check(rows, width)
        except Exception as exc:  # (no C++ compiler, an unsupported platform, the check: anything raised)
            # the other code's loop would fail the same way: neither is tried again
            for loop in _LOOPS.values():
                loop.state = _State.EAGER
            self._give_up(exc, "could not compile the coding loop", _advice(exc))
            return
        self.state = _State.COMPILED
        log.info("8-bit moments: coding loop of the %s compiled in %.1f s", self.name, time.perf_counter() - started)

    def _check(self, rows: int, width: int) -> None:
        with lasting():  # (the compile may come within inference mode: the probe is made outside it)
            probe = _probe(width, rows, self.unsigned)
            out = torch.empty(probe.shape, dtype=torch.uint8 if self.unsigned else torch.int8)
        absmax, s = self._call(probe, out)
        codes, scales = _reference(self.unsigned, probe)
        if not (torch.equal(out.double(), codes) and torch.equal(s.double(), scales)):
            raise RuntimeError("its codes differ from the float64 reference's")
        poisoned = probe.clone()
        poisoned[0, 5] = float("nan")
        if bool(torch.isfinite(self._call(poisoned, out)[0][0])):
            raise RuntimeError("a block holding a NaN came out with a finite maximum (a fast-math build?)")

    def _give_up(self, exc: Exception, what: str, fix: str) -> None:
        self.state = _State.EAGER
        log.warning("8-bit moments: %s (%s); coding eagerly, which takes a few more passes over each row. "
                    "%s", what, _cause(exc), fix)


_COMPILER = ("A working C++ compiler (gcc or clang) on the PATH lets it compile; "
             "OFFLOAD_COMPILE_CODES=0 skips trying.")
_RERUN = "The results stay right; a new process compiles the loop again."


def _advice(exc: BaseException) -> str:
    """What to do about a failed compile: dynamo's recompile limit set below the loop's two
    graphs (a row of one block is compiled apart) is the user's setting, not the compiler."""
    text = str(exc.__cause__ if exc.__cause__ is not None else exc).lower()
    if "recompile" in text and "limit" in text:
        setting = "accumulated_recompile_limit" if "accumulated" in text else "recompile_limit"
        return (f"torch._dynamo.config.{setting}, set in this process, is below the two graphs the loop "
                "needs (a row of one block is compiled apart); the results stay right. "
                "OFFLOAD_COMPILE_CODES=0 skips trying.")
    return _COMPILER


def _settings() -> dict:
    """Inductor's settings for the loop, bound to it (its compile and any recompile, not the
    process's other compiles): one compile worker (a pool the size of the machine would stay
    for the whole process) and, where this torch has it, ``cpp.dynamic_threads``: a parallel
    loop over the blocks whatever the number of blocks it was compiled with (the probe's two
    would otherwise get one thread)."""
    import torch._inductor.config as inductor

    settings = {"compile_threads": 1}
    if hasattr(inductor.cpp, "dynamic_threads"):
        settings["cpp.dynamic_threads"] = True
    return settings


@contextlib.contextmanager
def _quiet_build():
    """Torch's notice that a CPU machine has no CUDA runtime, logged while the loop builds,
    held back (the first compile only: it runs under the lock)."""
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quiet.setLevel(level)


def _autocasting() -> list[str]:
    """The device types whose autocast is on in this thread."""
    on = []
    for device in ("cpu", "cuda", "xpu", "mps", "hpu"):
        try:
            if torch.is_autocast_enabled(device):
                on.append(device)
        except (TypeError, RuntimeError):  # (a torch before 2.4 takes no device; one without this type)
            if device == "cpu" and torch.is_autocast_cpu_enabled() or device == "cuda" and torch.is_autocast_enabled():
                on.append(device)
    return on


def _cause(exc: BaseException) -> str:
    """The exception that stopped the compile, in a line: inductor wraps the compiler's own
    (``BackendCompilerFailed``: "backend='inductor' raised:", the cause on the next line)."""
    inner = exc.__cause__ if exc.__cause__ is not None else exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"{type(inner).__name__}: {' '.join(lines[:2])[:300]}"


_LOCK = threading.Lock()
_LOOPS = {flag: _Loop(flag, _LOCK) for flag in (False, True)}


# what the first compile adds to the process's RSS at its peak: dynamo's and inductor's modules
# and caches, less where something (transformers does) imported those modules already
# (measured: docs/benchmarks.md, "One compiled loop per row"); the plan counts it
_COMPILE_RSS, _COMPILE_RSS_IMPORTED = 288 << 20, 128 << 20


def compile_bytes() -> int:
    """The RSS compiling the coding loops will add: 0 once one is compiled (what it took is
    then in the process's baseline) or where the coding stays eager."""
    if {loop.state for loop in _LOOPS.values()} != {_State.UNTRIED}:
        return 0
    return _COMPILE_RSS_IMPORTED if "torch._inductor.compile_fx" in sys.modules else _COMPILE_RSS


def code_blocks(unsigned: bool, blocks: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Code ``blocks`` (fp32, ``n x BLOCK``, left as they are) into ``out`` (int8, or uint8
    and linear in the root when ``unsigned``) in one compiled loop; returns each block's
    maximum (of the root, or of the absolute values) and scale. The codes of a block whose
    maximum is not finite are undefined: the caller codes such a row eagerly. None where
    compiling is not available: the caller codes the row eagerly."""
    return _LOOPS[unsigned].run(blocks, out)


@contextlib.contextmanager
def eager_coding():
    """Code eagerly inside the block, as where compiling is not possible. For tests and
    ``benchmarks/state_codes.py``, which compare the two paths: it changes a process-wide
    setting, so no other thread should be coding meanwhile."""
    saved = {flag: loop.state for flag, loop in _LOOPS.items()}
    for loop in _LOOPS.values():
        loop.state = _State.EAGER
    try:
        yield
    finally:
        for flag, loop in _LOOPS.items():
            loop.state = saved[flag]
