"""How a shard's state rows are stored: fp32 (torch's), bf16, or 8-bit block-wise codes.

The 8-bit codes follow the 8-bit Adam paper's scheme (Dettmers et al., 2022): each run of
``BLOCK`` elements is normalised by its absolute maximum and coded in 8 bits; the first
moment (and SGD's momentum) signed, the second moment unsigned.

* ``SIGNED8``: a linear code, ``x = c * s`` with ``c`` in [-127, 127];
* ``SQRT8``: linear in the square root, ``v = (c * s) ** 2`` with ``c`` in [1, 255]. The
  root halves the second moment's dynamic range in a block, and no element codes to zero
  (the zero-point problem: an update ``m / (sqrt(v) + eps)`` over a rounded-away ``v``
  would explode); a block of zeros keeps ``s = 0``.

A bf16 master row (``master="bf16"``, for bf16 parameters) is rounded stochastically: the
fp32 result plus a uniform dither below its last kept bit, truncated (``round_in_place``,
before the new values go to the parameters), so that rounding is unbiased over steps: a
step's change far below bf16's resolution still moves the weight in expectation, where
rounding to nearest would lose it. The dither comes from a fixed table of 65536 values,
read from an offset that each parameter's place among the optimizer's, its step and the
element pick (``dither_at``), so a resumed run draws the same dither whatever shards hold
the parameter (another host budget, tier or ``shard_size``), with no generator state to save.

The block scale ``s`` is the block's absolute maximum over the top code, rounded up to a
power of two (as the OCP microscaling formats' shared scales). Decoding is then exact in
fp32, and coding decoded values again gives the same codes and scales: a state dict in
fp32, or a conversion through it, resumes bit for bit. Rounding is to nearest (even).

Blocks start at each segment's first element (``_layout.cut`` aligns segments to ``BLOCK``
in shards of these formats), so a checkpoint piece, one parameter's slice, carries its own
scales. Coding and decoding run on a whole shard in an fp32 scratch buffer the optimizer
holds (``ShardBook.scratch``): nothing wider than a shard is materialised. Coding a row runs
as one compiled loop where it can (``_coding``).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass

import torch

from .._tensors import lasting
from ._coding import TOP, block_scales, code_blocks, exact_root_

__all__ = ["StateFormat", "RowCode", "Packing", "BLOCK", "packing_for", "decode_piece", "dither_at"]

BLOCK = 256  # elements per block scale: 4 bytes of scale per 256 one-byte codes


class StateFormat(enum.Enum):
    """How an offload optimizer keeps its moment rows (``moments=`` of the optimizers)."""
    FP32 = "fp32"  # torch's: the default, trajectories equal torch's
    BF16 = "bf16"  # 2 bytes per element, rounded to nearest even
    INT8 = "int8"  # 1 byte per element and a 4-byte scale per BLOCK elements

    @classmethod
    def parse(cls, value: "str | StateFormat") -> "StateFormat":
        """The ``moments=`` setting."""
        if isinstance(value, StateFormat):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"moments={value!r}: use 'fp32' (default, torch's), 'bf16' or 'int8'") from None

    @classmethod
    def parse_master(cls, value: "str | StateFormat") -> "StateFormat":
        """The ``master=`` setting: fp32 or bf16."""
        fmt = cls(value) if isinstance(value, StateFormat) else {"fp32": cls.FP32, "bf16": cls.BF16}.get(
            str(value).lower())
        if fmt not in (cls.FP32, cls.BF16):
            raise ValueError(f"master={value!r}: use 'fp32' (default) or 'bf16' (for bf16 parameters)")
        return fmt


class RowCode(enum.Enum):
    """How one state row is stored; ``dtype``: the checkpoint's name for its elements."""
    FP32 = ("F32", 4, "")
    BF16 = ("BF16", 2, "")
    BF16_SR = ("BF16", 2, "stochastic")  # a master row: rounded stochastically
    SIGNED8 = ("I8", 1, "")
    SQRT8 = ("U8", 1, "")

    @property
    def dtype(self) -> str:
        return self.value[0]

    @property
    def itemsize(self) -> int:
        return self.value[1]

    @property
    def scaled(self) -> bool:
        return self in (RowCode.SIGNED8, RowCode.SQRT8)


_UNSIGNED_ROWS = ("exp_avg_sq", "max_exp_avg_sq")  # never negative: the unsigned code


