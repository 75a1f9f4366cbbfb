"""One wrapped model's side of demand fetch: fetching a group for a single use, marking a
written group, ``state_dict()`` / ``load_state_dict()`` of the whole model group by group,
and refusing torch optimizers over its parameters.

A use inside a pass (a forward of the model, or a backward) is recorded in the pass's
order like a module's own use, so the next pass prefetches that group at that point; a use
between passes (printing a weight, a regularization term) is not, so it leaves the
recorded order alone.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from typing import Any, Callable

import psutil
import torch
from torch import nn

from .._units import format_size
from ..io import BudgetError
from .._autograd import in_backward
from ._addresses import ReservedAddresses
from ._conversions import install_conversion_guard
from ._coordinator import Coordinator
from ._demand import DetachedCopy, Owner, any_registered, owner_of_param, refuse_copy, register, unregister
from ._groups import ParamGroup

__all__ = ["DemandAccess"]

log = logging.getLogger(__name__)
_guard: Any = None  # the process-wide optimizer step pre-hook, registered at the first wrap


class DemandAccess:
    """Demand fetch for the parameters of one wrapped model (see ``_demand``)."""

    def __init__(self, coordinator: Coordinator, hooks: Any, *, read_group: Callable[[ParamGroup], torch.Tensor],
                 partition: Any = None):
        self.coordinator, self.hooks = coordinator, hooks
        self.read_group = read_group  # a host copy of a (whole) group's bytes
        self.partition = partition
        self.thread = threading.get_ident()  # the thread that wrapped the model, and trains it
        self.snapshots: dict[int, torch.Tensor] | None = None  # model.state_dict() in progress
        self._snapshot_group: tuple[ParamGroup, torch.Tensor] | None = None
        self._batch_open = False  # model.load_state_dict() in progress
        self._batch_group: ParamGroup | None = None  # the group it wrote last, held for the next write
        self._loaded: set[int] = set()  # ids of the parameters it wrote whole (a load mends mixed weights)
        self._listeners: list[weakref.WeakMethod] = []
        # while a write of one whole parameter runs: (its slot, the source of a copy_ or None),
        # so that what is kept of that parameter alone is updated (_originals)
        self.writing: tuple[Any, torch.Tensor | None] | None = None
        self._params: list[nn.Parameter] = []
        self._slots: list[Any] = []
        self._addresses = ReservedAddresses()
        self._handles: list[Any] = []
        coordinator.on_change = self._drop_snapshots  # the optimizer or a load replaces a group
        coordinator.on_written = self.notify  # its module wrote it in place

    # -- attach / detach -------------------------------------------------------------------
    def attach(self, model: nn.Module, groups: list[ParamGroup]) -> None:
        for group in groups:
            for slot in group.slots:
                register(slot.param, Owner(self, group, slot))
                self._params.append(slot.param)
                self._slots.append(slot)
        # (partials: torch marks some hooks with an attribute, which a bound method cannot
        # take; and a copy or pickle of the model meets this object, which refuses it)
        self._handles += [
            model.register_forward_pre_hook(functools.partial(DemandAccess._end_sessions_hook, self), prepend=True),
            model.register_state_dict_pre_hook(functools.partial(DemandAccess._state_dict_pre, self)),
            model.register_state_dict_post_hook(functools.partial(DemandAccess._state_dict_post, self)),
            model.register_load_state_dict_pre_hook(functools.partial(DemandAccess._load_pre, self)),
            model.register_load_state_dict_post_hook(functools.partial(DemandAccess._load_post, self))]
        _install_guard()
        install_conversion_guard()

    def detach(self) -> None:
        self._end_sessions()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for param in self._params:
            unregister(param)
        self._params.clear()
        self._slots.clear()
        self._addresses.close()

    def __deepcopy__(self, memo):
        refuse_copy()

    def __reduce_ex__(self, protocol):
        refuse_copy()

    def _end_sessions_hook(self, module: nn.Module, args: Any) -> None:
        self._end_sessions()

    def _end_sessions(self) -> None:
        """A state_dict() or load_state_dict() stopped by an exception leaves nothing behind
        (called again at every forward)."""
        self._end_batch()
        self.snapshots = self._snapshot_group = None

    # -- one use ---------------------------------------------------------------------------
    def owns(self, param: Any) -> bool:
        owner = owner_of_param(param)
        return owner is not None and owner.access is self

    def materialized(self, group: ParamGroup) -> bool:
        return group.resident or self.coordinator.flat_of(group) is not None

    def maybe_written(self, group: ParamGroup) -> None:
        """A ``.data`` alias of a materialized group was handed out: in-place writes through
        it bump no counter offload sees, so the group is stored back when released."""
        if not group.resident:
            self.coordinator.note_handed_out(group)

    def check_readable(self, owner: Owner) -> None:
        """With several ranks a fetch is an all-gather, which every rank must join: only the
        uses inside a forward or backward (the same code on every rank) can be served."""
        if self.partition is not None and not (self.hooks.forward_open() or in_backward()):
            raise RuntimeError(
                f"offloaded parameter {owner.name!r} (module {owner.module!r}) used outside a forward or "
                f"backward with the model partitioned over {self.partition.world} ranks: fetching it gathers "
                "it from every rank, which the other ranks would not join. Call offload.state_dict(model) on "
                "every rank for the weights")
    def acquire(self, group: ParamGroup) -> None:
        inside = bool(self.hooks.forward_open()) or in_backward()
        self.coordinator.acquire(group, "demand", record=inside)

    def release(self, group: ParamGroup) -> None:
        self.coordinator.release(group, "demand")

    def address_of(self, owner: Owner) -> int:
        """``data_ptr()`` of a parameter whose bytes are not in memory (``_addresses``)."""
        return self._addresses.address(owner.slot, self._slots)

    def buffer_address(self, group: ParamGroup) -> int:
        with torch._C.DisableTorchFunctionSubclass():
            return self.coordinator.flat_of(group).untyped_storage().data_ptr()

    def saving(self) -> Any:
        """What autograd saves in a demand call goes through the hooks' references, unless,
        inside a pass, hooks of another kind are on top (torch's non-reentrant checkpoint):
        those see the demand call's saves as they see the module's own ops'. Hidden from a
        checkpoint's hooks in the forward but not in its recompute (the group is held by
        then), the saves disagreed in number."""
        if not torch.is_grad_enabled():
            return contextlib.nullcontext()
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        foreign = top is not None and not isinstance(getattr(top[0], "__self__", None), type(self.hooks))
        if foreign and (self.hooks.forward_open() or in_backward()):
            return contextlib.nullcontext()
        return self.hooks.saving()  # (outside the passes: a view a user's hooks kept would go stale unseen)

    def check_writable(self, owner: Owner) -> None:
        if self.partition is not None and not owner.group.resident:
            raise RuntimeError(
                f"in-place write to offloaded parameter {owner.name!r} (module {owner.module!r}) with the model "
                f"partitioned over {self.partition.world} ranks: each rank holds a slice of it. Load new "
                "values with offload.load_checkpoint(path, model), or write them before offload.wrap")

    def written(self, group: ParamGroup) -> None:
        """The caller changed ``group``'s materialized bytes in place."""
        if not group.resident:
            self.coordinator.note_written(group)
        self.notify(group)

    def on_write(self, callback: Callable[[ParamGroup], None]) -> None:
        """Call ``callback(group)`` (a bound method, held weakly) after a write outside the
        optimizer changes a group's parameters."""
        # (the dead ones go here too: an optimizer built and dropped per run over one model)
        self._listeners = [ref for ref in self._listeners if ref() is not None]
        self._listeners.append(weakref.WeakMethod(callback))

    def _drop_snapshots(self, group: ParamGroup | None = None) -> None:
        if self.snapshots is not None:
            self.snapshots, self._snapshot_group = {}, None

    def notify(self, group: ParamGroup) -> None:
        """Tell the listeners (optimizers with master copies) that ``group`` was written."""
        self._drop_snapshots()
        alive = []
        for ref in self._listeners:
            callback = ref()
            if callback is not None:
                alive.append(ref)
                callback(group)
        self._listeners = alive

    # -- model.load_state_dict(): a group fetched once for all its parameters ----------------
    def keep_for_batch(self, group: ParamGroup) -> bool:
        """Within load_state_dict, keep the group just written for the parameters after it
        (their writes would fetch it again), until another group is fetched."""
        if not self._batch_open:
            return False
        self.drop_batch_group()
        self._batch_group = group
        return True

    def drop_batch_group(self) -> None:
        if self._batch_group is not None:
            group, self._batch_group = self._batch_group, None
            self.release(group)

    def _end_batch(self) -> None:
        self._batch_open = False
        self.drop_batch_group()

    def _load_pre(self, module, state_dict, prefix, local_metadata, *args) -> None:
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError("load_state_dict(..., assign=True) would replace the parameters of a model wrapped "
                               "by offload.wrap with the given tensors, outside its tiers: call it without "
                               "assign (the values are copied into the tiers), or unwrap the model first")
        self._end_batch()
        self._batch_open = True
        self._loaded.clear()

    def wrote_whole(self, slot: Any) -> None:
        """``slot``'s parameter was written whole (``copy_``), as a load writes it."""
        if self._batch_open:
            self._loaded.add(id(slot.param))

    def _load_post(self, module, incompatible_keys) -> None:
        self._end_batch()
        # weights a stopped step left mixed are whole again once the load wrote each of its
        # parameters (strict=False with some missing leaves them marked)
        self.coordinator.pending.mend(self._loaded, within={id(p) for p in self._params})
        self._loaded.clear()

    # -- model.state_dict(): copies in host memory, a group read at a time ---------------------
    def snapshot(self, owner: Owner) -> torch.Tensor:
        """A copy of a parameter's values, on the CPU (the whole model need not fit on the
        device), read with the rest of its group; the same tensor for each of its names."""
        param_id = id(owner.slot.param)
        if param_id in self.snapshots:
            return self.snapshots[param_id]
        cached = self._snapshot_group
        if cached is None or cached[0] is not owner.group:
            cached = self._snapshot_group = (owner.group, self.read_group(owner.group))
        slot = owner.slot.whole or owner.slot
        raw = cached[1][slot.offset: slot.offset + slot.nbytes]
        with torch._C.DisableTorchFunctionSubclass():
            value = raw.view(slot.dtype).view(slot.shape).clone() if slot.nbytes else \
                torch.empty(slot.shape, dtype=slot.dtype)
        out = self.snapshots[param_id] = DetachedCopy.of(value, owner)
        return out

    def _state_dict_pre(self, module, prefix, keep_vars) -> None:
        if keep_vars:
            return
        if self.partition is not None:
            raise RuntimeError(
                f"state_dict() of a model partitioned over {self.partition.world} ranks: each rank holds a slice "
                "of every group. Call offload.state_dict(model) on every rank (it gathers the groups), or save "
                "with offload.save_checkpoint / offload.export")
        owners = (owner_of_param(p) for p in self._params)
        need = sum(o.slot.nbytes for o in owners if o is not None and not o.group.resident)
        available = psutil.virtual_memory().available
        if need > available:
            raise BudgetError(
                f"state_dict() of a model wrapped by offload copies every parameter into host memory: "
                f"{format_size(need)} of offloaded parameters, {format_size(available)} of RAM available. "
                "Save it with offload.save_checkpoint(path, model) or offload.export(model, directory) "
                "(safetensors that from_pretrained loads), which stream a group at a time")
        if self.coordinator.pending:  # (finish a step's update owed to the next forward first: done group by
            self.coordinator.pending.settle()  # group as each is read, its reads ahead and the copies compete)
        self.snapshots, self._snapshot_group = {}, None

    def _state_dict_post(self, module, state_dict, prefix, local_metadata) -> None:
        self.snapshots = self._snapshot_group = None


