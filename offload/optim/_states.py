"""A shard's state rows in the store: their names, the initial values, reads and writes, and
the master rows, which follow writes to the parameters made outside the optimizer."""

from __future__ import annotations

import torch

from ._layout import Segment, Shard
from ._shards import ShardBook

__all__ = ["StateRows"]


class StateRows:
    def __init__(self, book: ShardBook):
        self.book = book
        # parameter groups written outside the optimizer since the master rows were made
        # (load_state_dict, p.copy_(...)): their master rows are refreshed before next use
        self._written: set[int] = set()
        self._listening: set[int] = set()  # ids of the managers that report such writes to us

    def names(self, shard: Shard) -> list[str]:
        rows = list(self.book.rows_for(shard.segments[0].group_index))
        return (["master_param"] if shard.master else []) + rows

    def write(self, shard: Shard, rows: torch.Tensor) -> None:
        """Store ``rows`` (``rows x numel``, fp32; coded rows overwrite it) as the shard's states."""
        if not shard.rows:
            return
        if shard.packed:
            packing = shard.packing
            resting = shard.store.overwrite_in_place(shard.state_key) if shard.state_key in shard.store else None
            if resting is not None:  # (coded straight into the rows where they rest: no second copy)
                view, done = resting
                try:
                    packing.encode(rows, view[: packing.nbytes])
                finally:
                    done()
                return
            packed = torch.empty(packing.nbytes, dtype=torch.uint8)
            packing.encode(rows, packed)
            rows = packed
        shard.store.put(shard.state_key, rows, shard.home)

    def read(self, shard: Shard) -> torch.Tensor:
        """A copy of the shard's rows (``rows x numel``, fp32; coded rows decoded)."""
        if not shard.rows:
            return torch.empty(0, shard.numel)
        stored = shard.store.read_copy(shard.state_key)
        if not shard.packed:
            return stored
        rows = torch.empty(shard.rows, shard.numel, dtype=torch.float32)
        shard.packing.decode(stored, rows)
        return rows

    def current_values(self, seg: Segment) -> torch.Tensor:
        """The parameter's values as a master starts from: the model's own, before a
        narrower compute dtype rounded them, while the wrapped model keeps them."""
        if seg.owner is None:
            return seg.param.detach().reshape(-1)[seg.start: seg.start + seg.length].float().cpu()
        manager, group, slot = seg.owner
        originals = manager.original_values(group)
        if originals is not None and id(slot) in originals:
            return originals[id(slot)][seg.start: seg.start + seg.length]
        begin, end = slot.elements(seg.start, seg.length)
        return manager.group_bytes(group)[begin: end].view(slot.dtype).float()

    def init(self, shards: list[Shard]) -> None:
        """Store the initial states of new shards: zero moments, masters from the current
        values; then tell the wrapped models their kept originals may go."""
        for shard in shards:
            rows = torch.zeros(shard.rows, shard.numel, dtype=torch.float32)
            if shard.master:
                cache: dict[int, tuple] = {}  # a group's bytes read once for its segments
                for seg in shard.segments:
                    rows[0, seg.offset: seg.offset + seg.length].copy_(self._initial(seg, cache))
            self.write(shard, rows)
            if shard.wrapped:
                shard.store.put(shard.grad_key, torch.zeros(shard.numel, dtype=torch.float32), shard.grad_home)
        self.masters_taken(shards)  # after every new shard has its masters (a group may span shards)

    def _initial(self, seg: Segment, cache: dict) -> torch.Tensor:
        if seg.owner is None:
            return self.current_values(seg)
        manager, group, slot = seg.owner
        data, originals = cache.get(id(group)) or cache.setdefault(
            id(group), (manager.group_bytes(group), manager.original_values(group)))
        if originals is not None and id(slot) in originals:  # the model's values before rounding
            return originals[id(slot)][seg.start: seg.start + seg.length]
        begin, end = slot.elements(seg.start, seg.length)
        return data[begin: end].view(slot.dtype)

    # -- masters and writes from outside -----------------------------------------------------
    def listen(self, manager) -> None:
        if id(manager) not in self._listening:
            self._listening.add(id(manager))
            manager.on_params_written(self._params_written)

    def _params_written(self, group) -> None:
        self._written.add(id(group))

    def refresh_masters(self) -> None:
        """Master rows of parameter groups written outside the optimizer take the new values
        (as a torch optimizer, which has no master copy, would compute from them)."""
        if not self._written:
            return
        written, self._written = self._written, set()
        for shard in self.book.shards:
            if not shard.master or not shard.wrapped:
                continue
            segs = [seg for seg in shard.segments if id(seg.owner.group.whole or seg.owner.group) in written]
            if not segs:
                continue
            rows = self.read(shard)
            for seg in segs:
                master, new = rows[0, seg.offset: seg.offset + seg.length], self.current_values(seg)
                if seg.owner.slot.dtype != torch.float32:  # (an element written as the master's own rounding
                    # keeps the master: a model state dict loaded after the optimizer's carries nothing new)
                    new = torch.where(master.to(seg.owner.slot.dtype).float() == new, master, new)
                master.copy_(new)
            self.write(shard, rows)
        self.masters_taken()

    def masters_taken(self, shards: list[Shard] | None = None) -> None:
        """The master rows of ``shards`` (default: all) are built: the wrapped models may
        drop the original values they kept for them."""
        for shard in self.book.shards if shards is None else shards:
            for seg in shard.segments:
                if seg.owner is not None:
                    seg.owner.manager.master_taken(seg.owner.group, seg.owner.slot)

    def forget_writes(self) -> None:
        """The master rows were just loaded (a checkpoint): earlier writes are superseded."""
        self._written.clear()
