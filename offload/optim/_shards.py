"""The optimizer's book of parameters and shards: one record per parameter given to it
(``ParamEntry``), the shards they are laid out in, the placements (which store, what shares
its host budget) and the optimizer's own store for parameters of no wrapped model."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, NamedTuple

import torch

from ..accel import host_compute
from .._resolve import choose_io_backend, resolve_engine
from ..config import OffloadConfig
from ..params import holders_of, owner_of
from ..store import Residency, Tier, TensorStore, create_store
from ._formats import StateFormat
from ._layout import (SHARDS_IN_FLIGHT, Item, MasterMode, check_master_format, Owner, ParamEntry, Placement, Segment, Shard, cut,
                      master_mode)
from ._sizing import (check_host_budget, check_machine, cut_to_fit, device_staging_bytes, grad_room, params_at_home,
                      resting_bytes, wrapped_mode, write_back_bytes)

__all__ = ["ShardBook", "NewLayout"]

log = logging.getLogger(__name__)


def _owner(p: torch.Tensor) -> Owner | None:
    """The wrapped model, group and slot holding ``p``; None for a plain parameter."""
    found = owner_of(p)
    return Owner(*found) if found is not None else None


class NewLayout(NamedTuple):
    """Shards laid out and not yet part of the book, and the parameters they hold."""
    shards: list[Shard]
    entries: list[ParamEntry]


class ShardBook:
    """``rows_for(group_index)``: the state rows of a torch param group (its settings)."""

    def __init__(self, rows_for: Callable[[int], tuple[str, ...]], *, config: OffloadConfig | None,
                 shard_size: int | None, grad_tier: str, fmt: StateFormat = StateFormat.FP32,
                 master_fmt: StateFormat = StateFormat.FP32):
        if grad_tier not in ("auto", "host", "nvme"):
            raise ValueError(f"grad_tier={grad_tier!r}: use 'auto', 'host' or 'nvme'")
        if shard_size is not None and int(shard_size) < 1:
            raise ValueError(f"shard_size must be a positive number of elements, got {shard_size}")
        self.rows_for = rows_for
        self.config = config
        self.shard_size = int(shard_size) if shard_size is not None else None
        self.grad_tier = grad_tier
        self.fmt = fmt  # how the moment rows are stored (``_formats``)
        self.master_fmt = master_fmt  # how master rows are stored
        self.shards: list[Shard] = []
        self.entries: dict[int, ParamEntry] = {}  # id(param) -> its record
        self.placements: dict[int, Placement] = {}  # id(store) -> the latest placement there
        self.own_store: TensorStore | None = None
        # per store (id): the buffer coded shards are decoded into for their update, taken
        # from the store's pool once for the largest of them and held (``scratch``)
        self._scratch: dict[int, Any] = {}
        self._own_home = Tier.HOST

    # -- parameters ------------------------------------------------------------------------
    def register(self, p: torch.Tensor, group_index: int) -> ParamEntry:
        if p.device.type == "meta":
            raise ValueError("a parameter is on the meta device: wrap the model with "
                             "offload.wrap(model, cfg, checkpoint=...) before building the optimizer")
        entry = self.entries.get(id(p))
        if entry is None:
            entry = self.entries[id(p)] = ParamEntry(p, group_index, _owner(p), number=len(self.entries))
        return entry

    def segments(self, p: torch.Tensor) -> list[Segment]:
        entry = self.entries.get(id(p))
        return entry.segments if entry is not None else []

    def check_rows(self, optimizer: str, param_groups: list[dict]) -> None:
        """The state rows each shard was laid out with hold those its groups' settings need
        now (checked where an update is decided: ``step()``, ``update_during_backward()``):
        a setting that adds a row after the first step (momentum from 0, as OneCycleLR's
        cycle_momentum sets it; amsgrad turned on) would have no row to update. A row no
        longer used is kept, as torch keeps it (the rows are in order: the used come first)."""
        for shard in self.shards:
            for gi in {seg.group_index for seg in shard.segments}:
                want = tuple(self.rows_for(gi))
                if want != tuple(shard.names)[:len(want)]:
                    raise ValueError(
                        f"{optimizer}: param group {gi}'s settings now need the state rows {list(want)}, but it "
                        f"was laid out with {list(shard.names)} (a setting such as momentum or amsgrad changed "
                        "from the value the optimizer was built with, e.g. by a scheduler's cycle_momentum). "
                        "Build the optimizer with the setting the run will use (a non-zero momentum, "
                        "amsgrad=True); offload lays out its states once")

    def plain_params(self) -> Iterator[torch.Tensor]:
        return (e.param for e in self.entries.values() if e.owner is None)

    def managers(self, shards: list[Shard] | None = None) -> set:
        """The ParamManagers of the wrapped models whose parameters ``shards`` (all) hold."""
        return {s.segments[0].owner.manager for s in (self.shards if shards is None else shards) if s.wrapped}

    def logged_by(self) -> set:
        """The ParamManagers whose step log this optimizer's step ends: of the wrapped models
        whose parameters it holds, and of those holding its plain parameters in their
        modules (adapters added after ``wrap``)."""
        return self.managers() | holders_of(self.plain_params())

    def partition(self) -> Any:
        """The partition of the wrapped model this optimizer serves, if several ranks."""
        for manager in {e.owner.manager for e in self.entries.values() if e.owner is not None}:
            if manager.partition is not None:
                return manager.partition
        return None

    def check_managers(self) -> None:
        configs = {e.owner.manager.config for e in self.entries.values() if e.owner is not None}
        if len(configs) > 1:
            raise ValueError("the parameters come from wrapped models with different configs "
                             f"({len(configs)}): build one optimizer per model (models with a tier on NVMe each "
                             "need a config of their own, with its own nvme_path), or wrap a module holding them "
                             "all once (nn.ModuleDict)")

    # -- layout ----------------------------------------------------------------------------
    def lay_out(self) -> NewLayout | None:
        """Shards for the parameters not laid out yet (checked against the budgets and the
        machine before anything is allocated), None when there are none; the caller stores
        their initial states, then ``commit``s them (or ``discard``s them on a failure)."""
        todo = [e for e in self.entries.values() if not e.laid_out]
        if not todo:
            return None
        wrapped = [e for e in todo if e.owner is not None]
        plain = [e for e in todo if e.owner is None]
        partitioned = self.partition() is not None or any(
            m.partition is not None for m in holders_of(e.param for e in plain))  # (adapters on a partitioned base)
        if partitioned and (plain or any(not s.wrapped for s in self.shards)):
            raise ValueError(
                "with several ranks, an offload optimizer takes only parameters of the wrapped model "
                f"({len(plain) or 'some'} given are not): their gradients would not be averaged over the "
                "ranks. Wrap the module that holds them too (PEFT: get_peft_model before offload.wrap, on a "
                "model built with its weights), or give them to an optimizer of their own after averaging "
                "their gradients yourself (torch.distributed.all_reduce)")
        # a wrapped model's parameters in the order of its groups and slots
        wrapped.sort(key=lambda e: (id(e.owner.manager), e.owner.manager.groups.index(e.owner.group),
                                    e.owner.group.slots.index(e.owner.slot)))
        placements: dict[int, Placement] = {}
        items = [self._item(e, placements) for e in wrapped + plain]

        def cut_all(room: dict[int, int], cap: int | None, split: bool) -> list[Shard]:
            size = self.shard_size if self.shard_size is not None else cap
            shards = cut([it for it in items if it.owner is not None], first_index=len(self.shards),
                         shard_size=size, grad_room=room, split_groups=split)
            return shards + cut([it for it in items if it.owner is None], first_index=len(self.shards) + len(shards),
                                shard_size=size, grad_room=room)

        slack: dict[int, int] = {}
        new = cut_to_fit(cut_all, grad_room(items, self.grad_tier), self.grad_tier,
                         lambda shards: slack.update(check_host_budget(shards + self.shards, self.placements)),
                         sized=self.shard_size is not None)
        check_machine(new)
        # a pool buffer reused larger than asked takes room the sizing gave to others: at
        # most what the budget leaves beyond the step's needs, from the states' first put on
        # (the least of the optimizers' over one model: each counts only its own shards)
        for key, room in slack.items():
            store = self.placements[key].store
            if store is not None:
                capped = store.staging.max_inflation
                store.tiers[Tier.HOST].limit_slack(room if capped is None else min(capped, room))
        return NewLayout(new, todo)

    def commit(self, new: NewLayout) -> None:
        """The new shards' states are stored: they join the book."""
        by_param = {id(e.param): e for e in new.entries}
        for shard in new.shards:
            for seg in shard.segments:
                by_param[id(seg.param)].segments.append(seg)
        for e in new.entries:
            e.laid_out = True
        self.shards.extend(new.shards)
        self.take_scratch()
        _warm_pools(new.shards)

    def discard(self, new: NewLayout) -> None:
        """Storing the new shards' states failed: drop what was stored of them."""
        for shard in new.shards:
            for key in (shard.state_key, shard.grad_key):
                if shard.store is not None and not shard.store.closed and key in shard.store:
                    shard.store.delete(key)

    def scratch(self, store: Any) -> Any:
        """The buffer a coded shard of ``store`` is decoded into for its update (None where
        no shard there is coded). Held from the layout on, so an update never waits for
        pool room that the shards read ahead of it hold."""
        return self._scratch.get(id(store))

    @contextlib.contextmanager
    def scratch_released(self) -> Iterator[None]:
        """Give the decode buffers back to the pools while no update runs (a checkpoint
        load decodes its coded rows into a buffer of its own), and take them again after."""
        self._release_scratch()
        try:
            yield
        except BaseException:
            try:  # (after a failed load, which poisons the optimizer: a later load takes it again)
                self.take_scratch(wait=1)
            except Exception:  # noqa: BLE001 - the load's own error is the one to raise
                log.warning("offload: the decode buffer could not be taken back after a failed load", exc_info=True)
            raise
        self.take_scratch()

    def _release_scratch(self) -> None:
        for key, buf in list(self._scratch.items()):
            store = next(s.store for s in self.shards if id(s.store) == key)
            if not store.closed:
                store.staging.release(buf)
        self._scratch.clear()

    def take_scratch(self, wait: float = 60) -> None:
        need: dict[int, tuple[Any, int]] = {}
        for s in self.shards:
            if s.scratch_bytes and s.scratch_bytes > need.get(id(s.store), (None, 0))[1]:
                need[id(s.store)] = (s.store, s.scratch_bytes)
        for key, (store, nbytes) in need.items():
            held = self._scratch.get(key)
            if held is not None and held.nbytes >= nbytes:
                continue
            if held is not None:
                store.staging.release(self._scratch.pop(key))
            # (the host budget was checked with it: a timeout means other users hold the pool)
            self._scratch[key] = store.staging.acquire(nbytes, timeout=wait)

    def reserved(self, store: Any) -> int:
        """Host bytes of ``store``'s pool that shards read ahead must leave free: what compute
        on a device needs, and the staging that writes a parameter group back (``Placement``)."""
        placement = self.placements.get(id(store))
        return placement.device_staging + placement.write_back if placement is not None else 0

    def _item(self, entry: ParamEntry, placements: dict[int, Placement]) -> Item:
        p, names = entry.param, tuple(self.rows_for(entry.group_index))
        if entry.owner is not None:
            manager, slot = entry.owner.manager, entry.owner.slot
            placement = placements.get(id(manager)) or placements.setdefault(id(manager), self._placement(manager))
            master = wrapped_mode(entry.owner, manager.home, host_compute(manager.config.torch_device))
            start, stop = slot.first, slot.first + slot.count  # (several ranks: this rank's elements)
        else:
            placement = self._own_placement()
            master = master_mode(p.dtype, resident=False, group_fp32=False, param_home=None,
                                 cpu=host_compute(p.device))
            start, stop = 0, p.numel()
        row = master is MasterMode.ROW
        if row:
            check_master_format(self.master_fmt, entry.owner.slot.dtype if entry.owner else p.dtype, tuple(p.shape))
        return Item(p, entry.group_index, entry.owner, len(names), row, placement, start, stop,
                    fmt=self.fmt, names=names, master_fmt=self.master_fmt, number=entry.number)

    def _placement(self, manager: Any) -> Placement:
        store = manager.store
        resting = sum(resting_bytes(s) for s in self.shards if s.store is store)
        placement = Placement(store, id(store), Tier.parse(manager.config.optimizer_tier),
                              store.tiers[Tier.HOST].budget, write_back_bytes(manager.groups, manager.home),
                              manager.host_staging_bytes(), resting=resting, param_home=manager.home,
                              device_staging=device_staging_bytes(manager.groups, manager.config.torch_device,
                                                                  manager.home,
                                                                  partitioned=manager.partition is not None),
                              params=params_at_home(manager.groups, manager.home))
        self.placements[id(store)] = placement
        return placement

    def _own_placement(self) -> Placement:
        store = self._own()
        placement = Placement(store, id(store), self._own_home, store.tiers[Tier.HOST].budget)
        self.placements[id(store)] = placement
        return placement

    def _own(self) -> TensorStore:
        """The store of the states of parameters of no wrapped model (``config``'s tier;
        default: host memory without a budget)."""
        if self.own_store is not None:
            return self.own_store
        cfg = self.config
        if cfg is None:
            self.own_store = create_store(device="cpu", device_budget=1, host_budget=1 << 62)
            return self.own_store
        nvme = cfg.nvme_path if cfg.optimizer_tier == "nvme" else None
        backend = "direct"
        if nvme is not None:
            states = 4 * sum((len(self.rows_for(e.group_index)) + 1) * e.param.numel()
                             for e in self.entries.values() if e.owner is None)
            backend, reason = choose_io_backend(cfg, states)
            log.info("offload: optimizer states on %s through io_backend %s (%s)", nvme, backend, reason)
        engine = resolve_engine(cfg)
        self.own_store = create_store(device="cpu", device_budget=1, host_budget=cfg.host_budget,
                                      nvme_path=nvme, file_size=cfg.file_size, block_size=engine.block_size,
                                      threads=engine.threads, queue_depth=engine.queue_depth, io_backend=backend)
        self._own_home = Tier.parse(cfg.optimizer_tier)
        return self.own_store

    def synchronize(self) -> None:
        """Wait until the step's write-backs have reached their tier; a write that failed
        keeps its bytes in host memory with the error: report it here (the next step would
        meet it when it reads them)."""
        for store in {id(s.store): s.store for s in self.shards}.values():
            store.flush_all_behind()  # (parameter groups an update held in host memory)
            store.drain()
        for shard in self.shards:
            if shard.home is Tier.NVME and shard.rows and \
                    shard.store.state(shard.state_key, Tier.HOST) is Residency.RESIDENT:
                shard.store.wait(shard.state_key, Tier.HOST)
        for manager in self.managers():
            for group in manager.groups:
                if not group.resident and manager.store.state(group.key, Tier.HOST) is Residency.RESIDENT:
                    manager.store.wait(group.key, Tier.HOST)

    def close(self) -> None:
        self._release_scratch()
        for shard in self.shards:
            for key in (shard.state_key, shard.grad_key):
                if key in shard.store:
                    shard.store.delete(key)
        if self.own_store is not None:
            self.own_store.close()


def _warm_pools(shards: list[Shard]) -> None:
    """Make now, in each store's host pool, the buffers the step reads shards into, and
    leave them cached there for the step to reuse: the pool has its working size from the
    first step and RSS is flat from there. Otherwise the pool adds a buffer the first time
    the disk falls behind and one shard more than usual is in flight (seen at step 9 of
    GPT-2 124M). One more than ``SHARDS_IN_FLIGHT`` of the largest, where the budget has
    room for them next to what the pool holds already; none is taken from other sizes."""
    by_store: dict[int, list[Shard]] = {}
    for shard in shards:
        if shard.host_reads:
            by_store.setdefault(id(shard.store), []).append(shard)
    for group in by_store.values():
        pool = group[0].store.staging
        largest = sorted(group, key=lambda s: s.bytes_in_flight, reverse=True)[: SHARDS_IN_FLIGHT + 1]
        sizes = [n for s in largest for n in (s.state_bytes if s.rows else 0, s.grad_bytes if s.reads_grad else 0) if n]
        held = []
        try:
            for size in sizes:
                if pool.held_bytes + size > pool.budget:
                    break
                buf = pool.try_acquire(size)
                if buf is None:
                    break
                held.append(buf)
        finally:
            for buf in held:
                pool.release(buf)
