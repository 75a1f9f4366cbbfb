"""``optimizer.state`` of an offload optimizer: an empty mapping that refuses use.

torch's optimizers keep each parameter's state (``step``, ``exp_avg``, ...) in
``optimizer.state[p]``, and training loops read and change it there: a log of the moments,
a reset of them when layers are unfrozen or adapters merged (ReLoRA-style restarts clear
the dict or assign zeros). An offload optimizer keeps those states in its own tiers, shard
by shard (``_states``), so such code would read an empty dict and its changes would do
nothing, and the run would go on as if untouched. Even seeing it empty misleads: torch's
distributed checkpoint (``get_optimizer_state_dict``) takes an empty state for an
optimizer that never stepped and steps it once with zero gradients. So the mapping
refuses every use, iteration, ``len`` and ``in`` included, with an error that names the
calls that do the same work here: ``state_dict()`` to read, ``reset_state()`` to start
states again. Nothing of torch's ``Optimizer`` that offload's optimizers use reads it.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["StateMap", "OptimizerStateError"]


class OptimizerStateError(RuntimeError):
    """Code read or changed ``optimizer.state``, which an offload optimizer does not use."""


class StateMap(dict):
    """What ``optimizer.state`` is (see the module docstring): every use raises
    ``OptimizerStateError``."""

    def __init__(self, owner: str = "the offload optimizer") -> None:
        super().__init__()
        self.owner = owner

    def refuse(self, what: str) -> NoReturn:
        raise OptimizerStateError(
            f"{what}: {self.owner} keeps each parameter's state (step, moments, master weights) in its own tiers, "
            "not in optimizer.state, so reading or changing optimizer.state would see nothing and change nothing. "
            "Read the states with optimizer.state_dict() (torch's format); start them again from step 0 with "
            "optimizer.reset_state(params) (every parameter when called without any), as torch does for a "
            "parameter whose optimizer.state entry was cleared")

    def __repr__(self) -> str:
        return f"<optimizer.state of {self.owner}: kept in its tiers; see optimizer.state_dict()>"

    def __reduce__(self):  # (pickled or copied as an empty map of the same owner)
        return (type(self), (self.owner,))


def _refusing(what: str) -> Any:
    def method(self: StateMap, *args: Any, **kwargs: Any) -> NoReturn:
        self.refuse(what)
    return method


for _name, _what in {
        "__getitem__": "optimizer.state[p]", "get": "optimizer.state.get(p)",
        "__setitem__": "optimizer.state[p] = ...", "__delitem__": "del optimizer.state[p]",
        "setdefault": "optimizer.state.setdefault(p, ...)", "pop": "optimizer.state.pop(p)",
        "popitem": "optimizer.state.popitem()", "clear": "optimizer.state.clear()",
        "update": "optimizer.state.update(...)", "__ior__": "optimizer.state |= ...",
        "__iter__": "iterating over optimizer.state", "__len__": "len(optimizer.state) (or its truth value)",
        "__contains__": "p in optimizer.state", "keys": "optimizer.state.keys()",
        "values": "optimizer.state.values()", "items": "optimizer.state.items()", "copy": "optimizer.state.copy()",
}.items():
    setattr(StateMap, _name, _refusing(_what))
