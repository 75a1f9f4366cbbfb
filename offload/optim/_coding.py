"""The 8-bit coding of a row as one compiled loop.

Coding a row eagerly takes five to seven passes over it (block maxima, root, scale, round,
clamp, cast), each at memory speed, and that time lands on the optimizer's step.
``torch.compile`` (inductor's C++ backend on the CPU) fuses them: per block of ``BLOCK``
elements, the maximum, the block's scale and the codes, in one loop over the row that reads
fp32 and writes the codes.

The scale here is computed from the bits of ``absmax / top`` (its exponent, one up unless
the mantissa is zero): the same power of two as ``_formats.block_scales``'s ``frexp``,
which inductor does not compile. Rounding is to nearest even, as eager ``round_``, and
the square root is correctly rounded; eager ``torch.sqrt`` on the CPU may be an ulp off, so
where compiling is not possible (no C++ compiler, ``OFFLOAD_COMPILE_CODES=0``) an unsigned
code exactly at a tie can come out one apart. Either way decoding is exact and decoded
values code back to the same bytes.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time

import torch

__all__ = ["code_blocks", "eager_coding", "MIN_SCALE"]

log = logging.getLogger(__name__)

MIN_SCALE = 2.0 ** -60  # smallest block scale: its square (a second moment) stays a normal fp32
_MANTISSA, _EXPONENT, _ONE_UP = 0x007FFFFF, 0x7F800000, 0x00800000


def _scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two ``s`` with ``absmax / s <= top`` (0 for a zero block)."""
    bits = (absmax / top).view(torch.int32)
    exponent = bits & _EXPONENT
    s = torch.where((bits & _MANTISSA) == 0, exponent, exponent + _ONE_UP).view(torch.float32)
    return torch.where(absmax == 0, 0.0, torch.clamp(s, min=MIN_SCALE))


def _signed(blocks: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = blocks.abs().amax(1)
    s = _scales(absmax, 127.0)
    out.copy_(torch.round(blocks * torch.where(s > 0, 1.0 / s, 0.0)[:, None]).to(torch.int8))
    return absmax, s


def _unsigned(blocks: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    root = torch.sqrt(blocks)
    absmax = root.amax(1)
    s = _scales(absmax, 255.0)
    # no element codes to zero (a block of zeros decodes to zero through its scale 0)
    out.copy_(torch.clamp(torch.round(root * torch.where(s > 0, 1.0 / s, 0.0)[:, None]), min=1.0).to(torch.uint8))
    return absmax, s


class _State(enum.Enum):
    UNTRIED = "untried"
    COMPILED = "compiled"
    EAGER = "eager"  # compiling failed or is switched off: the caller codes eagerly


class _Kernels:
    """The compiled loops, made on first use (under a lock: a shard may be coded on
    autograd's device thread); one failure switches to eager for the process, with a warning
    that names the cause."""

    def __init__(self) -> None:
        self.state = _State.EAGER if os.environ.get("OFFLOAD_COMPILE_CODES", "1") == "0" else _State.UNTRIED
        self.lock = threading.Lock()
        self.loops: dict[bool, object] = {}

    def run(self, unsigned: bool, blocks: torch.Tensor, out: torch.Tensor):
        if self.state is _State.EAGER:
            return None
        if self.state is _State.COMPILED:
            try:
                return self.loops[unsigned](blocks, out)
            except Exception as exc:  # (a recompile for a new kind of row failed before the loop ran)
                self._give_up(exc)
                return None
        with self.lock:
            if self.state is _State.UNTRIED:
                self._compile(blocks.shape[1])
        return self.run(unsigned, blocks, out)

    def _compile(self, width: int) -> None:
        log.info("8-bit moments: compiling the coding loops (once per process, a few seconds)")
        started = time.perf_counter()
        try:
            self.loops = {flag: torch.compile(fn, dynamic=True, fullgraph=True)
                          for flag, fn in ((False, _signed), (True, _unsigned))}
            probe = torch.ones(2, width)  # (each compiled on a row of its own: a failure leaves the caller's as it was)
            for unsigned, loop in self.loops.items():
                loop(probe, torch.empty(probe.shape, dtype=torch.uint8 if unsigned else torch.int8))
        except Exception as exc:  # (no C++ compiler, an unsupported platform: anything inductor raises)
            self._give_up(exc)
            return
        self.state = _State.COMPILED
        log.info("8-bit moments: coding loops compiled in %.1f s", time.perf_counter() - started)

    def _give_up(self, exc: Exception) -> None:
        self.state = _State.EAGER
        cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        log.warning("8-bit moments: could not compile the coding loop (%s: %s); coding eagerly, which "
                    "takes a few more passes over each row. A C++ compiler (gcc or clang) on the PATH "
                    "enables it; OFFLOAD_COMPILE_CODES=0 skips trying.", type(exc).__name__, cause)


_KERNELS = _Kernels()


def code_blocks(unsigned: bool, blocks: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Code ``blocks`` (fp32, ``n x BLOCK``, left as they are) into ``out`` (int8, or uint8
    and linear in the root when ``unsigned``) in one compiled loop; returns each block's
    maximum (of the root, or of the absolute values) and scale. The codes of a block whose
    maximum is not finite are undefined: the caller codes such a row eagerly. None where
    compiling is not available: nothing was written."""
    return _KERNELS.run(unsigned, blocks, out)


@contextlib.contextmanager
def eager_coding():
    """Code eagerly inside the block, as where compiling is not possible (the tests and
    ``benchmarks/state_codes.py`` compare the two paths)."""
    saved = _KERNELS.state
    _KERNELS.state = _State.EAGER
    try:
        yield
    finally:
        _KERNELS.state = saved
