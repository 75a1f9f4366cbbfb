"""The materializer: how a group's stored bytes become the flat device buffer its parameters
view, and how that buffer goes back. One implementation per mode, chosen once at ``wrap``:

    StoreCopies    (_from_store.py)  the usual path: the store's device copy of the group
    MappedViews    (_mapped.py)      a CPU device over io_backend="mmap": views of the
                                     mapped swap files, no copy; prefetch is read-ahead advice
    GatheredSlices (_gathering.py)   several ranks: the store holds this rank's slice, and
                                     materializing all-gathers the whole group

The coordinator (``_coordinator``) decides what to fetch, keep and drop, and owns each
group's state; it calls the materializer without asking which one it is. The materializer
reads back from the coordinator (``bind``) only what its mode needs: ``counts``, ``tracer``,
``make_room``, ``room_error`` and ``log_event`` on the copy path; with several ranks also
the group records (its own count of device bytes), ``schedule.next_in_pass`` and
``note_read_ahead``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from ..store import TensorStore, Tier
from ._groups import ParamGroup
from ._state import GroupRecord, GroupState, Materialized

if TYPE_CHECKING:
    from ._coordinator import Coordinator

__all__ = ["Materializer"]


class Materializer(ABC):
    """The interface; ``StoreCopies`` is the usual implementation, the others extend it."""

    zero_copy = False  # parameters view the stored bytes in place (no device copy, no device budget)
    resident_cache = True  # whether keeping groups on the device across passes saves reads

    def __init__(self, store: TensorStore, home: Tier):
        self.store, self.home = store, home
        self.device_tier = store.tiers[Tier.DEVICE]
        self.coordinator: Coordinator | None = None

    def bind(self, coordinator: "Coordinator") -> None:
        """The coordinator this serves (set once, by the coordinator)."""
        self.coordinator = coordinator

    @abstractmethod
    def used_bytes(self) -> int:
        """Device bytes in use, as the coordinator's decisions must see them."""

    @abstractmethod
    def prefetch(self, candidates: list[ParamGroup], room: int) -> list[ParamGroup]:
        """Start reading ahead the nearest of ``candidates`` (in order, none read ahead yet)
        within ``room`` bytes of the prefetch window and what the device has free now;
        returns those started."""

    @abstractmethod
    def materialize(self, group: ParamGroup, source: GroupState) -> Materialized:
        """The group's whole flat buffer on the device, waited for. ``source``: the state it
        comes from (AHEAD: it was read ahead, and taken out of the read-ahead set; CACHED:
        kept on the device; RELEASED: nothing)."""

    @abstractmethod
    def give_back(self, group: ParamGroup, record: GroupRecord) -> bool:
        """The parameters no longer view ``record.flat``: give back its lease. True when a
        device copy of the stored bytes remains, for the coordinator to keep or evict."""

    @abstractmethod
    def keep_write(self, group: ParamGroup, record: GroupRecord, certain: bool) -> bool:
        """The viewed bytes were (``certain``) or may have been written in place: make the
        change reach the stored bytes; False when it does not count as a write."""

    @abstractmethod
    def evict(self, group: ParamGroup) -> None:
        """Drop the device copy of the stored bytes (a read-ahead no longer wanted)."""

    def after_acquire(self) -> None:
        """An acquisition is done: start what runs while the module computes (several ranks:
        the next group's all-gather)."""

    def cancel_ahead(self, group: ParamGroup | None = None) -> None:
        """Discard what was started ahead for ``group`` (None: for every group) beyond the
        read-ahead itself (several ranks: gathers issued ahead)."""
