"""The end of a module's backward, seen without changing the graph.

A module's groups are released once backward has gone through it: once every autograd
node its forward made that consumes one of its inputs has run (those are the last of its
nodes to run, since they hand the gradient on to the inputs). The nodes are found after
the forward by a walk from the outputs' nodes that stops at the inputs' gradient edges,
at leaves and at nodes older than the forward; each gets a post-hook.

Note: why not an identity function on the inputs (as FSDP and ZeRO-3 do). Its node
would sit between the input and the module's uses of it: autograd would add the
gradients of an input used twice inside the module before adding the one from outside,
a different order from the model's own by last bits (an RMSNorm's input), and a hook a
user puts on the input inside the module would see the module's share only.

Note: nodes that will not run. A backward that does not need some of the consumers
(``autograd.grad`` with ``inputs=``, a branch without a gradient) never fires their
hooks, and the module's groups wait for the release at the end of backward, as they
would for an identity that did not run. (Asking the engine which nodes it will run needs
the node objects, and holding them from their own hooks keeps the graph alive.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["input_edges", "BackwardEnd"]


_PROBE = torch.zeros((), requires_grad=True)


def input_edges(tensors: list[torch.Tensor]) -> tuple[list[Any], int]:
    """The gradient edges of a forward's inputs, taken before it runs (an in-place change
    inside the forward gives an input a new node; the walk stops at the old one), and the
    sequence number the forward's own nodes start after (a throwaway node's)."""
    with torch.enable_grad():
        since = _PROBE.view_as(_PROBE).grad_fn._sequence_nr()
    return [get_gradient_edge(t) for t in tensors], since


def _sequence_nr(node: Any) -> int:
    return node._sequence_nr()


def _consumers(outputs: list[torch.Tensor], edges: list[Any], since: int) -> list[Any]:
    """The nodes made since sequence number ``since`` and reached from ``outputs`` that
    have an edge into one of ``edges``' nodes."""
    bounds = {id(e.node) for e in edges}
    found: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in bounds:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if id(nxt) in bounds:
                found[id(node)] = node
            elif not hasattr(nxt, "variable") and _sequence_nr(nxt) > since:
                stack.append(nxt)
    return list(found.values())


class BackwardEnd:
    """Calls ``done()`` once per backward, after the last of its nodes has run. Holds the
    nodes' ids only: a reference to a node from its own hook would keep the graph, and
    the activations it saved, alive after a forward that never gets a backward."""

    def __init__(self, nodes: list[Any], done: Callable[[], None]) -> None:
        self._keys = frozenset(id(n) for n in nodes)
        self._done = done
        self._task = -1
        self._pending: set[int] = set()
        for node in nodes:
            node.register_hook(self._hook(id(node)))

    @classmethod
    def attach(cls, outputs: list[torch.Tensor], edges: list[Any], since: int,
               done: Callable[[], None]) -> "BackwardEnd | None":
        """None when the forward made no node that consumes its inputs (its backward then
        hands nothing on to them, and reads its groups only through saved tensors)."""
        nodes = _consumers(outputs, edges, since)
        return cls(nodes, done) if nodes else None

    def _hook(self, key: int) -> Callable:
        def ran(grad_inputs: Any, grad_outputs: Any) -> None:
            task = torch._C._current_graph_task_id()
            if task != self._task:  # the first of them to run in this backward
                self._task = task
                self._pending = set(self._keys)
            self._pending.discard(key)
            if not self._pending:
                self._done()
        return ran
