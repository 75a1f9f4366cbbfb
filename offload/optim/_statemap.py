"""``optimizer.state`` of an offload optimizer: an empty mapping that refuses use.

torch's optimizers keep each parameter's state (``step``, ``exp_avg``, ...) in
``optimizer.state[p]``, and training loops read and change it there: a log of the moments,
a reset of them when layers are unfrozen or adapters merged (ReLoRA-style restarts clear
the dict or assign zeros). An offload optimizer keeps those states in its own tiers, shard
by shard (``_states``), so such code would read an empty dict and its changes would do
nothing, and the run would go on as if untouched. The mapping stays empty for torch's own
code (``Optimizer.state_dict`` packs what it holds: nothing) and refuses everything else
with an error that names the calls that do the same work here: ``state_dict()`` to read,
``reset_state()`` to start states again.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["StateMap", "OptimizerStateError"]


class OptimizerStateError(RuntimeError):
    """Code read or changed ``optimizer.state``, which an offload optimizer does not use."""


class StateMap(dict):
    """What ``optimizer.state`` is (see the module docstring): empty for iteration, ``len``
    and ``in``; every read of an entry and every change raises ``OptimizerStateError``."""

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

    def __getitem__(self, key: Any) -> NoReturn:
        self.refuse("optimizer.state[p]")

    def get(self, key: Any, default: Any = None) -> NoReturn:
        self.refuse("optimizer.state.get(p)")

    def __setitem__(self, key: Any, value: Any) -> NoReturn:
        self.refuse("optimizer.state[p] = ...")

    def __delitem__(self, key: Any) -> NoReturn:
        self.refuse("del optimizer.state[p]")

    def setdefault(self, key: Any, default: Any = None) -> NoReturn:
        self.refuse("optimizer.state.setdefault(p, ...)")

    def pop(self, key: Any, *default: Any) -> NoReturn:
        self.refuse("optimizer.state.pop(p)")

    def popitem(self) -> NoReturn:
        self.refuse("optimizer.state.popitem()")

    def clear(self) -> NoReturn:
        self.refuse("optimizer.state.clear()")

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        self.refuse("optimizer.state.update(...)")

    def __ior__(self, other: Any) -> NoReturn:
        self.refuse("optimizer.state |= ...")

    def __reduce__(self):  # (pickled or copied as an empty map of the same owner)
        return (type(self), (self.owner,))
