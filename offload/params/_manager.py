"""wrap / unwrap: put a model's parameters in the store and hook it up."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from .._memory import resolve_allocator, tune_allocator
from .._plan import host_param_bytes, param_staging, plan_groups
from .._resolve import check_output_paths, choose_io_backend, resolve_engine
from .._tensors import made_lasting
from .._units import format_size
from ..activations import ActivationOffloader, offloader_for
from ..config import OffloadConfig
from ..store import Tier, TensorStore, create_store
from ._access import DemandAccess
from ._coordinator import Coordinator
from ._from_store import StoreCopies
from ._gathering import GatheredSlices
from ._gradients import close_holders
from ._groups import ParamGroup, point, slice_groups
from ._hooks import ModuleHooks
from ._inplace import InPlaceLayout, adopt_groups
from ._loading import CheckpointReader, beside_its_config, take_generation_config
from ._mapped import MappedViews
from ._replaced import replaced_slots
from ._materializer import Materializer
from ._originals import Originals
from ._placing import load_groups, move_buffers
from ._registry import forget, owner_of, register, within, wrapped_in
from ._sizing import check_partitioned, device_layout
from ._steplog import StepLog

__all__ = ["wrap", "unwrap", "close", "ParamManager"]

log = logging.getLogger(__name__)
_HOME = {"device": Tier.DEVICE, "host": Tier.HOST, "nvme": Tier.NVME}


class ParamManager:
    """Owns what wrap() set up for one model: its store, coordinator and hooks."""

    def __init__(self, model: nn.Module, config: OffloadConfig, store: TensorStore,
                 groups: list[ParamGroup], coordinator: Coordinator, hooks: ModuleHooks,
                 partition: Any = None, originals: Originals | None = None):
        # groups: what this process's store holds (with several ranks, its slice of each
        # group, see offload.distributed); the coordinator materializes the whole groups
        self.model, self.config, self.store = model, config, store
        self.groups, self.coordinator, self.hooks = groups, coordinator, hooks
        self.partition = partition
        self.activations: ActivationOffloader | None = hooks.activations
        self.slots = {id(slot.param): (group, slot) for group in groups for slot in group.slots}
        # several ranks: the whole group the coordinator materializes -> this rank's slice
        slices = {id(g.whole or g): g for g in groups}
        self.access = DemandAccess(coordinator, hooks, partition=partition,
                                   read_group=lambda whole: self.whole_bytes(slices[id(whole)]))
        # the fp32 values of trained parameters compute_dtype rounded, until an optimizer
        # takes them as masters; a write outside the optimizer makes them stale
        self.originals = originals if originals is not None else Originals(store)
        self.access.on_write(self._written_outside)
        self.steplog = StepLog(self)
        if self.steplog.tracer is not None:
            store.tracer = coordinator.tracer = self.steplog.tracer
            if self.activations is not None:
                self.activations.store.tracer = self.steplog.tracer

    def optimizer_step_done(self, seconds: float, *, lr: float, skipped: bool, moved: dict | None = None,
                            read_in_backward: int | None = None) -> None:
        """An offloaded optimizer's step over these parameters took ``seconds``: the step's record (``StepLog``)."""
        self.steplog.optimizer_step_done(seconds, lr=lr, skipped=skipped, moved=moved,
                                         read_in_backward=read_in_backward)

    def optimizer_time(self, seconds: float) -> None:
        """An optimizer worked ``seconds`` outside its ``step()`` (the update a step left to
        the next forward): counted in the step log's ``optimizer_seconds``."""
        self.steplog.optimizer_seconds += seconds

    @property
    def home(self) -> Tier:
        """The tier where parameter groups rest between uses."""
        return _HOME[self.config.param_tier]

    def host_staging_bytes(self) -> int:
        """Host bytes the parameter reads stage through while a pass streams from NVMe (the
        prefetch window and the largest group, within host_budget), the room an optimizer
        must leave free in the shared host pool."""
        if self.home is not Tier.NVME:
            return 0
        largest = max((g.nbytes for g in self.groups if not g.resident), default=0)
        return param_staging(self.config, self.coordinator.prefetch_limit, largest)

    @property
    def pending(self) -> Any:
        """The optimizers' writes owed to this model's groups (``_pending.PendingWrites``)."""
        return self.coordinator.pending

    def group_bytes(self, group: ParamGroup) -> torch.Tensor:
        """A host copy of ``group``'s current bytes (uint8)."""
        if self.pending:
            self.pending.ready(group)
        if group.resident:
            out = torch.empty(group.nbytes, dtype=torch.uint8)
            for slot in group.slots:
                out[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(slot.param.data)
            return out
        return self.store.read_copy(group.key)

    def on_params_written(self, callback: Any) -> None:
        """Call ``callback(group)`` (a bound method, held weakly) when a write outside the
        optimizer (``load_state_dict``, ``p.copy_(x)`` ...) changes the parameters of a
        group (the whole group, with several ranks)."""
        self.access.on_write(callback)

    def _written_outside(self, group: ParamGroup) -> None:
        writing = self.access.writing  # (a whole parameter written through demand fetch)
        for mine in self.groups:
            if (mine.whole or mine) is group:
                if writing is not None and any(s is writing[0] for s in mine.slots):
                    self.originals.replace(mine, writing[0], writing[1])
                else:
                    self.originals.forget(mine)

    def original_values(self, group: ParamGroup) -> dict[int, torch.Tensor] | None:
        """id(slot) -> the model's fp32 values of ``group``'s trained parameters that
        compute_dtype rounded, while kept (``_originals``); else None."""
        return self.originals.values(group)

    def keep_originals(self, group: ParamGroup, sources: dict[int, torch.Tensor]) -> None:
        """The model's values of ``group``'s trained parameters before the compute dtype
        rounded them (id(slot) -> tensor), for optimizers built after a load."""
        self.originals.forget(group)
        self.originals.keep(group, sources)

    def master_taken(self, group: ParamGroup, slot: Any) -> None:
        """An optimizer built ``slot``'s master weights: its kept values may go."""
        self.originals.taken(group, slot)

    def params_changed(self, group: ParamGroup) -> None:
        """``group``'s parameters were replaced by a caller other than the optimizer (a
        checkpoint load): optimizers keeping master copies refresh them."""
        self.access.notify(group.whole or group)

    def write_group(self, group: ParamGroup, data: torch.Tensor, *, update: bool = False) -> None:
        """Replace ``group``'s bytes (host uint8 ``data``) with new values, e.g. after an
        optimizer step (``update``); the old copies on the device are dropped."""
        if group.resident:
            for slot in group.slots:
                view = data[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
                slot.param.data.copy_(view)
            return
        self.coordinator.forget(group.whole or group, replaced="refuse" if update else "discard")
        # at home in host memory: written where it rests. A put would free the slot and take
        # another, and a read queued meanwhile (a shard read ahead) could take the room between
        lent = self.store.overwrite_in_place(group.key) if self.home is Tier.HOST else None
        if lent is None:
            self.store.put(group.key, data, self.home)
            return
        view, done = lent
        try:
            view.copy_(data[: group.nbytes])
        finally:
            done()

    def repoint_resident(self, group: ParamGroup) -> None:
        """Point the resident ``group``'s parameters at its device copy again, where one was
        p.set_() to other storage: a load writes that copy, and its values win (as torch's)."""
        flat = self.store.wait(group.key, Tier.DEVICE)
        for slot in group.slots:
            view = flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
            with torch._C.DisableTorchFunctionSubclass():
                if slot.nbytes and slot.param.data_ptr() != view.data_ptr():
                    point(slot.param, view)

    def whole_bytes(self, group: ParamGroup) -> torch.Tensor:
        """A host copy of the whole of ``group`` (one of ``self.groups``): with several ranks,
        every rank's slice gathered (a collective: every rank must call it, in the same
        order); else its bytes."""
        data = self.group_bytes(group)
        if self.partition is None:
            return data
        return self.partition.gather_bytes(data)[: group.whole.nbytes]


@made_lasting
def wrap(model: nn.Module, config: OffloadConfig, *, checkpoint: str | os.PathLike | None = None,
         process_group: Any = None) -> nn.Module:
    """Manage ``model``'s parameters as ``config`` says; returns the same module.

    ``checkpoint``: a safetensors file, a directory of shards with
    ``model.safetensors.index.json``, or a ``save_pretrained`` directory, streamed into the
    parameter tier (the model may then have been built on the meta device).
    ``process_group``: with torch.distributed initialised, the ranks to partition the
    parameters over (default: the default group; see ``OffloadConfig.world_size`` and
    docs/distributed.md). Every rank calls ``wrap`` with the same model and config.
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    checkpoint = os.fspath(checkpoint) if checkpoint is not None else None
    # (the model itself, a module inside it or one around it: its parameters would be managed twice)
    if within(model) or any(owner_of(p) is not None for p in model.parameters()):
        raise ValueError("this model is already wrapped, holds a wrapped module, or lies inside a wrapped model: "
                         "wrap one model once, or call offload.unwrap on the wrapped one first")
    from .. import distributed

    partition = distributed.resolve(config, process_group)
    nvme_path = distributed.local_nvme_path(config, partition)
    if partition is not None:  # first, so that every rank refuses alike
        distributed.check_ranks(partition, config, model, nvme_path, values=checkpoint is None)
    if nvme_path != config.nvme_path:
        config = config.replace(nvme_path=nvme_path)
    device = config.torch_device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"OffloadConfig(device={config.device!r}) but CUDA is not available: "
                         "use device='cpu'")
    check_output_paths(config)
    reader = CheckpointReader(checkpoint, model) if checkpoint is not None else None
    if reader is not None:  # (a single file's directory too, where it was saved beside its configs)
        take_generation_config(model, checkpoint if os.path.isdir(checkpoint) else
                               beside_its_config(model, checkpoint))
    if reader is None:
        meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if meta:
            raise ValueError(f"parameters {meta[:5]}{'...' if len(meta) > 5 else ''} are on the meta "
                             "device: pass checkpoint=PATH so wrap() can load their values")
    # several ranks: every group is partitioned, none stays whole on the device
    placing = InPlaceLayout(reader, config, partitioned=partition is not None)
    layout = device_layout(model, config, partitioned=partition is not None, place=placing)
    groups, needs, in_place = layout.groups, layout.needs, placing.choice
    mine = groups if partition is None else slice_groups(groups, partition)
    if partition is not None:
        check_partitioned(groups, config, mine)
    memory_plan = plan_groups(mine, config, ram_credit=host_param_bytes(model),
                              world=partition.world if partition is not None else 1,
                              room=layout.room(config.device_budget), in_place=in_place)
    log.info("%s", memory_plan)
    memory_plan.check()  # before the store, its buffers or its files exist
    tune_allocator(resolve_allocator(config.host_allocator, device.type))
    nvme_bytes = _nvme_bytes(mine, config, in_place)
    store = _make_store(config, nvme_bytes)
    activations = None
    try:
        streamed = sorted(g.nbytes for g in groups if not g.resident)
        median = streamed[len(streamed) // 2] if streamed else 0
        coordinator = Coordinator(store, groups, _materializer(store, config, partition, sum(streamed),
                                                               bool(in_place.adopted)),
                                  device=device, layout=layout,
                                  prefetch_limit=config.prefetch_limit(layout.room(config.device_budget), median),
                                  device_budget=config.device_budget, cache_bytes=config.cache_bytes)
        coordinator.schedule.guess_from(needs)  # (a first pass without an order would read in series)
        originals = Originals(store)
        adopt_groups(in_place, store)
        load_groups(model, groups, store, coordinator, _HOME[config.param_tier], reader, partition, originals,
                    frozenset(g.key for g in in_place.adopted))
        if reader is not None:
            log.info("offload: checkpoint %s: %s", checkpoint, in_place.describe())
        if partition is not None:  # after loading: it may have replaced meta parameters
            mine = slice_groups(groups, partition)
        move_buffers(model, device, reader)
        store.staging.trim()  # the staging buffers of loading are not needed again soon
        hooks = ModuleHooks(model, needs, coordinator)
        if config.activation_tier is not None:
            hooks.activations = activations = offloader_for(config)
        hooks.attach()
    except BaseException:
        if activations is not None:
            activations.close()
        store.close()
        raise
    manager = ParamManager(model, config, store, mine, coordinator, hooks, partition, originals)
    register(model, manager)
    manager.access.attach(model, groups)
    manager.steplog.start()  # the first step's line counts that step, not the loading above
    resident = [g for g in groups if g.resident]
    log.info("offload: %d parameter groups, %s, resting on %s (%d of them, %s, kept on the device); device budget "
             "%s, prefetch %s%s", len(groups), format_size(sum(g.nbytes for g in groups)), config.param_tier,
             len(resident), format_size(sum(g.nbytes for g in resident)), format_size(config.device_budget),
             format_size(coordinator.prefetch_limit),
             "" if partition is None else
             f"; partitioned over {partition.world} ranks, rank {partition.rank} keeps "
             f"{format_size(sum(g.nbytes for g in mine))}")
    return model


@made_lasting
def unwrap(model: nn.Module) -> nn.Module:
    """Parameters back as ordinary tensors on the config's device; files and threads released.

    Every parameter is copied into memory of its own, so the model must fit there; use
    :func:`close` to release a model that does not. If restoring fails (an I/O error), the
    files and threads are still released and the error is raised.
    """
    inner, manager = wrapped_in(model)  # (or the wrapped model inside: a PEFT model built after wrap)
    manager.pending.refuse_if_mixed()  # (before anything is released: a load can still mend them)
    try:
        manager.pending.settle()  # (a step's update still owed to the weights)
    except BaseException:
        _abandon_owed(manager)
        _release(inner, manager)
        raise
    # (after the settle, which raises where the owed update fails: closing would only log it)
    close_holders([s.param for g in manager.groups for s in g.slots], "offload.unwrap")
    try:
        manager.access.detach()
        manager.hooks.remove()
        manager.coordinator.release_all()
        if manager.partition is not None:  # every rank's slice gathered, group by group
            for group in manager.groups:
                whole = manager.whole_bytes(group)
                for slot in group.whole.slots:
                    data = whole[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
                    point(slot.param, data.to(manager.coordinator.device, copy=True))
            _release(inner, manager)
            return model
        for group in manager.groups:
            # (a parameter p.set_() to other storage keeps it, as torch's would; a resident
            # parameter's own data is its group's bytes, what set_ gave it included)
            replaced = {id(s): torch.Tensor.detach(s.param) for s in group.slots} if group.resident else \
                {id(slot): t for slot, t in replaced_slots(group, manager.coordinator.placeholder)}
            flat = manager.store.wait(group.key, Tier.DEVICE)
            for slot in group.slots:
                data = flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
                point(slot.param, replaced.get(id(slot), data).clone())  # own memory, not a store buffer
            flat = data = None  # (views of the buffer: the pool would not hand it to the next group)
            if not group.resident:
                manager.store.evict(group.key, Tier.DEVICE)
    except BaseException:
        _release(inner, manager)
        raise
    _release(inner, manager)
    return model


def close(model: nn.Module) -> None:
    """Release a wrapped model's files, threads and buffers without restoring its parameters.

    What to call after an error or an interrupt, or at the end of a run whose model does not
    fit in memory (save or export it first). Afterwards the model's parameters are empty
    tensors; ``offload.wrap`` may be called again on a new model with the same config and
    ``nvme_path``. ``model`` may be a module holding wrapped models (a PEFT model built after
    ``wrap``): each is closed. Closing a model that is not wrapped (or already closed) does
    nothing.
    """
    failed: BaseException | None = None
    for inner, manager in within(model):  # (each one, whatever the others raise)
        try:
            _close(inner, manager)
        except BaseException as error:  # noqa: BLE001 - raised after the others are closed
            failed = failed or error
    if failed is not None:
        raise failed


def _close(model: nn.Module, manager: ParamManager) -> None:
    try:
        try:  # a step's update still owed: the optimizer's states and weights finish it
            manager.pending.settle(reading=False)
        except Exception:  # noqa: BLE001 - closing goes on
            log.warning("offload.close: the last step's update could not finish", exc_info=True)
            _abandon_owed(manager)
        close_holders([s.param for g in manager.groups for s in g.slots], "offload.close", logging.INFO)
        manager.access.detach()
        manager.hooks.remove()
        for group in manager.groups:
            for slot in group.slots:
                slot.param.grad = None
                point(slot.param, torch.empty(0, dtype=slot.dtype, device=slot.param.device))
        for module in {id(m): m for m in [model, *manager.hooks.needs]}.values():  # (its empty weights would
            module.register_forward_pre_hook(_closed_forward)                     # fail in some layer)
    finally:
        _release(model, manager)


def _closed_forward(module: nn.Module, args: Any) -> None:
    raise RuntimeError(f"{type(module).__name__} was closed by offload.close(): its parameters were released (empty "
                       "tensors). Build and wrap the model again (with checkpoint=, or load a checkpoint saved "
                       "before close), or use offload.unwrap(model) instead of close to keep the values in memory")


def _abandon_owed(manager: ParamManager) -> None:
    """The update a step owes this model could not be written: the optimizers that owe it
    drop it (poisoned where it had begun) and stop asking this model's store."""
    try:
        manager.pending.abandon()
    except Exception:  # noqa: BLE001 - releasing the model goes on
        log.warning("offload: dropping the update a step owed this model failed", exc_info=True)


def _release(model: nn.Module, manager: ParamManager) -> None:
    """The store's files, threads and buffers released; the model no longer managed."""
    forget(model)
    manager.access.detach()
    try:
        try:
            if manager.activations is not None:
                manager.activations.close()
        finally:
            manager.store.close()
    finally:
        if manager.steplog.tracer is not None:
            log.info("offload: timeline written to %s (open in ui.perfetto.dev or chrome://tracing)",
                     manager.steplog.write_trace())


# -- helpers ------------------------------------------------------------------------------------
def _materializer(store: TensorStore, config: OffloadConfig, partition: Any, streamed_bytes: int,
                  in_place: bool) -> Materializer:
    """The one materializer of this model, for its whole life (see ``_materializer``).
    Groups read in place from a checkpoint have no mapping to view: with any of them the
    model copies (StoreCopies), which also prefetches and caches them."""
    home, budget = _HOME[config.param_tier], config.device_budget
    if partition is not None:
        return GatheredSlices(store, home, device_budget=budget, partition=partition)
    if not in_place and MappedViews.serves(store, config.torch_device, config.param_tier, streamed_bytes):
        return MappedViews(store, home, device_budget=budget)
    return StoreCopies(store, home, device_budget=budget)


def _nvme_bytes(groups: list[ParamGroup], config: OffloadConfig, in_place: Any) -> int:
    """The parameters the store will keep in swap files (what io_backend="auto" weighs:
    whether an optimizer will add states is not known yet; one that does warns when they
    make an mmap store outgrow its page-cache limit)."""
    return sum(r.nbytes for r in plan_groups(groups, config, in_place=in_place).rows if r.tier == "nvme")


def _make_store(config: OffloadConfig, nvme_bytes: int = 0) -> TensorStore:
    nvme = config.nvme_path if "nvme" in (config.param_tier, config.optimizer_tier) else None
    backend = "direct"
    if nvme is not None:
        backend, reason = choose_io_backend(config, nvme_bytes)
        log.info("offload: io_backend %s for %s (%s)", backend, nvme, reason)
    engine = resolve_engine(config)
    return create_store(device=config.device, device_budget=config.device_budget,
                        host_budget=config.host_budget, nvme_path=nvme, file_size=config.file_size,
                        block_size=engine.block_size, threads=engine.threads,
                        queue_depth=engine.queue_depth, io_backend=backend)
