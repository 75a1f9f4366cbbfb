"""The schedule: the order in which a pass acquires parameter groups, recorded in the first
pass of each kind ("grad" for training steps, "nograd" for inference, "direct" for a module
called outside its root), where the current pass stands in that order, and which groups
to keep on the device across passes. Bookkeeping only: no store, no device.

A pass that acquires groups in another order than the recorded one is marked diverged (the
coordinator then fetches on demand for the rest of it), logged once per kind, and its order
replaces the recorded one when it ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ._groups import ParamGroup

__all__ = ["Schedule", "choose_cached"]

log = logging.getLogger(__name__)


@dataclass
class _Pass:
    key: str
    actual: list[ParamGroup] = field(default_factory=list)
    cursor: int = 0  # position in the recorded order (wraps into the next pass)
    diverged: bool = False


class Schedule:
    def __init__(self) -> None:
        self.traces: dict[str, list[ParamGroup]] = {}
        self.current: _Pass | None = None
        self._warned: set[str] = set()

    def open(self, key: str) -> None:
        """A pass of kind ``key`` is now the current one."""
        self.current = _Pass(key)

    def is_open(self, key: str) -> bool:
        """Whether a pass of kind ``key`` is current and has acquired nothing yet."""
        return self.current is not None and self.current.key == key and not self.current.actual

    def ending(self) -> str | None:
        """The kind of the current pass if it acquired anything, else None."""
        done = self.current
        return done.key if done is not None and done.actual else None

    def finish(self) -> list[ParamGroup] | None:
        """Keep the current pass's order when it differs from the recorded one; returns it
        then, else None."""
        done = self.current
        if done is None or not done.actual:
            return None
        trace = self.traces.get(done.key)
        if trace == done.actual:
            return None
        if trace is not None and done.key not in self._warned and not done.diverged:
            self._warned.add(done.key)
            log.info("the %s pass used %d groups where the recorded order had %d; re-recorded", done.key,
                     len(done.actual), len(trace))
        self.traces[done.key] = done.actual
        return done.actual

    def abandon(self) -> None:
        """Drop the current pass without recording its (partial) order."""
        self.current = None

    def record(self, group: ParamGroup) -> bool:
        """Note a use of ``group`` in the current pass; True when it is the first use that
        departs from the recorded order (what was fetched ahead will not be used)."""
        p = self.current
        trace = self.traces.get(p.key)
        departs = False
        if trace is not None and not p.diverged:
            expected = trace[p.cursor % len(trace)] if trace else None
            if expected is group:
                p.cursor += 1
            else:
                p.diverged = departs = True
                if p.key not in self._warned:
                    self._warned.add(p.key)
                    log.info("execution order of the %s pass changed at step %d (expected %s, got %s): fetching "
                             "on demand for this pass and re-recording", p.key, len(p.actual),
                             expected.key if expected else None, group.key)
        p.actual.append(group)
        return departs

    def upcoming(self) -> Iterator[ParamGroup]:
        """Groups after the cursor in the recorded order, wrapping into the next pass."""
        p = self.current
        trace = self.traces.get(p.key) if p is not None and not p.diverged else None
        if not trace:
            return
        for i in range(len(trace)):
            yield trace[(p.cursor + i) % len(trace)]

    def next_in_pass(self) -> ParamGroup | None:
        """The next group of the recorded order within the current pass (None past its end:
        the optimizer may change the next pass's bytes)."""
        p = self.current
        trace = self.traces.get(p.key) if p is not None and not p.diverged else None
        if not trace or p.cursor >= len(trace):
            return None
        return trace[p.cursor]


def choose_cached(trace: list[ParamGroup], *, slot_size: Callable[[int], int], layout: Any,
                  cache_bytes: int | str, prefetch_limit: int, device_budget: int) -> tuple[list[ParamGroup], int]:
    """The groups to keep resident across passes and their device bytes: most uses per pass
    first (a tied embedding is used twice), then the largest, within the cache budget.
    Whatever is left streams; room stays for what a pass holds at once besides the cached
    groups (``layout``, a ``DeviceLayout`` or None) and, with ``cache_bytes="auto"``, the
    prefetch window."""
    uses: dict[ParamGroup, int] = {}
    for group in trace:
        uses[group] = uses.get(group, 0) + 1
    chosen: list[ParamGroup] = []
    total = 0
    for group in sorted(uses, key=lambda g: (-uses[g], -g.nbytes)):
        size = slot_size(group.nbytes)
        reserve = layout.need_with_cached(chosen + [group]) if layout is not None else 0
        if cache_bytes == "auto":
            fits = total + size + prefetch_limit + reserve <= device_budget
        else:
            fits = total + size <= cache_bytes and total + size + reserve <= device_budget
        if fits:
            chosen.append(group)
            total += size
    return chosen, total
