"""The end of a module's backward, seen without changing the graph.

A module's groups are released once backward has run every autograd node its forward
made that this backward runs. The nodes are found after the forward by a walk from the
outputs' nodes that stops at the inputs' gradient edges, at leaves and at nodes not made
in the forward (sequence numbers outside the forward's: a throwaway node's number taken
before and after it); each gets a post-hook. When backward reaches the module (the
outputs' hook that also fetches its groups), the engine says which of them it will run:
not a branch whose output does not reach the loss, nor what ``autograd.grad`` with
``inputs=`` prunes. A backward that reaches them otherwise waits for all of them, and
what never runs leaves the groups to the release at the end of backward.

Note: why not an identity function on the inputs (as FSDP and ZeRO-3 do). Its node
would sit between the input and the module's uses of it: autograd would add the
gradients of an input used twice inside the module before adding the one from outside,
a different order from the model's own by last bits (an RMSNorm's input), and a hook a
user puts on the input inside the module would see the module's share only.

Note: references. The post-hooks hold node ids, not nodes: a node referenced from its
own hook would keep the graph, and the activations it saved, alive after a forward that
never gets a backward. The module's inner nodes are held by the outputs' hook, which
sits above them in the graph and so makes no cycle; the outputs' own nodes are not held
(their hook sits on them): an output's node runs when the output gets a gradient, which
a hook on the output tensor notes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["input_edges", "BackwardEnd"]

_PROBE = torch.zeros((), requires_grad=True)
_LEAF = torch._C._functions.AccumulateGrad


def sequence_now() -> int | None:
    """The sequence number of a node made now on this thread; None where none is made
    (inference mode)."""
    with torch.enable_grad():
        fn = _PROBE.view_as(_PROBE).grad_fn
    return None if fn is None else fn._sequence_nr()


def input_edges(tensors: list[torch.Tensor]) -> tuple[list[Any], int] | None:
    """The gradient edges of a forward's inputs, taken before it runs (an in-place change
    inside the forward gives an input a new node; the walk stops at the old one), and the
    sequence number the forward's own nodes come after; None in inference mode."""
    since = sequence_now()
    if since is None:
        return None
    return [get_gradient_edge(t) for t in tensors], since


def _module_nodes(outputs: list[torch.Tensor], edges: list[Any], since: int, until: int) -> list[Any]:
    bounds = {id(e.node) for e in edges}
    found: dict[int, Any] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in found or id(node) in bounds or isinstance(node, _LEAF):
            continue
        if not since < node._sequence_nr() <= until:
            continue
        found[id(node)] = node
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return list(found.values())


class BackwardEnd:
    """Calls ``done()`` once per backward, after the last of the module's nodes it runs."""

    def __init__(self, nodes: list[Any], outputs: list[torch.Tensor], done: Callable[[], None]) -> None:
        self._keys = frozenset(id(n) for n in nodes)
        self._done = done
        self._task = -1
        self._over = -1  # the backward in which done() was called: later hooks in it do nothing
        self._pending: set[int] = set()
        self._arrived: tuple[int, set[int]] = (-1, set())  # (task, output nodes given a gradient)
        for node in nodes:
            node.register_hook(self._ran(id(node)))
        for t in outputs:  # (an output's node runs when the output gets a gradient)
            t.register_hook(self._arrives(id(t.grad_fn)))

    @classmethod
    def attach(cls, outputs: list[torch.Tensor], edges: list[Any], since: int,
               done: Callable[[], None]) -> tuple["BackwardEnd", list[Any]] | None:
        """The tracker and the module's nodes other than the outputs' own (for :meth:`arm`:
        the outputs' hook that holds them sits on the outputs' nodes, so holding those too
        would make a cycle); None when the forward made no node (its output is its input)."""
        until = sequence_now()
        nodes = _module_nodes(outputs, edges, since, until) if until is not None else []
        if not nodes:
            return None
        made = {id(n) for n in nodes}
        own = {id(t.grad_fn) for t in outputs}
        return cls(nodes, [t for t in outputs if id(t.grad_fn) in made], done), [n for n in nodes if id(n) not in own]

    def arm(self, inner: list[Any]) -> None:
        """Backward has reached the module: wait for the inner nodes the engine will run and
        the outputs' nodes whose outputs get a gradient."""
        self._task = task = torch._C._current_graph_task_id()
        self._pending = {id(n) for n in inner if torch._C._will_engine_execute_node(n)}
        if self._arrived[0] == task:
            self._pending |= self._arrived[1]
        self._finish_if_done(task)

    def _finish_if_done(self, task: int) -> None:
        if not self._pending and self._over != task:
            self._over = task
            self._done()

    def _arrives(self, key: int) -> Callable:
        def arrived(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if self._over == task:
                return
            if self._task == task:
                self._pending.add(key)
                return
            if self._arrived[0] != task:
                self._arrived = (task, set())
            self._arrived[1].add(key)
        return arrived

    def _ran(self, key: int) -> Callable:
        def ran(grad_inputs: Any, grad_outputs: Any) -> None:
            task = torch._C._current_graph_task_id()
            if self._over == task:
                return
            if task != self._task:  # reached without the outputs' hook: wait for all
                self._task = task
                self._pending = set(self._keys)
            if key in self._pending:
                self._pending.discard(key)
                self._finish_if_done(task)
        return ran
