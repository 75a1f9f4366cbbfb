"""The element pass of the 8-bit coding as one compiled loop per row.

Coding a row eagerly takes four to six passes over it (root, scale, round, clamp, cast), each
at memory speed, and that time lands on the optimizer's step. ``torch.compile`` (inductor's
C++ backend on the CPU) fuses them into one loop that reads fp32 and writes the codes, and
the block maxima into one more (eager takes two for a signed row's). The scales' arithmetic,
on one value per block, stays eager.

The compiled loop rounds to nearest even, as eager ``round_`` does, and its square root is
correctly rounded; eager ``torch.sqrt`` on the CPU may be an ulp off, so where compiling is
not possible (no C++ compiler, ``OFFLOAD_COMPILE_CODES=0``) an unsigned code exactly at a
tie can come out one apart. Either way decoding is exact and decoded values code back to
the same bytes.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time

import torch

__all__ = ["block_peaks", "code_blocks", "eager_coding"]

log = logging.getLogger(__name__)


def _signed_peaks(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.abs().amax(1)


def _unsigned_peaks(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.amax(1)


def _signed(blocks: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.round(blocks * inverse[:, None]).to(torch.int8))


def _unsigned(blocks: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    # no element codes to zero (a block of zeros decodes to zero through its scale 0)
    out.copy_(torch.clamp(torch.round(torch.sqrt(blocks) * inverse[:, None]), min=1.0).to(torch.uint8))


class _State(enum.Enum):
    UNTRIED = "untried"
    COMPILED = "compiled"
    EAGER = "eager"  # compiling failed or is switched off: the caller codes eagerly


_LOOPS = {("peaks", False): _signed_peaks, ("peaks", True): _unsigned_peaks,
          ("code", False): _signed, ("code", True): _unsigned}


class _Kernels:
    """The compiled loops, made on first use (under a lock: a shard may be coded on
    autograd's device thread); one failure switches to eager for the process, with a warning
    that names the cause."""

    def __init__(self) -> None:
        self.state = _State.EAGER if os.environ.get("OFFLOAD_COMPILE_CODES", "1") == "0" else _State.UNTRIED
        self.lock = threading.Lock()
        self.loops = {}

    def run(self, key: tuple[str, bool], *args: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        """(whether the loop ran, what it returned)."""
        if self.state is _State.EAGER:
            return False, None
        if self.state is _State.COMPILED:
            try:
                return True, self.loops[key](*args)
            except Exception as exc:  # (a recompile for a new kind of row failed before the loop ran)
                self._give_up(exc)
                return False, None
        with self.lock:
            if self.state is _State.UNTRIED:
                self._compile(args[0].shape[1])
        return self.run(key, *args)

    def _compile(self, width: int) -> None:
        started = time.perf_counter()
        try:
            self.loops = {key: torch.compile(fn, dynamic=True, fullgraph=True) for key, fn in _LOOPS.items()}
            # each compiled on a small row of its own: a failure leaves the caller's untouched
            probe = torch.ones(2, width)
            for (name, unsigned), loop in self.loops.items():
                if name == "peaks":
                    loop(probe)
                else:
                    loop(probe, torch.ones(2), torch.empty(probe.shape, dtype=torch.uint8 if unsigned else torch.int8))
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


def block_peaks(unsigned: bool, blocks: torch.Tensor) -> torch.Tensor | None:
    """Each block's maximum (of the absolute values unless ``unsigned``) of ``blocks`` (fp32,
    ``n x BLOCK``), in one compiled pass; None where compiling is not available."""
    return _KERNELS.run(("peaks", unsigned), blocks)[1]


def code_blocks(unsigned: bool, blocks: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> bool:
    """Code ``blocks`` (fp32, ``n x BLOCK``, left as they are) by ``inverse`` (each block's
    1 / scale) into ``out`` (int8, or uint8 and linear in the root when ``unsigned``), in
    one compiled pass. False where compiling is not available: nothing was written."""
    return _KERNELS.run(("code", unsigned), blocks, inverse, out)[0]


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
