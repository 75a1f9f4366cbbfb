"""How a wrapped model's parameters use the device budget: which groups stay resident, how
many streamed bytes are held at once, and the refusals (with the budget that runs) when the
budget cannot hold them.

Note: held at once. A module's groups stay materialized while it runs, and its children run
inside it, so the device holds, at a module, its groups and those of every module around it
(a Mamba mixer's own ``A_log`` and ``D`` while ``in_proj`` loads; a tied ``lm_head`` needs the
embedding's group). Each group is a slot of the device tier, rounded up (4 KiB pages on a
CPU device, 512 bytes on CUDA). What the budget must hold is the resident groups plus the
largest such nest; the prefetch window and the cache take only what is left.

Note: defaults yield. ``resident_bytes="auto"`` (the default) keeps modules under 64 KiB on
the device only as far as the budget allows: the largest resident groups are streamed
instead until the rest fits. A value set explicitly is kept, and refused when it cannot fit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .._units import format_apart, format_size
from ..config import OffloadConfig
from ..io import BudgetError
from ..store import Tier, device_slot_size, host_slot_size
from ._groups import ParamGroup, build_groups

__all__ = ["DeviceLayout", "Nests", "device_layout", "check_partitioned", "no_room_error", "remeasured"]

AUTO_RESIDENT = 64 << 10  # what resident_bytes="auto" starts from


class Nests:
    """The sets of streamed groups held at once (one per module: its groups and those of
    the modules around it), in device bytes; what a pass needs when some groups are kept
    on the device anyway (cached) and so need no room of their own."""

    def __init__(self, sizes: dict[int, int]):
        self.sizes = sizes  # id(group) -> device bytes
        self.totals: list[int] = []
        self.where: dict[int, list[int]] = {}  # id(group) -> the nests holding it
        self.names: list[str] = []
        self.members: list[frozenset[int]] = []

    def add(self, name: str, groups: frozenset[int]) -> None:
        index = len(self.totals)
        self.totals.append(sum(self.sizes[g] for g in groups))
        self.names.append(name or "<root>")
        self.members.append(groups)
        for g in groups:
            self.where.setdefault(g, []).append(index)

    def largest(self, cached: frozenset[int] = frozenset()) -> tuple[int, str]:
        """The most bytes held at once besides the ``cached`` groups, and where."""
        if not self.totals:
            return 0, ""
        totals = list(self.totals)
        for g in cached:
            for i in self.where.get(g, ()):
                totals[i] -= self.sizes[g]
        best = max(range(len(totals)), key=totals.__getitem__)
        return totals[best], self.names[best]


@dataclass
class DeviceLayout:
    """The groups of a model and what they take of the device budget."""

    groups: list[ParamGroup]
    needs: dict[nn.Module, list[ParamGroup]]
    resident_bytes: int  # the threshold used: groups below it stay on the device
    resident: int  # device bytes the resident groups take (rounded to the tier's slots)
    held: int  # most device bytes of streamed groups in use at once (rounded)
    held_at: str  # the module where that many are held
    nests: Nests | None = None
    refusal: BudgetError | None = None  # what wrap refuses of this layout (kept by device_layout(check=False))
    auto: bool = False  # the threshold was chosen (resident_bytes="auto"): a larger budget keeps more resident
    model: Any = None  # a weak reference to the model measured (``remeasure``)
    layers: tuple = ()  # its layers that can turn activation checkpointing on (transformers')
    checkpointing: tuple = ()  # which of them had it on when measured
    refused: tuple | None = None  # (held, where) of the last measure the budget could not hold

    def could_keep(self, slot_size: Callable[[int], int]) -> int:
        """Device bytes a larger budget would keep resident beyond today's under "auto":
        the streamed groups below the threshold it starts from (a bound)."""
        if not self.auto:
            return 0
        return sum(slot_size(g.nbytes) for g in self.groups if not g.resident and g.nbytes < AUTO_RESIDENT)

    def need_with_cached(self, cached: list[ParamGroup]) -> int:
        """Device bytes a pass needs besides the ``cached`` groups (kept on the device)."""
        if self.nests is None:
            return self.resident + self.held
        return self.resident + self.nests.largest(frozenset(id(g) for g in cached))[0]

    @property
    def need(self) -> int:
        """Device bytes that must fit in the budget for a pass to run."""
        return self.resident + self.held

    def remeasure(self, slot_size: Callable[[int], int], budget: int) -> bool:
        """Measure what a pass holds at once again if activation checkpointing was turned
        on or off in the model since (``gradient_checkpointing_enable()`` after ``wrap``, as
        Trainer does): True when it was. A measure that does not fit ``budget`` is not kept
        (the refusal comes again at the next pass, until the setting or the budget changes)."""
        model = self.model() if self.model is not None else None
        flags = tuple(_checkpointed(m) for m in self.layers)
        if model is None or flags == self.checkpointing:
            return False
        nests = _nests(model, self.needs, slot_size)
        held, where = nests.largest()
        if self.resident + held <= budget:
            self.checkpointing, self.nests, self.held, self.held_at = flags, nests, held, where
        else:
            self.refused = (held, where)
        return True

    def room(self, budget: int) -> int:
        """What the budget leaves for the prefetch window and the cache."""
        return max(0, budget - self.need)


def device_layout(model: nn.Module, config: OffloadConfig, *, partitioned: bool = False,
                  check: bool = True, place: Callable[[list[ParamGroup]], None] | None = None) -> DeviceLayout:
    """The groups ``wrap`` makes of ``model`` under ``config``, with the resident threshold
    chosen (``resident_bytes="auto"``) or checked (set explicitly) against the device budget.
    With ``check`` a budget that cannot run is refused with the budget that would; without,
    the refusal is kept in ``layout.refusal`` (``offload.plan`` lists it as a problem: the
    plan and ``wrap`` apply one rule). ``place(groups)`` may lay the groups out anew before
    anything is measured (the groups read in place from a checkpoint:
    ``offload.params.InPlaceLayout``)."""
    fixed = config.param_tier == "device" or partitioned  # every group resident, or none
    explicit = config.resident_bytes != "auto"
    threshold = 0 if fixed else (int(config.resident_bytes) if explicit else AUTO_RESIDENT)
    layout = _measure(model, config, threshold, place)
    if not fixed and not explicit:
        while layout.need > config.device_budget and layout.resident:
            threshold = max(g.nbytes for g in layout.groups if g.resident)  # it and larger stream
            layout = _measure(model, config, threshold, place)
    if config.param_tier == "device" and not partitioned:
        for group in layout.groups:
            group.resident = True
        layout.resident = sum(device_slot_size(config.device, g.nbytes) for g in layout.groups)
        layout.held, layout.held_at, layout.nests = 0, "", None
    layout.auto = not fixed and not explicit
    if not partitioned:
        layout.refusal = _refusal(model, config, layout, explicit, place)
        if check and layout.refusal is not None:
            raise layout.refusal
    return layout


def _measure(model: nn.Module, config: OffloadConfig, threshold: int,
             place: Callable[[list[ParamGroup]], None] | None = None) -> DeviceLayout:
    groups, needs = build_groups(model, dtype=config.dtype, group_bytes=config.group_bytes,
                                 resident_bytes=threshold)
    if place is not None:
        place(groups)
    resident = sum(device_slot_size(config.device, g.nbytes) for g in groups if g.resident)
    nests = _nests(model, needs, lambda n: device_slot_size(config.device, n))
    held, where = nests.largest()
    layers = tuple(m for m in model.modules() if _can_checkpoint(m))
    return DeviceLayout(groups, needs, threshold, resident, held, where, nests, model=weakref.ref(model),
                        layers=layers, checkpointing=tuple(_checkpointed(m) for m in layers))


def _nests(model: nn.Module, needs: dict[nn.Module, list[ParamGroup]], slot_size: Callable[[int], int]) -> Nests:
    """The streamed groups held at each module that adds some: its own and its enclosing modules'."""
    nests = Nests({id(g): slot_size(g.nbytes) for groups in needs.values() for g in groups if not g.resident})

    def visit(module: nn.Module, name: str, held: frozenset[int]) -> None:
        new = {id(g) for g in needs.get(module, []) if not g.resident} - held
        if new:
            held = held | new
            nests.add(name, held)
        if _checkpointed(module):  # recomputed in backward: its groups are all kept until it is done
            inside = {id(g) for m in module.modules() for g in needs.get(m, []) if not g.resident}
            nests.add(f"{name} (checkpointed)", held | inside)
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, held)

    visit(model, "", frozenset())
    return nests