# -- torch optimizers over offloaded parameters ----------------------------------------------------
def _install_guard() -> None:
    """At the first wrap: torch optimizers over offloaded parameters are refused when built
    (``add_param_group``, which ``__init__`` calls) and, for parameters made trainable since,
    at ``step()``."""
    global _guard
    if _guard is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _guard = register_optimizer_step_pre_hook(_refuse_torch_optimizer)
        original = torch.optim.Optimizer.add_param_group

        @functools.wraps(original)
        def add_param_group(self: Any, param_group: dict) -> None:
            original(self, param_group)
            try:
                _refuse_torch_optimizer(self, (), {}, groups=[param_group])
            except TypeError:
                # (add_param_group on a live optimizer: left as it was)
                self.param_groups[:] = [g for g in self.param_groups if g is not param_group]
                raise

        torch.optim.Optimizer.add_param_group = add_param_group


def _refuse_torch_optimizer(optimizer: Any, args: Any, kwargs: Any, groups: list | None = None) -> None:
    """A torch optimizer would keep its states on the device, outside every budget, and
    rewrite each streamed parameter through demand fetch several times a step: refused, with
    the optimizers that serve these parameters named."""
    if not any_registered():
        return
    inner = optimizer
    for _ in range(8):  # wrappers (Accelerate's AcceleratedOptimizer ...) keep it in .optimizer
        if getattr(type(inner), "serves_offloaded_parameters", False):
            return
        inner = getattr(inner, "optimizer", None)
        if inner is None:
            break
    for group in optimizer.param_groups if groups is None else groups:
        for p in group["params"]:
            owner = owner_of_param(p)
            if owner is not None and not owner.group.resident and p.requires_grad:  # (frozen: torch skips it)
                raise TypeError(
                    f"{type(optimizer).__name__} was given parameters of a model wrapped by offload.wrap (e.g. "
                    f"{owner.name!r}), which rest in offload's tiers between uses: a torch optimizer would keep "
                    "its states on the device outside the budgets and fetch and rewrite every parameter group "
                    "several times per step. Use offload.AdamW, offload.Adam or offload.SGD over "
                    "model.parameters() (with HF Trainer: optimizer_cls_and_kwargs=(offload.AdamW, dict(lr=...)), "
                    "which builds it with Trainer's decay groups and schedule, as its default); trainable "
                    "parameters added after wrap (LoRA adapters) may use any optimizer: pass only those, "
                    "[p for p in model.parameters() if p.requires_grad]")
