"""What a save writes for the model: a wrapped group's flat buffer as one blob, small tensors
(buffers, a plain model's parameters, a torch optimizer's states) packed into blobs of up to
``PACK`` bytes, and the manifest entry of each tensor piece."""

from __future__ import annotations

from typing import Any

import torch

from ._catalog import Catalog, Tensorish, host_bytes
from ._format import dtype_name
from ._stream import Blob, Piece

__all__ = ["manifest_entry", "model_blobs", "packed", "PACK"]

PACK = 64 << 20  # small tensors are packed into blobs of up to this many bytes


def manifest_entry(name: str, t: Tensorish | None = None, **fields: Any) -> dict:
    """The manifest entry of a tensor piece named ``name`` (``t``: kind, dtype, shape, aliases)."""
    entry = {"name": name}
    if t is not None:
        entry.update(kind=t.kind, dtype=dtype_name(t.dtype), shape=list(t.shape))
        if t.aliases:
            entry["aliases"] = list(t.aliases)
    entry.update(fields)
    return entry


def model_blobs(cat: Catalog) -> list[Blob]:
    """The model's blobs: one per wrapped group (read from the store), then the rest packed."""
    blobs: list[Blob] = []
    by_group: dict[int, list[Tensorish]] = {}
    for t in cat.params:
        if t.group is not None:
            by_group.setdefault(id(t.group), []).append(t)
    for manager, group in cat.groups():
        store = manager.store
        pieces = [_slot_piece(t) for t in by_group[id(group)] if t.slot.count or not t.slot.nbytes]
        blobs.append(Blob("model.bin", group.nbytes,
                          lambda dest, key=group.key, store=store: store.read_into(key, dest), pieces,
                          borrow=lambda key=group.key, store=store: store.borrow_host(key)))
    loose = [t for t in cat.params if t.group is None] + cat.buffers
    blobs += packed("model.bin", [(t, manifest_entry(t.name, t)) for t in loose])
    return blobs


def _slot_piece(t: Tensorish) -> Piece:
    """A wrapped parameter's bytes in its group's blob; a rank's slice holding part of it
    records which elements (``start``, ``numel`` of the flattened parameter)."""
    slot = t.slot
    begin, end = slot.held
    if slot.whole is None:
        return Piece(manifest_entry(t.name, t), begin, end - begin)
    return Piece(manifest_entry(t.name, t, start=slot.first, numel=slot.count), begin, end - begin)


def packed(section: str, items: list[tuple[Any, dict]]) -> list[Blob]:
    """Blobs of up to ``PACK`` bytes, each a run of whole tensors copied in at fill time."""
    blobs: list[Blob] = []
    current: list[tuple[Any, dict, int]] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if not current:
            return
        members = current

        def fill(dest: torch.Tensor, members=members) -> None:
            for t, _, at in members:
                src = host_bytes(t.tensor if isinstance(t, Tensorish) else t)
                dest[at: at + src.numel()].copy_(src)

        blobs.append(Blob(section, size, fill, [Piece(e, at, _nbytes(t)) for t, e, at in members]))
        current, size = [], 0

    for t, entry in items:
        n = _nbytes(t)
        if current and size + n > PACK:
            close()
        at = -(-size // 256) * 256
        current.append((t, entry, at))
        size = at + n
    close()
    return blobs


def _nbytes(t: Any) -> int:
    if isinstance(t, Tensorish):
        return t.nbytes
    return t.numel() * t.element_size()
