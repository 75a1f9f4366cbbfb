"""The optimizer's state as others read and write it: ``state_dict`` / ``load_state_dict`` in
torch's format (``_statedict``) and the view ``offload.save_checkpoint`` and
``load_checkpoint`` stream through (``_checkpoint``); a load is one checked phase.

A mixin of :class:`~offload.optim._optimizer.OffloadOptimizer`: it uses the facade's parts
(the shard book, state rows, gradient sink, phase, scaler) and its ``_settle`` (a step's
update owed to the next forward lands before anything is read or replaced).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from ._checkpoint import CheckpointView
from ._layout import Shard
from ._phase import OptimizerPhase
from ._statedict import check_groups, gather_state, masters_to_take, reset_rows, scatter_state
from ._statemap import StateMap

__all__ = ["StateDicts"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Load:
    weights: bool  # whether the load has begun to write the models' weights


class StateDicts:
    @property
    def state(self) -> StateMap:
        """Not where the states are (``_statemap``): empty, and refuses use."""
        if "_state_map" not in self.__dict__:  # (an optimizer restored by __setstate__ skipped the setter)
            self.__dict__["_state_map"] = StateMap(type(self).__name__)
        return self.__dict__["_state_map"]

    @state.setter
    def state(self, value) -> None:
        if "_state_map" in self.__dict__:  # (torch's __init__ sets it once; a user's assignment is a reset)
            self.__dict__["_state_map"].refuse("optimizer.state = ...")
        self.__dict__["_state_map"] = StateMap(type(self).__name__)

    def reset_state(self, params=None) -> None:
        """Start the state of ``params`` (every parameter of this optimizer when None) again
        as if it had never stepped: step 0, moments zero, as torch's optimizer does for a
        parameter whose ``optimizer.state`` entry was cleared (restarts when layers are
        unfrozen or adapters merged). Master weights stay the parameters' values. With
        several ranks, call it on every rank, as ``step()``."""
        if self._early is not None:
            raise RuntimeError("reset_state() within update_during_backward(): the backward has already updated "
                               "shards with the states it would reset. Call it before the backward or after step()")
        self._settle()
        self._sink.sync()
        self._phase.refuse_if_poisoned()
        wanted = None
        if params is not None:
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            mine = {id(p) for group in self.param_groups for p in group["params"]}
            for i, p in enumerate(params):
                if id(p) not in mine:
                    raise ValueError(f"reset_state: parameter {i} of those given (shape {tuple(p.shape)}) is not one "
                                     f"of this {type(self).__name__}'s")
            wanted = {id(p) for p in params}
        with self._loading("reset_state()", weights=False):
            self._ensure_layout()
            reset_rows(self._book.shards, self._states, wanted)

    def state_dict(self) -> dict:
        """torch's format: per parameter ``step``, the moment buffers (full tensors in the
        parameter's shape, fp32) and, where the optimizer keeps one, ``master_param``; and
        ``moments``, how they were kept. Coded moments are decoded exactly, and coded again
        to the same bytes by an optimizer of the same format and layout (``_formats``)."""
        if self._book.partition() is not None:  # (each rank's tensors would hold its slice, zeros elsewhere)
            raise RuntimeError(
                f"{type(self).__name__}.state_dict() with several ranks: each rank holds a slice of every state, "
                "so the dict would hold zeros where the other ranks' slices are. Save with "
                "offload.save_checkpoint(path, model, optimizer) on every rank (it loads into any number of "
                "ranks, or one process); load_state_dict() of a whole dict works on ranks")
        self._settle()
        self._sink.sync()
        self._phase.refuse_if_poisoned()  # (half a step's states would be saved as a whole one)
        self._ensure_layout()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # (torch's hooks, around the whole dict)
            pre_hook(self)
        index, groups = _packed_groups(self.param_groups)
        packed = {"state": gather_state(self._book.shards, self._states, index), "param_groups": groups}
        packed["moments"] = self.moments  # (decoded to fp32 here: torch's optimizers load it)
        packed["master"] = self.master
        for group in packed["param_groups"]:  # (how torch computes what this computed: its fused kernel)
            for key, value in self._torch_settings.items():
                group.setdefault(key, value)
        if self._scaler.enabled:  # (torch's optimizers pass over keys they do not know)
            packed["loss_scaler"] = self._scaler.state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, packed)
            packed = packed if result is None else result
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's format (from this class or from the torch optimizer of the same
        name); the moments are coded as this optimizer keeps them (``moments=``), whatever
        the parameters' dtype."""
        state_dict = state_dict.copy()  # (shallow, as torch's: its hooks may change it)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        self._settle()
        self._sink.sync()
        by_index = check_groups(self.param_groups, state_dict["param_groups"], self._rows_for, type(self).__name__)
        for what, mine in (("moments", self.moments), ("master", self.master)):
            saved = state_dict.get(what, "fp32")
            if saved != mine:
                log.info("%s.load_state_dict: the state dict's %s were kept as %s, this optimizer keeps them as %s: "
                         "converted", type(self).__name__, what, saved, mine)
        with self._loading("load_state_dict()", weights=False) as load:
            for group, saved in zip(self.param_groups, state_dict["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            loaded = {id(by_index[int(k)]): v for k, v in state_dict["state"].items()}
            self._ensure_layout()
            scatter_state(self._book.shards, self._states, loaded)
            self._load_loss_scale(state_dict.get("loss_scaler"))
            taken = [(p, loaded[id(p)]["master_param"]) for p in masters_to_take(self._book.shards)
                     if "master_param" in loaded.get(id(p), {})]
            load.weights = bool(taken)  # (from here a stop leaves weights partly replaced)
            with torch.no_grad():
                for p, master in taken:
                    p.copy_(master.reshape(p.shape))
            if taken:
                log.info("%s.load_state_dict: %d fp32 parameters took the state dict's fp32 master weights (it was "
                         "saved by a run that computed in a narrower dtype; its model weights are their rounding)",
                         type(self).__name__, len(taken))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_loss_scale(self, saved: dict | None) -> None:
        """The saved loss scale and its count of good steps, as a checkpoint load takes them
        (held gradients keep their meaning: their factors follow the scale)."""
        if not self._scaler.enabled:
            return
        if saved is None and self._scaler.dynamic:
            log.warning("%s.load_state_dict: the state dict holds no loss scale (saved by torch's optimizer or one "
                        "without loss scaling): the scale stays %g and adjusts from there, so the next steps may be "
                        "skipped as overflows where the saved run took them", type(self).__name__, self._scaler.scale)
        old = self._scaler.scale
        self._scaler.load_state_dict(saved or {})  # (a fixed scale stays: LossScaler)
        if self._scaler.scale != old:
            self._grads.loss_scale_changed(old, self._scaler.scale)

    @contextlib.contextmanager
    def _loading(self, what: str, *, weights: bool = True):
        """A load replaces every state: an update during backward pending is dropped; a load
        that raises half way poisons the optimizer, one that completes clears a poisoning.
        ``weights``: whether it writes the models' weights (settable on the yielded record
        once it begins to): only then does a stop mark them mixed."""
        self._drop_early()  # (its host copies dropped: the load replaces what it updated)
        self._phase.enter(OptimizerPhase.LOADING)
        load = _Load(weights)
        try:
            yield load
        except BaseException:
            self._phase.poison(f"{what} stopped half way", weights=load.weights)
            raise
        self._phase.enter(OptimizerPhase.IDLE)

    def checkpoint_view(self) -> CheckpointView:
        """What ``offload.save_checkpoint`` / ``load_checkpoint`` read and write."""
        def prepare() -> list[Shard]:
            self.synchronize()
            self._grads.forget_reads()  # (a copy kept for p.grad reads is not held through a save or load)
            self._phase.refuse_if_poisoned()  # (half a step's states would be saved as a whole one)
            self._ensure_layout()
            return self._book.shards

        own = self._book.own_store
        return CheckpointView(prepare=prepare, states=self._states, scaler=self._scaler, loading=self._loading,
                              reset_gradients=self.reset_gradients,
                              holds_gradients=lambda: not self._stepped_on and any(
                                  s.grad_valid for s in self._book.shards),
                              staging=own.staging if own is not None else None, moments=self.moments,
                              master=self.master, scratch_released=self._book.scratch_released)


def _packed_groups(param_groups: list[dict]) -> tuple[dict[int, int], list[dict]]:
    """torch's packing of the param groups (``Optimizer.state_dict``): each parameter as its
    index in the order of the groups; and those indices by ``id``."""
    index: dict[int, int] = {}
    groups, start = [], 0
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        index.update({id(p): i for i, p in enumerate(group["params"], start) if id(p) not in index})
        packed["params"] = [index[id(p)] for p in group["params"]]
        start += len(packed["params"])
        groups.append(packed)
    return index, groups
