"""The schedule: the order in which a pass acquires parameter groups, recorded in the first
pass of each kind ("grad" for training steps, "nograd" for inference, "direct" for a module
called outside its root), where the current pass stands in that order, and which groups
to keep on the device across passes. Bookkeeping only: no store, no device.

A pass that acquires groups in another order than the recorded one is marked diverged (the
coordinator then fetches on demand for the rest of it), logged once per kind, and its order
replaces the recorded one when it ends.

Before the first pass of a kind there is no recorded order, and a pass without one reads
every group on demand: read and compute in series, which is most of the time to the first
token of a model read from disk. So ``guess`` gives the first pass an order to prefetch
by, the modules' registration order (``guess_from``). A use that departs from it resyncs
the guess where it can (a module run before its place moves the cursor on; the modules it
passed are taken when they come); a first pass that departs from it otherwise falls back to
demand fetches without a message, and its real order is recorded as usual.
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
    skipped: dict[int, ParamGroup] = field(default_factory=dict)  # guessed groups the cursor passed unused


class Schedule:
    def __init__(self) -> None:
        self.traces: dict[str, list[ParamGroup]] = {}
        self.current: _Pass | None = None
        self._warned: set[str] = set()
        self._guessed: set[str] = set()  # kinds whose trace is a guess, not yet a pass's order

    def guess(self, key: str, order: list[ParamGroup]) -> None:
        """Prefetch the first pass of kind ``key`` by ``order`` (no order recorded yet)."""
        if key not in self.traces and order:
            self.traces[key] = list(order)
            self._guessed.add(key)

    def guess_from(self, needs: dict[Any, list[ParamGroup]]) -> None:
        """Guess the first forward and training passes: the streamed groups as the modules
        that need them were registered (``needs``, in that order), and for training the
        modules again in reverse (backward)."""
        forward = [g for groups in needs.values() for g in groups if not g.resident]
        backward = [g for groups in reversed(list(needs.values())) for g in groups if not g.resident]
        self.guess("nograd", forward)
        self.guess("grad", forward + backward)  # (modules in reverse; each its groups in order)

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
        guessed = done.key in self._guessed
        self._guessed.discard(done.key)
        if trace == done.actual:
            return list(done.actual) if guessed else None  # (a guess that held: now a recorded order)
        if trace is not None and done.key not in self._warned and not done.diverged and not guessed:
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
            elif p.key in self._guessed and self._resync(p, trace, group):
                pass
            else:
                p.diverged = departs = True
                if p.key in self._guessed:
                    log.debug("the first %s pass departs from the modules' order at step %d (expected %s, got %s)",
                              p.key, len(p.actual), expected.key if expected else None, group.key)
                elif p.key not in self._warned:
                    self._warned.add(p.key)
                    log.info("execution order of the %s pass changed at step %d (expected %s, got %s): fetching "
                             "on demand for this pass and re-recording", p.key, len(p.actual),
                             expected.key if expected else None, group.key)
        p.actual.append(group)
        return departs

    @staticmethod
    def _resync(p: _Pass, trace: list[ParamGroup], group: ParamGroup) -> bool:
        """A guessed order (the modules' registration order) that a use departs from: a group
        the cursor passed unused is taken late; one further on moves the cursor past it, the
        groups between noted as passed (Llama registers a layer's norms after its attention
        and MLP, and runs them first: giving up there read the whole first pass on demand).
        False where the group is in neither (then the pass diverges as usual)."""
        if id(group) in p.skipped:
            del p.skipped[id(group)]
            return True
        half = len(trace) // 2  # (a guessed grad pass: the forward's order, then the backward's)
        end = half if p.key == "grad" and p.cursor < half else len(trace)
        for i in range(p.cursor, end):
            if trace[i] is group:
                p.skipped.update((id(g), g) for g in trace[p.cursor: i])
                p.cursor = i + 1
                return True
        return False

    def upcoming(self) -> Iterator[ParamGroup]:
        """Groups after the cursor in the recorded order, wrapping into the next pass."""
        p = self.current
        trace = self.traces.get(p.key) if p is not None and not p.diverged else None
        if not trace:
            return
        yield from list(p.skipped.values())  # (passed by a resync of the guess: used next)
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
