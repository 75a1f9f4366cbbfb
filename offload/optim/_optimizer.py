"""Optimizers whose states rest in the optimizer tier (host memory or NVMe): the
``torch.optim.Optimizer`` facade over the parts that do the work.

The parameters are laid out in *shards* (``_layout``, ``_shards``); each keeps its state rows
(master weights where needed, then the moments) and, for a wrapped model's parameters, an
fp32 gradient accumulator in the store. Gradients of wrapped parameters leave the device as
autograd produces them (``_sink``; several ranks through ``_reduce``), and ``p.grad`` shows
the held sum (``_grads``). ``step()`` runs the pipeline (``_pipeline``): states read ahead
while a shard is updated by the rule (``_rules``) and the previous one written back, new
weights written to the parameter tier a group at a time (``_writeback``). Within
``update_during_backward()`` the same work runs during backward (``_early``). fp16 loss
scaling is ``_scaler``; torch's state-dict format ``_statedict``; what checkpoints see
``_checkpoint``; zero_grad, clipping and ``p.grad`` ``_gradcalls``; how rows rest (fp32,
bf16, 8-bit codes) ``_formats``; the bytes moved by kind ``_moved``; what the optimizer is
doing, ``_phase``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

import torch
from torch.optim import Optimizer

from .._tensors import made_lasting
from ..config import OffloadConfig
from ..params import release_gradients
from ._ahead import BackwardReads
from ._deferred import Deferral
from ._during import BackwardUpdates
from ._formats import StateFormat
from ._moved import counters, per_parameter
from ._gradcalls import GradientCalls
from ._grads import GradientBook
from ._layout import Shard, check_dtype
from ._norms import found_inf
from ._phase import OptimizerPhase, Phase
from ._pipeline import Pipeline
from ._scaler import LossScaler
from ._shards import ShardBook
from ._sink import GradientSink, check_dense
from ._persist import StateDicts
from ._states import StateRows
from ._writeback import WriteBack

__all__ = ["OffloadOptimizer"]

log = logging.getLogger(__name__)


class OffloadOptimizer(StateDicts, GradientCalls, BackwardUpdates, Optimizer):
    """Base of :class:`AdamW`, :class:`Adam` and :class:`SGD`; see the module docstring.

    Extra keyword arguments (beyond torch's):
        config: for plain (not wrapped) parameters, where their states rest
            (``config.optimizer_tier``, ``nvme_path``, ``host_budget``); default: host
            memory without a budget. Wrapped parameters use their model's config.
        shard_size: elements per shard (default: 16M, fewer when the host budget is small).
        grad_tier: where the fp32 gradient accumulators of wrapped parameters rest when their
            states are on NVMe: ``"auto"`` (default) keeps them in host memory as far as half
            of the host budget left after the parameter and write-back staging allows
            (no gradient bytes written and read back each step), the rest on NVMe;
            ``"host"`` requires all of them in host memory (BudgetError if the budget cannot
            hold them); ``"nvme"`` writes them all to NVMe (least host memory).
        loss_scale: ``"dynamic"`` (default when a parameter is fp16), a fixed float, or None.
        moments: how the moment rows (``exp_avg``, ``exp_avg_sq``, SGD's momentum) are stored
            between steps: ``"fp32"`` (default: torch's, the trajectory equals torch's),
            ``"bf16"`` (2 bytes per element, rounded to nearest even), ``"int8"`` (8-bit
            block-wise codes with a scale per 256 elements, about 1 byte per element; the
            scheme is in ``offload.optim._formats``). Each shard is decoded to fp32 for its
            update and coded again: the update itself is torch's. Fewer bytes read and
            written per step where the states rest on NVMe, and less memory where they rest
            in host memory.
        master: how the fp32 master weights of parameters that are not fp32 where they rest
            are kept: ``"fp32"`` (default), or ``"bf16"`` for bf16 parameters, rounded
            stochastically at each update (2 bytes per parameter instead of 4, read and
            written each step; unbiased, so small updates are not lost; the trajectory
            differs from fp32 masters'). Refused for parameters of another dtype.
        update_in_next_forward: ``True`` (default): ``step()`` decides the step at once (clip
            factor, fp16 overflow) and returns; a wrapped model's shards are updated during
            the next forward, each parameter group just before its first use, so the
            optimizer's reads and writes overlap the forward's compute (``_deferred``). The
            result is the same as updating inside ``step()``; any other access to the weights,
            states or gradients finishes the update first. ``False``: inside ``step()``.
    """

    _torch_settings: dict = {}  # settings of the torch optimizer computing as this one (state_dict)

    # torch optimizers are refused over a wrapped model's streamed parameters (offload.params)
    serves_offloaded_parameters = True

    @made_lasting  # (built within inference mode: its states and buffers serve training after it)
    def __init__(self, params: Iterable, defaults: dict, *, config: OffloadConfig | None = None,
                 shard_size: int | None = None, loss_scale: str | float | None = "auto", grad_tier: str = "auto",
                 update_in_next_forward: bool = True, moments: str = "fp32", master: str = "fp32"):
        if type(self)._update is OffloadOptimizer._update:
            raise TypeError("OffloadOptimizer is the base of the offload optimizers: use offload.AdamW, "
                            "offload.Adam or offload.SGD")
        self._closed = False
        self.events: list | None = None  # when a list, each step appends (event, shard index) tuples
        # read_bytes / write_bytes: what the optimizer asked its tier for (a read of a state
        # still being written back is served from memory; the store's stats count the disk's)
        # reduce_seconds: several ranks, time in the reduce-scatters of gradients
        # forward_update_seconds: time spent updating shards during the next forward
        # backward_read_bytes: state rows asked for from a backward's hooks, ahead of the update (``_ahead``)
        # <kind>_read_bytes / <kind>_write_bytes: the same, by kind (``_moved.KINDS``)
        self.stats = {"steps": 0, "skipped_steps": 0, "step_seconds": 0.0, "wait_seconds": 0.0,
                      "read_bytes": 0, "write_bytes": 0, "reduce_seconds": 0.0, "forward_update_seconds": 0.0,
                      "backward_read_bytes": 0, **counters()}
        self._moved_before: dict = {}  # the stats at the last step's end (the step log's per-parameter bytes)
        self._phase = Phase()
        self._phase.on_poison = self._mark_models  # (a stopped step leaves its models' weights mixed)
        self._book = ShardBook(lambda gi: self._rows_for(self.param_groups[gi]), config=config,
                               shard_size=shard_size, grad_tier=grad_tier, fmt=StateFormat.parse(moments),
                               master_fmt=StateFormat.parse_master(master))
        self._states = StateRows(self._book)
        self._sink = GradientSink(self._book, self._phase, self.stats, self._before_gradient)
        self._writeback = WriteBack(self.stats)
        rows_used = lambda gi, groups: len(self._rows_for((groups or self.param_groups)[gi]))  # noqa: E731
        self._pipeline = Pipeline(self._update_rows, rows_used, self._writeback, self._phase, self.stats, self._log,
                                  reserve=self._book.reserved,
                                  scratch=self._book.scratch)
        self._grads = GradientBook(self._book, self._sink, loss_factor=lambda: self._scaler.factor,
                                   in_backward_update=lambda: self._early is not None, closed=lambda: self._closed,
                                   settle=self._settle)
        self._sink.ahead = BackwardReads(self._book, self.stats, self._log,
                                         wanted=lambda: self._book.partition() is None)
        self._later = Deferral(self._pipeline, self._writeback, self._phase, self.stats,
                               enabled=update_in_next_forward, partitioned=lambda: self._book.partition() is not None,
                               sink_open=lambda: self._sink.open,
                               grads=lambda: self._grads, drop=self._drop_gradients)
        self._clipped = False  # clip_grad_norm_() since the last step
        self._stepped_on = False  # the gradients held were the last step's (none added since)
        try:
            super().__init__(params, defaults)
            fp16 = any(e.param.dtype == torch.float16 or (e.owner is not None and e.owner.slot.dtype == torch.float16)
                       for e in self._book.entries.values())
            setting = ("dynamic" if fp16 else None) if loss_scale == "auto" else loss_scale
            self._scaler = LossScaler(setting, self._grads.loss_scale_changed)
            self._ensure_layout()  # budget errors now, before any training step
        except BaseException:
            self.close()  # a refused optimizer leaves no store, files or threads behind
            raise

    # -- torch.optim.Optimizer interface ----------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if not isinstance(params, set):  # (a set: torch's refusal below)
            param_group = {**param_group, "params": [params] if isinstance(params, torch.Tensor) else list(params)}
            for p in param_group["params"]:
                check_dtype(p)  # (before torch's: a refused group must not stay in param_groups)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        for p in self.param_groups[index]["params"]:
            entry = self._book.register(p, index)
            if entry.owner is not None:
                self._states.listen(entry.owner.manager)
                self._take_gradients(entry)  # (now, or once the parameter requires grad)
        self._book.check_managers()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        self._settle()
        self._grads.forget_reads()  # (nor through the step)
        for manager in self._book.managers():  # (another optimizer's update owed to the same groups)
            manager.pending.settle()
        self._sink.sync()
        self._phase.refuse_if_poisoned()
        self._refuse_untaken_gradients()
        self._ensure_layout()
        shards = self._book.shards
        self._book.check_rows(type(self).__name__, self.param_groups)
        for p in self._book.plain_params():
            if p.grad is not None:
                check_dense(p, p.grad)
        if self._scaler.enabled and any(s.takes_step for s in shards):
            self._scaler.check_scaled()
        self._scaler.scaled = False
        self._clipped = False
        if self._scaler.enabled and found_inf(self._book):
            self._sink.ahead.release([])
            self.stats["skipped_steps"] += 1
            self._scaler.skipped()
            self._stepped_on = True
            self._end_step(started, skipped=True)
            return loss
        # (the gradients stay, as torch's p.grad does, until zero_grad() or p.grad = None)
        early = self._early
        self._sink.listener = None
        self._phase.enter(OptimizerPhase.STEPPING)
        owed = None  # the update left to the next forward (all of it, or none: _deferred.Deferral.split)
        try:
            if early is not None:
                rest = early.finish(lambda done: [s for s in shards if id(s) not in done and s.takes_step])
                work = [s for s in shards if id(s) in early.done] + rest
            else:
                work = [s for s in shards if s.takes_step]
            self._sink.ahead.release(work)  # (the update takes the rows read ahead of its work)
            if early is None:
                if self._later.deferrable(work):
                    owed = self._later.prepare(work, self.param_groups, lambda: self._scaler.factor)
                else:
                    self._pipeline.run(work, self._scaler.factor)
        finally:
            self._sink.ahead.restart()  # (a failed step: the next backward reads anew)
            # (back to ACCUMULATING: a step from a hook of a backward still adding)
            if not self._phase.poisoned:
                self._phase.enter(OptimizerPhase.ACCUMULATING if self._sink.open else OptimizerPhase.IDLE)
        self._scaler.stepped()
        self._stepped_on = True
        self.stats["steps"] += 1
        if owed is not None:  # (last: an interrupt held back by it lands with the step decided)
            self._later.owe(owed)
        self.stats["step_seconds"] += time.perf_counter() - started
        for manager in self._book.managers(work):
            manager.coordinator.resume_prefetch()
        self._end_step(started, skipped=False)
        if early is not None:
            early.refuse_changed_settings()  # (the step is whole: taken with the earlier settings)
        return loss

    def _settle(self) -> None:
        """Finish the update owed to the next forward (first in every call that reads or
        changes the weights, states or gradients), refusing where the states are gone."""
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed: close() released its states. Build a new "
                               "optimizer (and load a state dict or checkpoint saved before close() to go on)")
        self._later.settle()

    def _before_gradient(self) -> None:
        """Ahead of each gradient's add: the last step's update is finished (it reads the
        accumulators this gradient goes into); parameters added since are laid out."""
        self._settle()
        self._ensure_layout()
        self._stepped_on = False
        self._grads.forget_reads()  # (a copy kept for p.grad reads is not held through the backward)

    def _end_step(self, started: float, *, skipped: bool) -> None:
        """Tell the wrapped models this optimizer serves: their optimizer time, the bytes it
        moved per parameter since the last step, by kind (with the update in the next
        forward: the previous step's update), the state rows read during this step's
        backwards, and the line of their step log (OffloadConfig.log_path)."""
        seconds = time.perf_counter() - started
        params = sum(seg.length for shard in self._book.shards for seg in shard.segments)
        moved = per_parameter(self.stats, self._moved_before, params)
        ahead = self.stats["backward_read_bytes"] - self._moved_before.get("backward_read_bytes", 0)
        self._moved_before = dict(self.stats)
        for manager in self._book.logged_by():
            manager.optimizer_step_done(seconds, lr=self.param_groups[0]["lr"], skipped=skipped, moved=moved,
                                        read_in_backward=ahead)

    def synchronize(self) -> None:
        """Wait until the step's write-backs have reached their tier. ``step()`` returns
        with them in flight, so they overlap the next forward and backward; a fetch of a
        state still being written is served from memory. A step's update left to the next
        forward is finished first."""
        self._settle()
        self._sink.sync()
        self._book.synchronize()

    @property
    def moments(self) -> str:
        """How the moment rows are stored: ``"fp32"``, ``"bf16"`` or ``"int8"``."""
        return self._book.fmt.value

    @property
    def master(self) -> str:
        """How master rows are stored: ``"fp32"`` or ``"bf16"``."""
        return self._book.master_fmt.value

    @property
    def phase(self) -> OptimizerPhase:
        return self._phase.value

    def close(self) -> None:
        """Release the optimizer's stored states, hooks and threads."""
        if self._closed:
            return
        try:
            self._settle()  # (the weights get the last step's update)
        except Exception:  # noqa: BLE001 - closing goes on
            log.warning("offload optimizer: the last step's update could not finish at close()", exc_info=True)
        finally:
            try:
                self._later.abandon()  # (what could not finish: poisoned where it had begun)
            except Exception:  # noqa: BLE001 - closing goes on
                log.warning("offload optimizer: dropping the last step's update failed at close()", exc_info=True)
        self._closed = True
        self._grads.forget_reads()
        self._mark_models(None)  # (closing a poisoned optimizer accepts its models' weights as they are)
        self._sink.close()  # (open accumulators are dropped, not flushed: the states go too)
        for group in getattr(self, "param_groups", []):
            for p in group["params"]:
                release_gradients(p, self)
        self._book.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _mark_models(self, reason: str | None) -> None:
        """Tell the wrapped models this optimizer updates that their weights are mixed
        (``reason``: what stopped half way; None: mended), so that reads refuse them. Not
        with several ranks: a rank's reads are collectives, and one rank refusing alone (the
        others not poisoned, as when another rank's load failed) would leave them waiting."""
        params = [id(p) for group in self.param_groups for p in group["params"]]
        for manager in self._book.managers():
            if manager.partition is None:
                manager.pending.set_mixed(id(self), reason, params)

    def give_up(self) -> bool:
        """Close for a new optimizer over the same parameters, unless this one holds a
        gradient: as in torch, a new optimizer then starts from fresh states, and the last
        step's update owed to the next forward is applied first (``close``)."""
        if self._sink.open:
            return False
        self._settle()  # (the owed update reads the gradients zero_grad() hid from the user)
        if any(s.holds_gradient for s in self._book.shards):
            return False
        log.warning("offload: a new optimizer takes the parameters of an open %s (id %#x), which held no "
                    "gradient: closing it (its last update applied, its states released; its step() now "
                    "raises). close() an optimizer when done with it (Trainer: trainer.optimizer.optimizer."
                    "close()) to free its states sooner", type(self).__name__, id(self))
        self.close()
        return True

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self._sink.shutdown_quietly()
            except Exception:  # noqa: BLE001 - at interpreter exit the modules may be gone
                log.debug("offload optimizer: drain thread not stopped at collection", exc_info=True)

    # -- the update rule, per optimizer (``_rules``) -------------------------------------------
    def _update(self, group: dict, params: list, grads: list, rows: list[list], steps: list,
                grad_scale: float) -> None:
        raise TypeError("use offload.AdamW, offload.Adam or offload.SGD")

    @classmethod
    def _rows_for(cls, group: dict) -> tuple[str, ...]:
        raise TypeError("use offload.AdamW, offload.Adam or offload.SGD")

    @classmethod
    def rows_of(cls, group: dict) -> tuple[str, ...]:
        """The state rows this optimizer keeps for a param group with ``group``'s settings
        (AdamW's ``amsgrad`` adds one, SGD keeps one only with momentum)."""
        return cls._rows_for(group)

    def _update_rows(self, gi: int, params: list, grads: list, rows: list, steps: list, grad_scale: float,
                     groups: list[dict] | None = None) -> None:
        self._update((groups or self.param_groups)[gi], params, grads, rows, steps, grad_scale)

    # -- helpers -----------------------------------------------------------------------------
    def _ensure_layout(self) -> None:
        """Lay out (once) the parameters not laid out yet and store their initial states;
        refresh the master rows of groups written outside the optimizer."""
        self._states.refresh_masters()
        new = self._book.lay_out()
        if new is None:
            return
        try:
            self._states.init(new.shards)
        except BaseException:
            self._book.discard(new)  # (laid out again at the next call)
            raise
        self._book.commit(new)

    def _log(self, event: str, shard: Shard) -> None:
        if self.events is not None:
            self.events.append((event, shard.index))