def row_code(name: str, fmt: StateFormat, master: StateFormat = StateFormat.FP32) -> RowCode:
    if name == "master_param":
        return RowCode.BF16_SR if master is StateFormat.BF16 else RowCode.FP32
    if fmt is StateFormat.FP32:
        return RowCode.FP32
    if fmt is StateFormat.BF16:
        return RowCode.BF16
    return RowCode.SQRT8 if name in _UNSIGNED_ROWS else RowCode.SIGNED8


@dataclass(frozen=True)
class RowSpan:
    """Where one row rests in a shard's packed bytes: its elements, then (8-bit codes) its
    block scales."""
    code: RowCode
    at: int
    scales_at: int


@dataclass(frozen=True)
class FieldSpan:
    """A segment's bytes of one row in the packed shard: ``suffix`` "" for the elements,
    ".scales" for their block scales (``dtype`` "F32")."""
    suffix: str
    dtype: str
    at: int
    length: int


@dataclass(frozen=True)
class Packing:
    """A shard's rows as stored: ``plain`` (all fp32) rows are the ``rows x numel`` fp32
    tensor the update works in; the others a uint8 tensor of ``nbytes``."""
    codes: tuple[RowCode, ...]
    numel: int

    @property
    def plain(self) -> bool:
        return all(c is RowCode.FP32 for c in self.codes)

    def row_bytes(self, code: RowCode) -> int:
        return self.numel * code.itemsize + (self.numel // BLOCK * 4 if code.scaled else 0)

    @property
    def nbytes(self) -> int:
        return sum(self.row_bytes(c) for c in self.codes)

    def spans(self) -> list[RowSpan]:
        out, at = [], 0
        for code in self.codes:
            out.append(RowSpan(code, at, at + self.numel * code.itemsize))
            at += self.row_bytes(code)
        return out

    def fields(self, r: int, offset: int, length: int) -> list[FieldSpan]:
        """The bytes of elements ``[offset, offset + length)`` of row ``r``."""
        span = self.spans()[r]
        code = span.code
        out = [FieldSpan("", code.dtype, span.at + offset * code.itemsize, length * code.itemsize)]
        if code.scaled:
            out.append(FieldSpan(".scales", "F32", span.scales_at + offset // BLOCK * 4, -(-length // BLOCK) * 4))
        return out

    # -- coding ------------------------------------------------------------------------------
    def decode(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        """``packed`` (uint8, ``nbytes``) into ``out`` (fp32, ``rows x numel``)."""
        for r, span in enumerate(self.spans()):
            _decode_row(span.code, *self._views(packed, span), out[r])

    def encode(self, rows: torch.Tensor, packed: torch.Tensor) -> None:
        """``rows`` (fp32, ``rows x numel``; coded rows may be overwritten) into ``packed``. A master row is
        rounded to nearest here (its initial values, a load: the parameters' own rounding);
        an update rounds it stochastically first (``round_in_place``). The views are made
        outside inference mode where ``rows`` and ``packed`` are ordinary tensors: a dtype
        view made in it is an inference tensor, which the compiled loop leaves to the eager
        path (``_coding``)."""
        ordinary = not (rows.is_inference() or packed.is_inference())
        with lasting() if ordinary else contextlib.nullcontext():
            for r, span in enumerate(self.spans()):
                _encode_row(span.code, rows[r], *self._views(packed, span))

    def round_in_place(self, rows: torch.Tensor, pieces: list[tuple[int, int, int]]) -> None:
        """Round the stochastically rounded rows of ``rows`` (fp32) to the values they will
        rest as (``encode`` then stores them as they are): what a master row writes back to
        the parameters is then the master itself. ``pieces``: (first element in the row,
        elements, where in the dither table the first one draws: ``dither_at``)."""
        for r, span in enumerate(self.spans()):
            if span.code is RowCode.BF16_SR:
                for first, count, at in pieces:
                    _dithered(rows[r, first: first + count], at).bitwise_and_(-(1 << 16))

    def _views(self, packed: torch.Tensor, span: RowSpan) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = self.numel
        values = packed[span.at: span.at + n * span.code.itemsize]
        values = values.view(_TORCH[span.code])
        scales = packed[span.scales_at: span.scales_at + n // BLOCK * 4].view(torch.float32) \
            if span.code.scaled else None
        return values, scales


_TORCH = {RowCode.FP32: torch.float32, RowCode.BF16: torch.bfloat16, RowCode.BF16_SR: torch.bfloat16,
          RowCode.SIGNED8: torch.int8, RowCode.SQRT8: torch.uint8}
_PERIOD = 1 << 16
_DITHER = torch.randint(0, 1 << 16, (_PERIOD,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
_DITHER = torch.cat([_DITHER, _DITHER])  # (a window may wrap around: read as one slice)


def packing_for(names: list[str], fmt: StateFormat, numel: int, master: StateFormat = StateFormat.FP32) -> Packing:
    return Packing(tuple(row_code(n, fmt, master) for n in names), numel)


def dither_at(number: int, step: int, element: int) -> int:
    """Where in the dither table element ``element`` of parameter ``number`` (its place among
    the optimizer's) draws at update ``step``: the parameter's own, whatever shard holds it."""
    return ((number * 1_000_003 + step) * 2654435761 + element) % _PERIOD


def _dithered(x: torch.Tensor, at: int) -> torch.Tensor:
    """``x``'s bits (int32, in place) plus the dither below bf16's last kept bit: a carry
    into the kept bits comes with the probability of the dropped fraction (on the
    magnitude: sign and magnitude are separate in the bits). Values bf16 holds exactly
    (dropped bits zero) never carry."""
    bits = x.view(torch.int32)
    at %= _PERIOD
    whole = bits.numel() // _PERIOD * _PERIOD
    if whole:
        bits[:whole].view(-1, _PERIOD).add_(_DITHER[at: at + _PERIOD])
    if bits.numel() > whole:
        bits[whole:].add_(_DITHER[at: at + bits.numel() - whole])
    return bits


def _encode_row(code: RowCode, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None) -> None:
    if not code.scaled:
        values.copy_(x)
        return
    blocks = x.view(-1, BLOCK)
    unsigned = code is RowCode.SQRT8
    coded = code_blocks(unsigned, blocks, values.view(-1, BLOCK))
    if coded is not None and bool(torch.isfinite(coded[0]).all()):
        scales.copy_(coded[1])
        return
    # eagerly (no compiled loop; an inf or NaN moment: its block decodes to NaN), to the
    # loop's bits: the root correctly rounded, whose maximum is the maximum's root
    if unsigned:
        exact_root_(x)
    absmax = blocks.amax(1) if unsigned else torch.maximum(blocks.amax(1), blocks.amin(1).neg_())
    s = block_scales(absmax, TOP[unsigned])
    if not bool(torch.isfinite(absmax).all()):
        s[~torch.isfinite(absmax)] = float("nan")
        x.nan_to_num_(0.0, 0.0, 0.0)  # (casting them to an integer code is undefined)
    scales.copy_(s)
    inverse = torch.where(s > 0, 1.0 / s.clamp(min=torch.finfo(torch.float32).tiny), 0.0)  # exact: powers of two
    blocks.mul_(inverse[:, None]).round_()
    if unsigned:
        x.clamp_(min=1.0)  # no element codes to zero (a zero block decodes to zero through s = 0)
    values.copy_(x)


def _decode_row(code: RowCode, values: torch.Tensor, scales: torch.Tensor | None, out: torch.Tensor) -> None:
    out.copy_(values)
    if code.scaled:
        out.view(-1, BLOCK).mul_(scales[:, None])
        if code is RowCode.SQRT8:
            out.mul_(out)


def decode_piece(dtype: str, values: torch.Tensor, scales: torch.Tensor | None, numel: int) -> torch.Tensor:
    """One checkpoint piece's ``numel`` elements as fp32 (``values``: its bytes; ``scales``:
    the bytes of its block scales, blocks counted from its first element)."""
    code = next(c for c in RowCode if c.dtype == dtype)
    raw = values[: numel * code.itemsize].view(_TORCH[code])
    if not code.scaled:
        return raw.float()
    padded = -(-numel // BLOCK) * BLOCK
    out = torch.zeros(padded, dtype=torch.float32)
    out[:numel].copy_(raw)
    out.view(-1, BLOCK).mul_(scales[: padded // BLOCK * 4].view(torch.float32)[:, None])
    if code is RowCode.SQRT8:
        out.mul_(out)
    return out[:numel]