def _can_checkpoint(module: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


def _checkpointed(module: nn.Module) -> bool:
    """A transformers layer with gradient checkpointing on (``gradient_checkpointing_enable()``
    before ``wrap``; after it, ``DeviceLayout.remeasure``). Checkpointing set up otherwise is
    met at run time, where a refusal names the budget that holds what that point of the pass
    needs."""
    return getattr(module, "gradient_checkpointing", False) is True and _can_checkpoint(module)


def _refusal(model: nn.Module, config: OffloadConfig, layout: DeviceLayout, explicit: bool,
             place: Callable[[list[ParamGroup]], None] | None = None) -> BudgetError | None:
    """Why ``layout`` cannot run under ``config`` (the error naming the budget that would), or None."""
    budget = config.device_budget
    if config.param_tier == "device":
        if layout.resident > budget:
            return BudgetError(f"param_tier='device' keeps every parameter on the device "
                               f"({format_size(layout.resident)} in the device tier's slots) but device_budget is "
                               f"{format_size(budget)}: set "
                               f"device_budget >= {format_size(layout.resident)} or param_tier='host' or 'nvme'")
    elif layout.need > budget:
        held = _describe_held(layout, config)
        if explicit and layout.resident:
            least = _measure(model, config, 0, place).need
            if place is not None:  # (_measure placed its own groups: back to these, which offload.plan goes on with)
                place(layout.groups)
            have, need = format_apart(budget, layout.need)
            return BudgetError(
                f"device_budget {have} cannot hold the {format_size(layout.resident)} of parameters "
                f"that stay on the device (resident_bytes={format_size(layout.resident_bytes)})"
                + (f" and {held}" if layout.held else "") + f": set device_budget >= {need}, "
                f"or lower resident_bytes (with resident_bytes=0 or 'auto', device_budget >= {format_size(least)})")
        have, need = format_apart(budget, layout.need)
        return BudgetError(f"device_budget {have} cannot hold {held}"
                           + (f" next to {format_size(layout.resident)} of resident parameters" if layout.resident
                              else "") + f": set device_budget >= {need}")
    if config.param_tier == "host":
        total = sum(host_slot_size(g.nbytes) for g in layout.groups if not g.resident)  # (whole pages each)
        if total > config.host_budget:
            have, need = format_apart(config.host_budget, total)
            return BudgetError(f"param_tier='host' needs {need} of host memory but host_budget is "
                               f"{have}: raise host_budget or set param_tier='nvme'")
    room = layout.room(budget)
    if config.cache_bytes != "auto" and config.cache_bytes > room:
        return BudgetError(f"cache_bytes={format_size(config.cache_bytes)} does not fit: device_budget "
                           f"{format_size(budget)} leaves {format_size(room)} after the {format_size(layout.need)} "
                           "a pass holds at once: lower cache_bytes, leave it 'auto', or raise device_budget")
    return None


def _describe_held(layout: DeviceLayout, config: OffloadConfig) -> str:
    if not layout.held:
        return "no streamed parameter group"
    index = layout.nests.names.index(layout.held_at)
    by_id = {id(g): g for g in layout.groups}
    groups = [by_id[g] for g in layout.nests.members[index]]
    raw = sum(g.nbytes for g in groups)
    rounded = f"{format_size(layout.held)} in the device tier's slots" if layout.held != raw else ""
    if len(groups) == 1:
        return f"parameter group {groups[0].key!r} ({format_size(raw)}{'; ' + rounded if rounded else ''})"
    keys = ", ".join(repr(g.key) for g in groups[:6]) + (", ..." if len(groups) > 6 else "")
    if layout.held_at.endswith(" (checkpointed)"):
        where = (f"by module {layout.held_at.removesuffix(' (checkpointed)')!r}, recomputed in backward with "
                 "activation checkpointing (all of its groups and those of the modules it runs inside")
    else:
        where = f"in module {layout.held_at!r} (its own and those of the modules it runs inside"
    return f"the {format_size(raw)} of parameter groups in use at once {where}: {keys}{'; ' + rounded if rounded else ''})"


def check_partitioned(groups: list[ParamGroup], config: OffloadConfig, mine: list[ParamGroup]) -> None:
    """Several ranks: a group in use takes its slice and the whole gathered group on the
    device; the host tier holds only slices (``mine``)."""
    streamed = [g for g in groups if not g.resident]
    largest = max(streamed, key=lambda g: g.nbytes, default=None)
    need = largest.nbytes if largest else 0
    slices = sum(g.nbytes for g in mine) if config.param_tier == "device" else \
        max((g.nbytes for g in mine), default=0)
    need += slices
    if need > config.device_budget:
        have, least = format_apart(config.device_budget, need)
        raise BudgetError(
            f"device_budget {have} cannot hold parameter group "
            f"{largest.key!r} gathered ({format_size(largest.nbytes)}) next to "
            + ("this rank's slices of every group" if config.param_tier == "device" else "its slice")
            + f" ({format_size(slices)}): set device_budget >= {least}")
    if config.param_tier == "host" and sum(host_slot_size(g.nbytes) for g in mine) > config.host_budget:
        raise BudgetError(f"param_tier='host' needs {format_size(sum(host_slot_size(g.nbytes) for g in mine))} of "
                          "host memory on "
                          f"each rank but host_budget is {format_size(config.host_budget)}: raise host_budget "
                          "or set param_tier='nvme'")


def no_room_error(group: ParamGroup, err: BudgetError, *, device: Any, device_budget: int,
                  held: list[ParamGroup], parked: set[ParamGroup], layout: DeviceLayout | None = None) -> BudgetError:
    """What the static nest could not see, met at run time: the device tier has no room for
    ``group`` while this point of the pass holds ``held`` (``parked`` among them). Says
    what, and the budget that holds it and the group: under resident_bytes="auto" with
    room for every small group a larger budget would keep resident too, since following a
    figure that the larger budget then spends on residents fails again."""
    if getattr(err, "short_of", None) is Tier.HOST:  # the device had room; the way there did not
        return BudgetError(
            f"host_budget has no room to stage parameter group {group.key!r} ({format_size(group.nbytes)}) "
            f"on its way to the device: its buffers are held by the optimizer, gradients and other groups in "
            f"flight. Raise host_budget ({err})")
    need = device.used_bytes + device.slot_size(group.nbytes)
    more = layout.could_keep(device.slot_size) if layout is not None else 0
    kept = (f"; {len(parked)} of them ({format_size(sum(g.nbytes for g in parked))}) are kept "
            "from their recomputation (activation checkpointing) until backward has gone through "
            "them: the device must hold a whole checkpointed block's parameters") if parked else ""

    fix = _budget_fix(layout, need, more) if layout is not None else f"Set device_budget >= {format_size(need)}"
    if parked:
        fix += ("; or turn activation checkpointing on before offload.wrap, which then sizes the layout for "
                "whole checkpointed blocks")
    return BudgetError(
        f"device_budget {format_size(device_budget)} has no room for parameter group {group.key!r} "
        f"({format_size(group.nbytes)}): {format_size(device.used_bytes)} are held at this point of the pass "
        f"by {len(held)} groups in use ({', '.join(repr(g.key) for g in held[:4])}"
        f"{', ...' if len(held) > 4 else ''}) and the resident parameters{kept}. {fix} ({err})")


def remeasured(layout: DeviceLayout, slot_size: Callable[[int], int], device_budget: int) -> bool:
    """Whether ``layout`` was measured again (activation checkpointing turned on or off
    since ``wrap``); refuses a budget that no longer holds a pass, with the figure that
    runs at once (under resident_bytes="auto" a larger budget keeps more groups resident)."""
    layout.refused = None
    if not layout.remeasure(slot_size, device_budget):
        return False
    if layout.refused is None:
        return True
    held, where = layout.refused
    need, more = layout.resident + held, layout.could_keep(slot_size)
    raise BudgetError(
        f"activation checkpointing was turned on after offload.wrap: module "
        f"{where.removesuffix(' (checkpointed)')!r} now holds {format_size(held)} of parameter groups at once "
        "(recomputed in backward, its groups stay until backward has gone through it), "
        f"{format_size(need)} with the resident ones, more than device_budget {format_size(device_budget)}. "
        f"{_budget_fix(layout, need, more)}; or turn checkpointing on before offload.wrap, whose layout then "
        "keeps fewer groups resident")


def _budget_fix(layout: DeviceLayout, need: int, more: int) -> str:
    """The budget that runs: ``need``, and under resident_bytes="auto" ``more`` that a larger
    budget spends on keeping small groups resident."""
    fix = f"Set device_budget >= {format_size(need + more)}"
    if more:
        fix += (f" (resident_bytes='auto' keeps more small groups on the device under a larger budget; with "
                f"resident_bytes={layout.resident_bytes}, device_budget >= {format_size(need)})")
    return fix
