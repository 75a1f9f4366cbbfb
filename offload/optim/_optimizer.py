"""Optimizers whose states rest in the optimizer tier (host memory or NVMe).

Layout. The parameters an optimizer is given are laid out as *shards*: runs of at most
``shard_size`` elements, each a list of *segments* (a slice of one flattened parameter).
Parameters of a wrapped model are laid out in the order of their parameter groups, so a
group's parameters sit in one shard (or in consecutive shards for a large one), whatever
torch param group they belong to; plain parameters follow in param-group order. Each
shard keeps in the store:

* ``state``: fp32 rows ``[master?, exp_avg, exp_avg_sq(, max_exp_avg_sq)]`` (Adam) or
  ``[master?, momentum_buffer]`` (SGD with momentum). The master row is an fp32 copy of
  the weights, kept where the parameter is not fp32 where it rests (bf16/fp16 compute,
  or a plain parameter not on the CPU) or rests where the step cannot update it in place
  (the device or host parameter tiers). An fp32 parameter is otherwise its own master: a
  plain CPU one or a resident one on a CPU device is updated where it is, and a wrapped
  parameter group resting on NVMe is read into a host copy, updated there and written
  home from it, once.
* ``grad`` (wrapped parameters only): the fp32 gradient, accumulated over backward passes,
  in host memory when the budget allows (``grad_tier``).

Gradients. For a wrapped parameter a post-accumulate-grad hook moves each gradient off
the device as soon as autograd has produced it: it is added into the shard's fp32
accumulator and torch's own ``p.grad`` is set back to None; reading ``p.grad`` then gives
an ``OffloadedGrad`` that stands for the held sum (``_grads``). A shard's accumulator is written to its
tier once all of its parameters have reported in a backward pass (or at the end of the
pass); its squared norm and finiteness are noted then, so ``clip_grad_norm_`` and the
fp16 overflow check need no pass over the tier. On CUDA the device-to-host copy runs on a
side stream into pinned buffers and the add on a worker thread. Plain parameters keep
their gradients in ``p.grad`` as with any torch optimizer.

Step. Shards are processed in order as a pipeline: the store is asked for the states of
the shards ahead (reads from NVMe in flight) while shard ``i`` is updated by torch's fused
CPU kernel and the states of shard ``i - 1`` are being written back; the host budget
bounds how many are in flight (a fetch that does not fit waits for a write to finish).
Updated master weights are cast to the parameters' dtype and written to the parameter
tier, a parameter group at a time. Within ``update_during_backward()`` the same work runs
shard by shard during backward, as each shard's gradient becomes final.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import psutil
import torch
from torch.optim import Optimizer

from .._resolve import choose_io_backend, resolve_engine
from .._units import format_size
from ..config import OffloadConfig
from ..io import BudgetError
from ..params import graph_task, hold_gradients, release_gradients
from ._grads import GradientBook, noted_norms, renote
from ..store import Residency, Tier, TensorStore, create_store

__all__ = ["OffloadOptimizer"]

log = logging.getLogger(__name__)

_DEFAULT_SHARD = 16 << 20  # elements: 64 MiB per fp32 row
# fp32 CPU parameters of no wrapped model, states in host memory: nothing is read or written,
# so shards only add per-call overhead (a fused call, a store lookup each). 1 GiB per row.
_HOST_PLAIN_SHARD = 1 << 28
_DRAIN_THREAD = "offload-grad"  # the worker that adds CUDA gradients into host accumulators
# The rows of a shard (master weights, exp_avg, exp_avg_sq) are streamed side by side by one
# kernel, and their buffer is on huge pages, so physically contiguous. Rows a large power of
# two apart contend for the same cache sets and memory banks. Measured here: one fused AdamW
# call over a 256M-element shard took 0.22-0.24 s with its rows exactly 1 GiB apart and
# 0.13-0.14 s padded; over 128M elements, 0.11-0.12 s with exp_avg_sq a whole number of MiB
# after exp_avg, 0.07-0.10 s with it 4 KiB to 2 MiB further on, and 0.08-0.10 s on torch's
# own states (scattered 4 KiB pages). Of the paddings tried, 68 KiB was 7% slower than the
# others over 100M elements; the rest were equal within noise.
_ROW_STAGGER = 4 << 10
_READ_AHEAD = 2  # shards read ahead of the one being updated; the host budget may hold fewer back


@dataclass(eq=False)
class _Segment:
    param: torch.Tensor
    start: int  # first element in the flattened parameter
    length: int
    offset: int  # first element in the shard
    group_index: int  # torch param group
    step: torch.Tensor  # this segment's step count (a split parameter's segments stay equal)
    owner: Any = None  # (manager, ParamGroup, ParamSlot) for a wrapped parameter
    has_grad: bool = False  # a gradient arrived since zero_grad()
    shard: "_Shard | None" = None
    # noted when the accumulator was written (wrapped only): what p.grad's norms answer
    sumsq: float = 0.0
    maxabs: float = 0.0
    # p.grad = the held sum x scale / loss scale: factors noted by p.grad.mul_(c) (clipping)
    # and, on host sums the fused kernel unscaled in place, the loss scale (_unscaled_in_place)
    scale: float = 1.0


@dataclass(eq=False)
class _Shard:
    index: int
    store: TensorStore
    home: Tier
    numel: int
    rows: int
    master: bool
    wrapped: bool
    segments: list[_Segment] = field(default_factory=list)
    grad_home: Tier | None = None  # where the fp32 gradient rests (wrapped only): host when the budget allows
    expected: int = 0  # distinct parameters that report a gradient per backward
    grad_valid: bool = False  # the stored grad holds this cycle's accumulation
    acc: torch.Tensor | None = None  # open fp32 accumulator during backward
    acc_buffer: Any = None  # its HostBuffer when the home tier is not host memory
    drained: set = field(default_factory=set)
    sumsq: float = 0.0
    maxabs: float = 0.0
    finite: bool = True

    @property
    def state_key(self) -> str:
        return f"optim/{id(self):x}/state"

    @property
    def grad_key(self) -> str:
        return f"optim/{id(self):x}/grad"

    @property
    def state_bytes(self) -> int:
        return self.rows * self.numel * 4

    @property
    def grad_bytes(self) -> int:
        return self.numel * 4 if self.wrapped else 0

    @property
    def bytes_in_flight(self) -> int:
        """Host bytes the step holds for this shard while it is read, updated and written."""
        if self.home is Tier.HOST:
            return 0
        return self.state_bytes + (self.grad_bytes if self.grad_home is not Tier.HOST else 0)

    @property
    def host_resting_bytes(self) -> int:
        """Host bytes this shard keeps between steps (states in the host tier, a gradient
        kept in host memory)."""
        states = self.state_bytes if self.home is Tier.HOST else 0
        return states + (self.grad_bytes if self.grad_home is Tier.HOST else 0)

    @property
    def nvme_bytes(self) -> int:
        states = self.state_bytes if self.home is Tier.NVME else 0
        return states + (self.grad_bytes if self.grad_home is Tier.NVME else 0)


@dataclass(eq=False)
class _GroupWrite:
    """A wrapped parameter group's new bytes, assembled from the shards that cover it."""
    manager: Any
    group: Any
    remaining: int = 0  # shards of this step still to update it
    data: torch.Tensor | None = None
    written: list = field(default_factory=list)  # (byte offset, bytes) assembled so far
    # fp32 parameters resting on NVMe are their own master weights: the group is read into
    # a host copy, updated there in place and written home from it (no master row)
    in_place: bool = False
    fetched: bool = False


@dataclass(eq=False)
class _Bucket:
    """Several ranks: one parameter group's gradients, summed over this backward, waiting
    for the rest of the group before they are reduce-scattered."""
    manager: Any
    group: Any  # this rank's slice of the group
    data: torch.Tensor | None  # fp32, the whole padded group, in elements of its parameters' size
    itemsize: int
    got: set  # ids of the parameters added
    expected: int  # parameters of the group that report to this optimizer


class OffloadOptimizer(Optimizer):
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
        events: a list that receives ``(event, shard_index)`` tuples ("read", "update_start",
            "update_end", "write") for tests and tracing.
    """

    _state_rows: tuple[str, ...] = ()
    # torch optimizers are refused over a wrapped model's streamed parameters (offload.params)
    serves_offloaded_parameters = True

    def __init__(self, params: Iterable, defaults: dict, *, config: OffloadConfig | None = None,
                 shard_size: int | None = None, loss_scale: str | float | None = "auto",
                 events: list | None = None, grad_tier: str = "auto"):
        if grad_tier not in ("auto", "host", "nvme"):
            raise ValueError(f"grad_tier={grad_tier!r}: use 'auto', 'host' or 'nvme'")
        self._grad_tier = grad_tier
        self._grad_room: dict[int, int] = {}  # id(store) -> gradient bytes new shards may keep on host
        self._config = config
        self._shard_size = int(shard_size) if shard_size is not None else None
        if self._shard_size is not None and self._shard_size < 1:
            raise ValueError(f"shard_size must be a positive number of elements, got {shard_size}")
        self.events = events
        self._shards: list[_Shard] = []
        self._segments_of: dict[int, list[_Segment]] = {}
        self._laid_out: set[int] = set()
        self._own_store: TensorStore | None = None
        self._hooks: list[Any] = []
        self._hooked: dict[int, Any] = {}  # id -> owner_of() of the wrapped parameters whose gradients come to us
        self._buckets: dict[int, _Bucket] = {}  # several ranks: groups being gathered for reduction
        self._callback_queued = False
        # parameter groups written outside the optimizer since the master rows were made
        # (load_state_dict, p.copy_(...)): their master rows are refreshed before next use
        self._written_groups: set[int] = set()
        self._listening: set[int] = set()  # ids of the managers that report such writes to us
        self._drain_pool: ThreadPoolExecutor | None = None
        self._drains: list[Future] = []
        self._d2h_streams: dict[torch.device, Any] = {}
        self._clipped = False  # clip_grad_norm_() since the last step
        self._grads = GradientBook(self)  # p.grad of the wrapped parameters whose gradients we hold
        self._backward_task: int | None = None
        self._interrupted: str | None = None  # how far a step() stopped by an exception got
        # update_during_backward(): this cycle's shards are updated as their gradients become
        # final, in the order they do; step() finishes what is left
        # _early: the current cycle updates during backward; _early_queue: shards final, not
        # updated yet (reads issued ahead); _early_done: ids of shards updated during this
        # backward; _early_pending: group writes waiting for more shards; _early_busy: group
        # writes waiting for a pass to release the group
        self._reset_early()
        self._closed = False
        # read_bytes / write_bytes: what the optimizer asked its tier for; a read of a state
        # still being written back is served from memory, so the disk may move fewer bytes
        # (the store's own stats count those it moved)
        # reduce_seconds: several ranks, time in the reduce-scatters of gradients
        self.stats = {"steps": 0, "skipped_steps": 0, "step_seconds": 0.0, "wait_seconds": 0.0,
                      "read_bytes": 0, "write_bytes": 0, "reduce_seconds": 0.0}
        try:
            super().__init__(params, defaults)
            self._init_loss_scale(loss_scale)
            self._ensure_layout()  # budget errors now, before any training step
        except BaseException:
            self.close()  # a refused optimizer leaves no store, files or threads behind
            raise

    # -- torch.optim.Optimizer interface ----------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        managers = set()
        for p in self.param_groups[index]["params"]:
            if p.device.type == "meta":
                raise ValueError("a parameter is on the meta device: wrap the model with "
                                 "offload.wrap(model, cfg, checkpoint=...) before building the optimizer")
            owner = _owner_of(p)
            if owner is not None:
                managers.add(owner[0])
                if id(owner[0]) not in self._listening:
                    self._listening.add(id(owner[0]))
                    owner[0].on_params_written(self._params_written)
                if p.requires_grad and id(p) not in self._hooked:
                    hold_gradients(p, self, owner[2].names[0])
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
                    self._hooked[id(p)] = owner
        self._check_managers(managers)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        self._sync_drains()
        if self._interrupted is not None:
            self._refuse_interrupted()
        self._ensure_layout()
        if self._scaler_enabled and (any(self._has_grads(s) for s in self._shards)):
            self._check_loss_scaled()
        self._loss_scaled = False
        self._clipped = False
        if self._scaler_enabled and self._found_inf():
            self._skip_step()
            self._end_step(started, skipped=True)
            return loss
        # (the gradients stay, as torch's p.grad does, until zero_grad() or p.grad = None)
        grad_scale = self.loss_scale if self._scaler_enabled else 1.0
        if self._early:
            work = self._finish_early()
        else:
            work = [s for s in self._shards if self._has_grads(s)]
            self._run_pipeline(work, grad_scale)
        if self._scaler_enabled:
            self._grow_scale()
        self.stats["steps"] += 1
        self.stats["step_seconds"] += time.perf_counter() - started
        for manager in _managers_of(work):
            manager.coordinator.resume_prefetch()
        self._end_step(started, skipped=False)
        return loss

    def _refuse_interrupted(self) -> None:
        raise RuntimeError(
            f"the previous step() stopped after updating {self._interrupted}: the model's weights "
            "and the optimizer states are partly from that step. Load a checkpoint "
            "(offload.load_checkpoint(path, model, optimizer)) or the optimizer's and the model's "
            "state dicts to go on, or close() the optimizer")

    def _end_step(self, started: float, *, skipped: bool) -> None:
        """Tell the wrapped models this optimizer serves: their optimizer time, and the line
        of their step log (OffloadConfig.log_path)."""
        seconds = time.perf_counter() - started
        for manager in _managers_of(self._shards):
            manager.optimizer_step_done(seconds, lr=self.param_groups[0]["lr"], skipped=skipped)

    @contextlib.contextmanager
    def update_during_backward(self):
        """Within this block, a ``backward()`` updates each shard of a wrapped model's
        parameters as soon as their gradients are final, overlapping the optimizer's reads,
        update and write-backs with the rest of the backward pass; ``step()`` afterwards
        updates what is left (plain parameters, parameters that got no gradient in that
        pass) and ends the step::

            with opt.update_during_backward():
                loss.backward()
            opt.step()
            opt.zero_grad()

        The result equals ``backward(); step()`` exactly, under these rules (each checked):

        * the backward inside the block is the last of its step: earlier micro-batches of a
          gradient accumulation run outside it, and no other backward may come before
          ``step()``;
        * no gradient clipping (``clip_grad_norm_`` needs every gradient before the first
          update; it raises after this block) and no fp16 loss scaling (an overflow would
          have to skip the whole step);
        * each parameter receives its gradient once in that pass (true of a parameter used
          several times in one graph, and of activation checkpointing; a reentrant backward
          that reports a parameter twice raises, and the optimizer then refuses to step
          until a checkpoint or state dict is loaded).
        """
        if self._scaler_enabled:
            raise ValueError("update_during_backward() cannot be used with fp16 loss scaling: an overflow "
                             "must skip the whole step, so every gradient has to be seen first. Use bf16 or "
                             "fp32, or call step() after backward()")
        if self._clipped or any(seg.scale != 1.0 for s in self._shards for seg in s.segments):
            raise ValueError("clip_grad_norm_() was called before update_during_backward(): the clip "
                             "factor must come from this step's gradients; clip without "
                             "update_during_backward() (backward(), clip_grad_norm_(), step())")
        self._sync_drains()
        if self._interrupted is not None:
            self._refuse_interrupted()
        if self._early:
            raise RuntimeError("update_during_backward() was already used in this step: call step() "
                               "before the next one")
        self._ensure_layout()
        self._reset_early()
        self._early = True
        # every wrapped shard counts toward its groups (those that get no gradient in the
        # pass are merged from the current bytes at step())
        self._early_pending = self._group_writes([s for s in self._shards if s.wrapped])
        try:
            yield self
        except BaseException:
            # the backward failed or was interrupted: nothing of it may be applied later
            self._abandon_pipeline(self._early_queue, self._early_issued)
            self._drop_group_copies(list(self._early_pending.values()) + self._early_busy)
            if self._early_done:
                self._interrupted = self._interrupted or f"{len(self._early_done)} shards during backward"
            self._reset_early()
            raise

    def _reset_early(self) -> None:
        self._early = False
        self._early_queue, self._early_pending, self._early_busy = [], {}, []
        self._early_done, self._early_issued = set(), set()

    def _enqueue_early(self, shard: _Shard) -> None:
        """A shard's gradient is final in an update_during_backward() pass: read its states
        and update it as soon as they are in memory, without holding backward up."""
        self._early_queue.append(shard)
        if not threading.current_thread().name.startswith(_DRAIN_THREAD):
            self._advance_early(block=False)
        # else (CUDA: gradients are added on the drain worker): the next gradient hook, on
        # the backward's own thread where the coordinator runs, advances the queue

    def _advance_early(self, *, block: bool) -> None:
        queue = self._early_queue
        while queue:
            for shard in queue[: 1 + _READ_AHEAD]:
                self._issue_read(shard, self._early_issued, self._early_pending)
            head = queue[0]
            if not block and not self._states_in_memory(head):
                break
            queue.pop(0)
            try:
                self._process(head, 1.0, self._early_pending, busy=self._early_busy)
            except BaseException:
                self._abandon_pipeline([head] + queue, self._early_issued)
                self._drop_group_copies(list(self._early_pending.values()) + self._early_busy)
                if self._early_done:
                    self._interrupted = f"{len(self._early_done)} shards during backward"
                raise
            self._early_done.add(id(head))
        busy, self._early_busy = self._early_busy, []
        for entry in busy:
            if block or not _in_use(entry):
                self._finish_group(entry)
            else:
                self._early_busy.append(entry)

    def _states_in_memory(self, shard: _Shard) -> bool:
        if shard.home is Tier.HOST:
            return True
        keys = ([shard.state_key] if shard.rows else []) + \
            ([shard.grad_key] if shard.wrapped and shard.grad_home is not Tier.HOST else [])
        if shard.wrapped and not shard.master:
            for seg in shard.segments:
                entry = self._early_pending.get(id(seg.owner[1]))
                if entry is not None and entry.in_place and entry.data is None:
                    keys.append(entry.group.key)
        return all(shard.store.state(k, Tier.HOST) is Residency.RESIDENT for k in keys)

    def _finish_early(self) -> list[_Shard]:
        """step() after update_during_backward(): update the shards still queued and those
        with gradients that did not become final in that pass, then write every parameter
        group (merging what was not updated from its current bytes)."""
        try:
            self._advance_early(block=True)
            rest = [s for s in self._shards if id(s) not in self._early_done and self._has_grads(s)]
            pending = self._early_pending  # every wrapped group, counting all of its shards
            self._run_pipeline(rest, 1.0, pending)
            for entry in list(pending.values()):  # groups some of whose shards got no gradient
                if entry.in_place:
                    self._finish_group(entry)
                elif entry.written:
                    self._finish_group(entry, entry.manager.group_bytes(entry.group))
            done = [s for s in self._shards if id(s) in self._early_done] + rest
        finally:
            self._reset_early()
        return done

    def synchronize(self) -> None:
        """Wait until the step's write-backs have reached their tier. ``step()`` returns
        with them in flight, so they overlap the next forward and backward; a fetch of a
        state still being written is served from memory."""
        self._sync_drains()
        for store in {id(s.store): s.store for s in self._shards}.values():
            store.drain()
        # a write that failed keeps its bytes in host memory with the error: report it here
        # (the next step would meet it when it reads them)
        for shard in self._shards:
            if shard.home is Tier.NVME and shard.rows and \
                    shard.store.state(shard.state_key, Tier.HOST) is Residency.RESIDENT:
                shard.store.wait(shard.state_key, Tier.HOST)
        for manager in _managers_of(self._shards):
            for group in manager.groups:
                if not group.resident and manager.store.state(group.key, Tier.HOST) is Residency.RESIDENT:
                    manager.store.wait(group.key, Tier.HOST)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: with ``set_to_none=False`` the gradients held are zeros (a step
        still takes them) rather than none."""
        if set_to_none:
            self.reset_gradients()
        else:
            self._sync_drains()
            self._grads.zero_kept()
            self._clipped = False
        super().zero_grad(set_to_none=set_to_none)  # (plain parameters; the wrapped ones are done)

    def reset_gradients(self) -> None:
        """Drop every gradient this optimizer holds for wrapped parameters, with its noted
        norms and factors (``zero_grad()``, a checkpoint load)."""
        self._sync_drains()
        self._buckets.clear()
        for shard in self._shards:
            shard.grad_valid, shard.sumsq, shard.maxabs, shard.finite = False, 0.0, 0.0, True
            for seg in shard.segments:
                seg.has_grad = False
        self._grads.cleared()
        self._clipped = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all this optimizer's parameters to a total norm of
        ``max_norm`` (like ``torch.nn.utils.clip_grad_norm_``) and return the total norm.

        Offloaded gradients are not read: their norm comes from what was noted when they
        were written, and the factor is noted with them (``p.grad`` shows it) and applied
        inside the next ``step()``.
        """
        norm_type = float(norm_type)
        if self._early:
            raise RuntimeError("clip_grad_norm_() after update_during_backward(): the shards were updated "
                               "during backward, before the total norm was known. To clip, run "
                               "backward(), clip_grad_norm_(), step() without update_during_backward()")
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"norm_type={norm_type}: offload optimizers clip by the 2-norm or the "
                             "inf-norm")
        self._sync_drains()
        self._ensure_layout()
        sumsq, maxabs = 0.0, 0.0
        for shard in self._shards:
            if shard.wrapped and shard.grad_valid:
                for seg in shard.segments:
                    if seg.has_grad:  # (scaled through p.grad since: as noted times the factor)
                        sumsq += seg.sumsq * seg.scale ** 2
                        maxabs = max(maxabs, seg.maxabs * abs(seg.scale))
        for p in self._plain_params():
            if p.grad is not None:
                g = p.grad.detach().float()
                sumsq += float(torch.linalg.vector_norm(g)) ** 2
                maxabs = max(maxabs, float(g.abs().max())) if g.numel() else maxabs
        partition = self._partition()
        if partition is not None:  # every rank holds a slice of the gradients
            sumsq, = partition.sum([sumsq])
            maxabs, = partition.max([maxabs])
        total = math.sqrt(sumsq) if norm_type == 2.0 else maxabs
        if self._scaler_enabled:
            total /= self.loss_scale
        coef = min(1.0, float(max_norm) / (total + 1e-6))
        for shard in self._shards:
            for seg in shard.segments:
                if shard.wrapped and seg.has_grad:
                    seg.scale *= coef
        for p in self._plain_params():
            if p.grad is not None:
                p.grad.mul_(coef)
        self._clipped = True
        return torch.tensor(total)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16 dynamic loss scaling); call ``backward()`` on
        the result. Unchanged when loss scaling is off."""
        self._loss_scaled = True
        return loss * self.loss_scale if self._scaler_enabled else loss

    def _check_loss_scaled(self) -> None:
        """A step with loss scaling on divides the gradients by the scale: refuse one whose
        backward did not multiply by it (a loop that never calls scale_loss())."""
        if self._scaler_enabled and not self._loss_scaled:
            raise RuntimeError(
                f"this optimizer scales the loss (loss_scale={'dynamic' if self._dynamic else self.loss_scale}; on "
                "by default for fp16 parameters) and divides the gradients by {:g} in step(), but this step's "
                "backward did not go through opt.scale_loss(loss): the update would be {:g}x too small. Call "
                "opt.scale_loss(loss).backward(); or, when another scaler scales the loss (HF Trainer's "
                "fp16=True, Accelerate's mixed_precision='fp16', torch.amp.GradScaler), build the optimizer "
                "with loss_scale=None".format(self.loss_scale, self.loss_scale))

    def state_dict(self) -> dict:
        """torch's format: per parameter ``step``, the moment buffers (full tensors in the
        parameter's shape, fp32) and, where the optimizer keeps one, ``master_param``."""
        self._sync_drains()
        self._ensure_layout()
        need = sum(len(self._row_names(s)) * sum(seg.length for seg in s.segments) * 4 for s in self._shards)
        available = psutil.virtual_memory().available
        if need > available:
            raise BudgetError(
                f"state_dict() of an offload optimizer copies every state into host memory: {format_size(need)} "
                f"of fp32 states, {format_size(available)} of RAM available. Save it with "
                "offload.save_checkpoint(path, model, optimizer), which streams a shard at a time (with HF "
                "Trainer: save_strategy='no' and offload.save_checkpoint in a callback or after train())")
        packed = super().state_dict()  # param_groups with indices; our self.state is empty
        index = {}
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        state: dict[int, dict] = {}
        for shard in self._shards:
            rows = self._read_state(shard)
            names = self._row_names(shard)
            for seg in shard.segments:
                if float(seg.step) == 0 and "momentum_buffer" not in names:
                    continue
                entry = state.setdefault(index[id(seg.param)], {"step": seg.step.clone()})
                if float(seg.step) == 0:
                    continue
                for r, name in enumerate(names):
                    if name not in entry:
                        entry[name] = torch.zeros(seg.param.shape, dtype=torch.float32)
                    entry[name].view(-1)[seg.start: seg.start + seg.length].copy_(
                        rows[r, seg.offset: seg.offset + seg.length])
        packed["state"] = state
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's format (from this class or from the torch optimizer of the same
        name); moments are kept in fp32 whatever the parameters' dtype."""
        self._sync_drains()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        by_index = {}
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
            if self._rows_for(merged) != self._rows_for(group):  # the states it keeps would change
                keys = sorted(k for k in ("amsgrad", "momentum") if k in saved and bool(saved[k]) != bool(group[k]))
                raise ValueError(
                    f"parameter group {i} of the state dict has {', '.join(f'{k}={saved[k]!r}' for k in keys)}, this "
                    f"optimizer {', '.join(f'{k}={group[k]!r}' for k in keys)}: they keep different states. Build "
                    f"the {type(self).__name__} with the state dict's settings")
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"parameter group {i} has {len(group['params'])} parameters, the state "
                                 f"dict's has {len(saved['params'])}")
            by_index.update(zip(saved["params"], group["params"]))
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        loaded = {id(by_index[int(k)]): v for k, v in state_dict["state"].items()}
        self._ensure_layout()
        for shard in self._shards:
            rows = torch.zeros(shard.rows, shard.numel, dtype=torch.float32)
            # a wrapped parameter's master the state dict lacks (torch's, for a model offload
            # runs in bf16) stays what it is: the model's values, not their rounded copy
            current = self._read_state(shard) if shard.master else None
            names = self._row_names(shard)
            for seg in shard.segments:
                entry = loaded.get(id(seg.param), {})
                # torch's SGD saves its momentum buffer and no step: a buffer means it has
                # stepped (step 0 would make the next update overwrite the buffer)
                stepped = any(entry.get(name) is not None for name in names if name != "master_param")
                seg.step.fill_(float(entry.get("step", 1 if stepped else 0)))
                for r, name in enumerate(names):
                    if name == "master_param" and name not in entry:
                        source = self._current_values(seg) if seg.owner is None else \
                            current[0, seg.offset: seg.offset + seg.length]
                    elif name in entry:
                        source = entry[name].reshape(-1)[seg.start: seg.start + seg.length]
                    else:
                        continue
                    rows[r, seg.offset: seg.offset + seg.length].copy_(source)
            self._write_state(shard, rows)
        self._interrupted = None

    def close(self) -> None:
        """Release the optimizer's stored states, hooks and threads."""
        if self._closed:
            return
        self._sync_drains()
        self._closed = True
        for h in self._hooks:
            h.remove()
        for group in self.param_groups:
            for p in group["params"]:
                release_gradients(p, self)
        for shard in self._shards:
            for key in (shard.state_key, shard.grad_key):
                if key in shard.store:
                    shard.store.delete(key)
        if self._drain_pool is not None:
            self._drain_pool.shutdown()
        if self._own_store is not None:
            self._own_store.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def gradient_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param.grad`` of a wrapped parameter whose gradient this optimizer holds (see
        ``_grads``); None when it holds none."""
        return self._grads.view(param)

    def set_gradient(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        """``param.grad = value`` for a wrapped parameter: None drops what this optimizer
        holds for it (``model.zero_grad()``), a tensor replaces it."""
        view = self._grads.view(param)
        if value is None:  # (needs no reduction: allowed with several ranks too)
            if view is not None:
                self._grads.drop(param)
            return
        self._grads.check_param(param)
        if value is not view:
            self._grads.write(param, value)

    def __del__(self):
        try:
            if not self._closed and self._drain_pool is not None:
                self._drain_pool.shutdown(wait=False)
        except Exception:
            pass

    # -- the update, per optimizer ---------------------------------------------------------
    def _update(self, group: dict, params: list, grads: list, rows: list[list], steps: list,
                grad_scale: float) -> None:
        raise TypeError("use offload.AdamW, offload.Adam or offload.SGD")

    def _rows_for(self, group: dict) -> tuple[str, ...]:
        return self._state_rows

    # -- layout ----------------------------------------------------------------------------
    def _plain_params(self):
        for group in self.param_groups:
            for p in group["params"]:
                if _owner_of(p) is None:
                    yield p

    def _check_managers(self, managers: set) -> None:
        seen = {m for s in self._shards if s.wrapped for m in [s.segments[0].owner[0]]}
        managers = managers | seen
        configs = {m.config for m in managers}
        if len(configs) > 1:
            raise ValueError("the parameters come from wrapped models with different configs "
                             f"({len(configs)}): build one optimizer per model, or wrap the models with "
                             "the same OffloadConfig")

    def _ensure_layout(self) -> None:
        """Lay out (once) the parameters not laid out yet and store their initial states;
        refresh the master rows of groups written outside the optimizer."""
        if self._written_groups:
            self._refresh_masters()
        todo: list[tuple[int, torch.Tensor, Any]] = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) not in self._laid_out:
                    todo.append((gi, p, _owner_of(p)))
        if not todo:
            return
        wrapped = [t for t in todo if t[2] is not None]
        plain = [t for t in todo if t[2] is None]
        partitioned = any(t[2][0].partition is not None for t in wrapped) or self._partition() is not None
        if partitioned and (plain or any(not s.wrapped for s in self._shards)):
            raise ValueError(
                "with several ranks, an offload optimizer takes only parameters of the wrapped model "
                f"({len(plain) or 'some'} given are not): their gradients would not be averaged over the "
                "ranks. Wrap the module that holds them too, or give them to an optimizer of their own "
                "after averaging their gradients yourself (torch.distributed.all_reduce)")
        # a wrapped model's parameters in the order of its groups and slots
        order = {}
        for t in wrapped:
            manager, pgroup, slot = t[2]
            order[id(t[1])] = (id(manager), manager.groups.index(pgroup), pgroup.slots.index(slot))
        wrapped.sort(key=lambda t: order[id(t[1])])
        self._plan_grad_room(wrapped)
        new: list[_Shard] = []
        new += self._cut(wrapped, wrapped=True)
        new += self._cut(plain, wrapped=False)
        self._check_host_budget(new)
        self._check_machine(new)
        for shard in new:
            self._init_state(shard)
        self._shards.extend(new)
        self.masters_taken(new)  # after every new shard has its masters (a group may span shards)
        for _, p, _ in todo:
            self._laid_out.add(id(p))

    def masters_taken(self, shards: list[_Shard] | None = None) -> None:
        """The master rows of ``shards`` (default: all) are built: the wrapped models may
        drop the original values they kept for them."""
        for shard in self._shards if shards is None else shards:
            for seg in shard.segments:
                if seg.owner is not None:
                    seg.owner[0].master_taken(seg.owner[1], seg.owner[2])

    def _params_written(self, group: Any) -> None:
        self._written_groups.add(id(group))

    def _refresh_masters(self) -> None:
        """Master rows of parameter groups written outside the optimizer take the new values
        (as a torch optimizer, which has no master copy, would compute from them)."""
        written, self._written_groups = self._written_groups, set()
        for shard in self._shards:
            if not shard.master or not shard.wrapped:
                continue
            segs = [seg for seg in shard.segments if id(seg.owner[1].whole or seg.owner[1]) in written]
            if not segs:
                continue
            rows = self._read_state(shard)
            for seg in segs:
                rows[0, seg.offset: seg.offset + seg.length].copy_(self._current_values(seg))
            self._write_state(shard, rows)
        self.masters_taken()

    def forget_param_writes(self) -> None:
        """The master rows were just loaded (a checkpoint): writes to the parameters before
        that are superseded."""
        self._written_groups.clear()

    def _plan_grad_room(self, wrapped: list) -> None:
        """How many gradient bytes of the parameters being laid out may rest in host memory,
        per store (see ``grad_tier``)."""
        self._grad_room = {}
        for manager in {id(t[2][0]): t[2][0] for t in wrapped}.values():
            store = manager.store
            if Tier.parse(manager.config.optimizer_tier) is Tier.HOST or self._grad_tier == "nvme":
                continue
            need = 4 * sum(t[1].numel() for t in wrapped if t[2][0] is manager)
            budget = store.tiers[Tier.HOST].budget
            kept = sum(s.host_resting_bytes for s in self._shards if s.store is store)
            free = budget - kept - _write_back_staging((manager,)) - manager.host_staging_bytes()
            if self._grad_tier == "host":
                if need > free // 2:
                    raise BudgetError(
                        f"grad_tier='host' keeps {format_size(need)} of fp32 gradients in host memory, "
                        f"more than half of the {format_size(max(free, 0))} that host_budget "
                        f"({format_size(budget)}) leaves after the parameter staging: raise "
                        "host_budget or use grad_tier='auto'")
                room = need
            else:
                room = min(need, max(0, free // 2))
            self._grad_room[id(store)] = room

    def _cut(self, items: list, *, wrapped: bool) -> list[_Shard]:
        """Consecutive segments of ``items`` into shards that share a store and a master layout."""
        shards: list[_Shard] = []
        current: _Shard | None = None
        for gi, p, owner in items:
            store, home = self._store_for(owner)
            if wrapped:
                master = _in_place(owner) is None
            else:
                master = p.dtype != torch.float32 or p.device.type != "cpu"
            rows = (1 if master else 0) + len(self._rows_for(self.param_groups[gi]))
            size = self._shard_elements(store, home, rows, wrapped, owner, master)
            # with several ranks, a wrapped parameter's elements held in this rank's slice
            start, n = (owner[2].first, owner[2].first + owner[2].count) if owner is not None else (0, p.numel())
            step = torch.zeros((), dtype=torch.float32)
            segs: list[_Segment] = []
            while start < n:
                if current is None or current.store is not store or current.master != master \
                        or current.rows != rows or current.numel >= size:
                    current = _Shard(len(self._shards) + len(shards), store, home, 0, rows, master, wrapped)
                    shards.append(current)
                take = min(n - start, size - current.numel)
                seg = _Segment(p, start, take, current.numel, gi, step if not segs else step.clone(),
                               owner=owner, shard=current)
                current.segments.append(seg)
                current.numel += take
                segs.append(seg)
                start += take
            self._segments_of[id(p)] = segs
        room = dict(self._grad_room)
        for shard in shards:
            shard.numel = _staggered(shard.numel)  # unused elements at the end of each row
            shard.expected = len({id(s.param) for s in shard.segments if s.param.requires_grad})
            if shard.wrapped:
                shard.grad_home = shard.home
                if shard.home is not Tier.HOST and room.get(id(shard.store), 0) >= shard.grad_bytes:
                    shard.grad_home = Tier.HOST
                    room[id(shard.store)] -= shard.grad_bytes
        return shards

    def _store_for(self, owner) -> tuple[TensorStore, Tier]:
        if owner is not None:
            manager = owner[0]
            return manager.store, Tier.parse(manager.config.optimizer_tier)
        if self._own_store is None:
            cfg = self._config
            if cfg is None:
                self._own_store = create_store(device="cpu", device_budget=1, host_budget=1 << 62)
                self._own_home = Tier.HOST
            else:
                nvme = cfg.nvme_path if cfg.optimizer_tier == "nvme" else None
                backend = "direct"
                if nvme is not None:
                    states = 4 * (len(self._state_rows) + 1) * sum(
                        p.numel() for g in self.param_groups for p in g["params"] if _owner_of(p) is None)
                    backend, reason = choose_io_backend(cfg, states)
                    log.info("offload: optimizer states on %s through io_backend %s (%s)", nvme, backend, reason)
                engine = resolve_engine(cfg)
                self._own_store = create_store(device="cpu", device_budget=1, host_budget=cfg.host_budget,
                                               nvme_path=nvme, file_size=cfg.file_size,
                                               block_size=engine.block_size, threads=engine.threads,
                                               queue_depth=engine.queue_depth, io_backend=backend)
                self._own_home = Tier.parse(cfg.optimizer_tier)
        return self._own_store, self._own_home

    def _shard_elements(self, store: TensorStore, home: Tier, rows: int, wrapped: bool, owner=None,
                        master: bool = False) -> int:
        if self._shard_size is not None:
            return self._shard_size
        if home is Tier.HOST:
            # plain fp32 parameters are updated where they are, with no staging: fewer calls
            return _HOST_PLAIN_SHARD if not wrapped and not master else _DEFAULT_SHARD
        # NVMe: four shards in flight (read ahead, update, write back) within the host budget,
        # next to the staging buffer that writes a parameter group's new values to NVMe
        per_element = 4 * (rows + (1 if wrapped else 0))
        budget = store.tiers[Tier.HOST].budget - _write_back_staging(owner) - self._grad_room.get(id(store), 0)
        return max(1 << 16, min(_DEFAULT_SHARD, budget // (4 * per_element)))

    def _check_host_budget(self, shards: list[_Shard]) -> None:
        by_store: dict[int, list[_Shard]] = defaultdict(list)
        for s in shards + self._shards:
            by_store[id(s.store)].append(s)
        for group in by_store.values():
            store = group[0].store
            budget = store.tiers[Tier.HOST].budget
            resting = sum(s.host_resting_bytes for s in group)
            largest = max((s.bytes_in_flight for s in group), default=0)
            staging = max((_write_back_staging(s.segments[0].owner) for s in group if s.wrapped), default=0)
            if resting + largest + staging > budget:
                need = resting + largest + staging
                parts = [(resting, "resting in host memory"), (largest, "for one shard in flight"),
                         (staging, "to write back a parameter group")]
                fixes = ["raise host_budget"]
                if any(s.home is Tier.HOST for s in group):
                    fixes.append("set optimizer_tier='nvme'")
                fixes.append("pass a smaller shard_size")
                if any(s.grad_home is Tier.HOST and s.home is not Tier.HOST for s in group):
                    fixes.append("set grad_tier='nvme'")
                raise BudgetError(
                    f"the optimizer states need {format_size(need)} of host memory ("
                    + ", ".join(f"{format_size(n)} {what}" for n, what in parts if n)
                    + f") but host_budget is {format_size(budget)}: " + ", ".join(fixes[:-1])
                    + f" or {fixes[-1]}")

    def _check_machine(self, shards: list[_Shard]) -> None:
        """Refuse, before allocating them, states that this machine's free RAM or disk cannot
        hold (offload.plan's checks, for the states of these shards)."""
        from .._plan import check_disk, check_ram

        resting = sum(s.host_resting_bytes for s in shards)
        if resting:
            check_ram(resting, "the optimizer states in host memory",
                      "set optimizer_tier='nvme' (OffloadConfig) or free memory")
        by_path: dict[str, int] = defaultdict(int)
        for s in shards:
            if s.nvme_bytes:
                by_path[s.store.tiers[Tier.NVME].files.path] += s.nvme_bytes
        for path, need in by_path.items():
            check_disk(path, need, "the optimizer states on NVMe",
                       "free space there, point nvme_path at a larger disk, or set optimizer_tier='host'")
        for store in {id(s.store): s.store for s in shards if s.home is Tier.NVME}.values():
            tier = store.tiers[Tier.NVME]
            limit = getattr(tier, "cache_limit", None)
            total = tier.used_bytes + sum(s.nvme_bytes for s in shards if s.store is store)
            if limit is not None and total > limit:
                log.warning("offload: the optimizer states take the mmap NVMe tier at %s to %s, beyond its "
                            "page-cache limit (host_budget %s): they will be read back through the page "
                            "cache at cold-read speed each step; OffloadConfig(io_backend='direct') reads "
                            "them with O_DIRECT", tier.files.path, format_size(total), format_size(limit))

    def _row_names(self, shard: _Shard) -> list[str]:
        names = list(self._rows_for(self.param_groups[shard.segments[0].group_index]))
        return (["master_param"] if shard.master else []) + names

    def _current_values(self, seg: _Segment) -> torch.Tensor:
        """The parameter's values as a master starts from: the model's own, before a
        narrower compute dtype rounded them, while the wrapped model keeps them."""
        if seg.owner is None:
            return seg.param.detach().reshape(-1)[seg.start: seg.start + seg.length].float().cpu()
        manager, pgroup, slot = seg.owner
        originals = manager.original_values(pgroup)
        if originals is not None and id(slot) in originals:
            return originals[id(slot)][seg.start: seg.start + seg.length]
        data = manager.group_bytes(pgroup)
        begin, end = slot.elements(seg.start, seg.length)
        return data[begin: end].view(slot.dtype).float()

    def _init_state(self, shard: _Shard) -> None:
        rows = torch.zeros(shard.rows, shard.numel, dtype=torch.float32)
        if shard.master:
            cache: dict[int, tuple] = {}
            for seg in shard.segments:
                if seg.owner is None:
                    rows[0, seg.offset: seg.offset + seg.length].copy_(self._current_values(seg))
                    continue
                manager, pgroup, slot = seg.owner
                data, originals = cache.get(id(pgroup)) or cache.setdefault(
                    id(pgroup), (manager.group_bytes(pgroup), manager.original_values(pgroup)))
                if originals is not None and id(slot) in originals:  # the model's values before rounding
                    rows[0, seg.offset: seg.offset + seg.length].copy_(
                        originals[id(slot)][seg.start: seg.start + seg.length])
                    continue
                begin, end = slot.elements(seg.start, seg.length)
                rows[0, seg.offset: seg.offset + seg.length].copy_(data[begin: end].view(slot.dtype))
        self._write_state(shard, rows)
        if shard.wrapped:
            shard.store.put(shard.grad_key, torch.zeros(shard.numel, dtype=torch.float32), shard.grad_home)

    def _write_state(self, shard: _Shard, rows: torch.Tensor) -> None:
        if shard.rows:
            shard.store.put(shard.state_key, rows, shard.home)

    def _read_state(self, shard: _Shard) -> torch.Tensor:
        if not shard.rows:
            return torch.empty(0, shard.numel)
        return shard.store.read_copy(shard.state_key)

    # -- gradients during backward ---------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        p.grad = None
        self._ensure_layout()
        if not self._early:
            # (within update_during_backward() a new graph task here is a reentrant backward
            # nested in this one, not a new backward after an interrupted one: the block
            # resets itself when its backward fails)
            self._recover_interrupted_backward()
        if not self._callback_queued:
            self._callback_queued = True
            self._backward_task = graph_task()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        owner = self._hooked[id(p)]
        if owner[0].partition is not None:
            self._add_to_bucket(p, grad, owner)
        elif grad.is_cuda:
            self._drain_cuda([(p, 0)], grad)
        else:
            self._drain(p, grad)
        if grad.is_cuda and self._early and self._early_queue:
            self._advance_early(block=False)

    # -- several ranks: a group's gradients are reduce-scattered ----------------------------
    def _add_to_bucket(self, p: torch.Tensor, grad: torch.Tensor, owner) -> None:
        """Several ranks: add ``p``'s gradient into its group's bucket (the whole group, fp32,
        laid out like the group's bytes); once every parameter of the group that reports to
        this optimizer has, reduce-scatter it (see _reduce)."""
        manager, group, slot = owner
        bucket = self._buckets.get(id(group))
        if bucket is None:
            bucket = self._buckets[id(group)] = self._new_bucket(manager, group, grad.device, p)
        at = slot.whole.offset // bucket.itemsize
        bucket.data[at: at + grad.numel()].add_(grad.reshape(-1))
        bucket.got.add(id(p))
        if len(bucket.got) >= bucket.expected:
            self._reduce(bucket)

    def _new_bucket(self, manager, group, device: torch.device, p: torch.Tensor) -> "_Bucket":
        reporting = [s for s in group.slots if s.param.requires_grad and id(s.param) in self._hooked]
        sizes = {s.dtype.itemsize for s in reporting}
        if len(sizes) > 1:
            raise ValueError(
                f"parameter group {group.key!r} mixes parameters of dtypes "
                f"{sorted({str(s.dtype) for s in reporting})}; with several ranks a group's gradients are "
                "reduced as one buffer: set OffloadConfig(compute_dtype=...) so they share one")
        itemsize = sizes.pop() if sizes else next(s for s in group.slots if s.param is p).dtype.itemsize
        size = group.nbytes * manager.partition.world // itemsize
        return _Bucket(manager, group, torch.zeros(size, dtype=torch.float32, device=device), itemsize,
                       set(), len({id(s.param) for s in reporting}))

    def _reduce(self, bucket: "_Bucket") -> None:
        """Reduce-scatter a group's bucket: this rank receives the mean over ranks of its
        slice, fp32, and adds it into its shards' accumulators."""
        del self._buckets[id(bucket.group)]
        mine = torch.empty(bucket.group.nbytes // bucket.itemsize, dtype=torch.float32,
                           device=bucket.data.device)
        started = time.perf_counter()
        bucket.manager.partition.reduce_scatter_mean(mine, bucket.data)
        self.stats["reduce_seconds"] += time.perf_counter() - started
        bucket.data = None
        items = [(s.param, s.offset // bucket.itemsize) for s in bucket.group.slots
                 if s.count and id(s.param) in bucket.got]
        if mine.is_cuda:
            self._drain_cuda(items, mine)
        else:
            for p, base in items:
                self._drain(p, mine, base)

    def _reduce_pending(self) -> None:
        """End of backward: reduce the groups some of whose parameters got no gradient, in
        the groups' order (the same on every rank)."""
        if not self._buckets:
            return
        pending = list(self._buckets.values())
        pending.sort(key=lambda b: b.manager.groups.index(b.group))
        for bucket in pending:
            self._reduce(bucket)

    def _drain(self, p: torch.Tensor, grad: torch.Tensor, base: int = 0) -> None:
        """Add ``p``'s gradient into its shards' accumulators: element ``i`` of ``p`` is
        ``grad`` (flattened) at ``base + i`` (a reduced slice of a group: see _reduce)."""
        flat = grad.reshape(-1)
        if self._early:
            self._check_not_final(p)
        for seg in self._segments_of[id(p)]:
            shard = seg.shard
            acc = self._open(shard)
            at = base + seg.start
            acc[seg.offset: seg.offset + seg.length].add_(flat[at: at + seg.length])
            seg.has_grad = True
            shard.drained.add(id(p))
            if len(shard.drained) >= shard.expected:
                self._flush(shard)

    def _drain_cuda(self, items: list, grad: torch.Tensor) -> None:
        """Copy ``grad`` to pinned host memory on a side stream; add it on a worker thread
        into the accumulators of each ``(parameter, base)`` of ``items`` (see _drain)."""
        device = grad.device
        stream = self._d2h_streams.get(device)
        if stream is None:
            stream = self._d2h_streams[device] = torch.cuda.Stream(device)
        if self._drain_pool is None:
            self._drain_pool = ThreadPoolExecutor(1, thread_name_prefix=_DRAIN_THREAD)
        store = next((segs[0].shard.store for p, _ in items for segs in [self._segments_of[id(p)]] if segs),
                     None)
        if store is None:
            return  # (several ranks) none of these elements is held here
        buffer = store.staging.acquire(grad.numel() * grad.element_size())
        host = buffer.view(grad.dtype, (grad.numel(),))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host.copy_(grad.reshape(-1), non_blocking=True)
            grad.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)

        def add() -> None:
            try:
                event.synchronize()
                for p, base in items:
                    self._drain(p, host, base)
            finally:
                store.staging.release(buffer)

        self._drains.append(self._drain_pool.submit(add))

    def _check_not_final(self, p: torch.Tensor) -> None:
        """update_during_backward(): a gradient for a shard already final in this step."""
        for seg in self._segments_of[id(p)]:
            shard = seg.shard
            if id(shard) in self._early_done or shard in self._early_queue:
                if self._early_done:
                    self._interrupted = f"{len(self._early_done)} shards during backward"
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} received a gradient after its shard was "
                    "final in an update_during_backward() step (a second backward before step(), or a "
                    "reentrant backward that reports a parameter twice). "
                    + ("Shards updated already hold this step's weights: load a checkpoint or state "
                       "dicts to go on. " if self._early_done else "")
                    + "Run that backward outside update_during_backward()")

    def _sync_drains(self) -> None:
        drains, self._drains = self._drains, []
        for f in drains:
            f.result()
        self._recover_interrupted_backward()

    def _recover_interrupted_backward(self) -> None:
        """A backward stopped by an exception (Ctrl-C) never runs the end-of-backward
        callback it queued: close the accumulators it left open, keeping their partial sums
        as torch keeps ``p.grad`` after an interrupted backward (``zero_grad`` drops them)."""
        if self._callback_queued and graph_task() != self._backward_task:
            self._callback_queued = False
            self._buckets.clear()  # (several ranks: the other ranks' job failed too)
            self._flush_all()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._reduce_pending()
        if self._drain_pool is not None:
            self._drains.append(self._drain_pool.submit(self._flush_all))
        else:
            self._flush_all()

    def _flush_all(self) -> None:
        for shard in self._shards:
            if shard.acc is not None:
                self._flush(shard)

    def _open(self, shard: _Shard) -> torch.Tensor:
        if shard.acc is not None:
            return shard.acc
        store = shard.store
        if shard.grad_home is Tier.HOST:
            acc = store.wait(shard.grad_key, Tier.HOST)
            if not shard.grad_valid:
                acc.zero_()
            else:
                _settle(shard, acc)
        else:
            shard.acc_buffer = store.staging.acquire(shard.numel * 4)
            acc = shard.acc_buffer.view(torch.float32, (shard.numel,))
            if shard.grad_valid:  # an earlier backward of this cycle: add to it
                store.fetch(shard.grad_key, Tier.HOST, priority=0)
                acc.copy_(store.wait(shard.grad_key, Tier.HOST))
                store.evict(shard.grad_key, Tier.HOST)
                self.stats["read_bytes"] += shard.numel * 4
                _settle(shard, acc)
            else:
                acc.zero_()
        shard.acc = acc
        return acc

    def _flush(self, shard: _Shard) -> None:
        acc = shard.acc
        for seg in shard.segments:  # per parameter, for p.grad's norms (_grads)
            seg.sumsq, seg.maxabs = noted_norms(acc[seg.offset: seg.offset + seg.length])
        shard.sumsq = sum(seg.sumsq for seg in shard.segments)
        shard.maxabs = max((seg.maxabs for seg in shard.segments), default=0.0)
        shard.finite = math.isfinite(shard.maxabs)  # (a sum of squares can overflow where no element does)
        if shard.grad_home is Tier.HOST:
            shard.store.mark_dirty(shard.grad_key, Tier.HOST)
        else:
            shard.store.put(shard.grad_key, acc, shard.grad_home)
            shard.store.staging.release(shard.acc_buffer)
            shard.acc_buffer = None
            self.stats["write_bytes"] += shard.numel * 4
        shard.acc = None
        shard.grad_valid = True
        shard.drained.clear()
        if self._early and shard.wrapped:
            self._enqueue_early(shard)

    # -- the step --------------------------------------------------------------------------
    def _has_grads(self, shard: _Shard) -> bool:
        if shard.wrapped:
            return shard.grad_valid and any(s.has_grad for s in shard.segments)
        return any(s.param.grad is not None for s in shard.segments)

    def _found_inf(self) -> bool:
        found = any(shard.wrapped and shard.grad_valid and not shard.finite for shard in self._shards)
        found = found or any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                             for p in self._plain_params())
        partition = self._partition()
        if partition is not None:  # an overflow on any rank skips the step on all of them
            found = partition.max([float(found)])[0] > 0
        return found

    def _partition(self):
        """The partition of the wrapped model this optimizer serves, if several ranks."""
        for manager in _managers_of(self._shards):
            if manager.partition is not None:
                return manager.partition
        return None

    def _log(self, event: str, shard: _Shard) -> None:
        if self.events is not None:
            self.events.append((event, shard.index))

    def _issue_read(self, shard: _Shard, issued: set, pending: dict) -> None:
        if id(shard) in issued:
            return
        issued.add(id(shard))
        if shard.wrapped and not shard.master:  # host copies of the groups updated in place
            for seg in shard.segments:
                entry = pending.get(id(seg.owner[1]))
                if entry is not None and entry.in_place and not entry.fetched:
                    entry.fetched = True
                    if entry.manager.home is not Tier.HOST:  # else the host copy is its home
                        entry.manager.store.fetch(entry.group.key, Tier.HOST)
                        self.stats["read_bytes"] += entry.group.nbytes
        if shard.home is Tier.HOST:
            return
        self._log("read", shard)
        if shard.rows:
            shard.store.fetch(shard.state_key, Tier.HOST)
            self.stats["read_bytes"] += shard.state_bytes
        if shard.wrapped and shard.grad_home is not Tier.HOST:
            shard.store.fetch(shard.grad_key, Tier.HOST)
            self.stats["read_bytes"] += shard.numel * 4

    def _run_pipeline(self, work: list[_Shard], grad_scale: float, pending: dict | None = None) -> None:
        issued: set = set()
        progress = [0]  # shards whose update has begun
        if pending is None:
            pending = self._group_writes(work)
        try:
            self._pipeline(work, grad_scale, issued, progress, pending)
        except BaseException:
            self._abandon_pipeline(work[max(progress[0] - 1, 0):], issued)
            self._drop_group_copies(list(pending.values()))
            if progress[0]:
                self._interrupted = f"{progress[0]} of {len(work)} shards"
            raise

    def _drop_group_copies(self, entries: list) -> None:
        """After an exception: drop the host copies of parameter groups read for an in-place
        update and not written back (their tier keeps the bytes from before the step)."""
        for entry in entries:
            if not entry.in_place or not entry.fetched or entry.manager.home is Tier.HOST:
                continue  # (a home copy in host memory was updated where it rests)
            store, key = entry.manager.store, entry.group.key
            try:
                store.wait(key, Tier.HOST, timeout=60)
            except BaseException:
                continue
            if store.state(key, Tier.HOST) is Residency.RESIDENT:
                store.evict(key, Tier.HOST)
            entry.fetched, entry.data = False, None

    def _abandon_pipeline(self, rest: list[_Shard], issued: set) -> None:
        """After an exception in the step: drop the host copies of the shard being updated
        and of those read ahead (they would hold the host budget); their home keeps the
        states from before the step."""
        for shard in rest:
            if id(shard) not in issued or shard.home is Tier.HOST:
                continue
            for key, used in ((shard.state_key, shard.rows),
                              (shard.grad_key, shard.wrapped and shard.grad_home is not Tier.HOST)):
                if not used:
                    continue
                try:
                    shard.store.wait(key, Tier.HOST, timeout=60)
                except BaseException:  # a failed read has freed its copy already
                    continue
                if shard.store.state(key, Tier.HOST) is Residency.RESIDENT:
                    shard.store.evict(key, Tier.HOST)

    def _pipeline(self, work: list[_Shard], grad_scale: float, issued: set, progress: list[int],
                  pending: dict) -> None:
        for i, shard in enumerate(work):
            for nxt in work[i: i + 1 + _READ_AHEAD]:
                self._issue_read(shard if nxt is shard else nxt, issued, pending)
            progress[0] = i + 1
            self._process(shard, grad_scale, pending)

    def _process(self, shard: _Shard, grad_scale: float, pending: dict, *, busy: list | None = None) -> None:
        """Update ``shard`` (its reads issued) and start writing it back: states to their
        tier, parameter groups whose shards are all done to the parameter tier (into
        ``busy`` instead when given and the group is in use by a pass)."""
        waited = time.perf_counter()
        rows = shard.store.wait(shard.state_key, Tier.HOST) if shard.rows else None
        grads = shard.store.wait(shard.grad_key, Tier.HOST) if shard.wrapped else None
        views = self._in_place_views(shard, pending)
        self.stats["wait_seconds"] += time.perf_counter() - waited
        self._log("update_start", shard)
        self._update_shard(shard, rows, grads, grad_scale, views)
        self._log("update_end", shard)
        self._write_back(shard, rows, pending, busy)
        if shard.home is not Tier.HOST:
            self._log("write", shard)
            if shard.rows:
                shard.store.mark_dirty(shard.state_key, Tier.HOST)
                shard.store.evict(shard.state_key, Tier.HOST)
                self.stats["write_bytes"] += shard.state_bytes
            if shard.wrapped and shard.grad_home is not Tier.HOST:
                shard.store.evict(shard.grad_key, Tier.HOST)
        elif shard.rows:
            shard.store.mark_dirty(shard.state_key, Tier.HOST)

    def _in_place_views(self, shard: _Shard, pending: dict) -> dict | None:
        """For a wrapped shard without master rows: the fp32 tensor each segment is updated
        in (a slice of its group's host copy, or of a resident parameter)."""
        if not shard.wrapped or shard.master:
            return None
        views = {}
        for seg in shard.segments:
            manager, group, slot = seg.owner
            entry = pending.get(id(group))
            if entry is None:  # a resident parameter on a CPU device
                views[id(seg)] = slot.param.data.view(-1)[seg.start: seg.start + seg.length]
                continue
            if entry.data is None:
                entry.data = manager.store.wait(group.key, Tier.HOST)
            begin, end = slot.elements(seg.start, seg.length)
            views[id(seg)] = entry.data[begin: end].view(torch.float32)
        return views

    def _update_shard(self, shard: _Shard, rows: torch.Tensor | None, grads: torch.Tensor | None,
                      grad_scale: float, views: dict | None = None) -> None:
        # one fused call per torch param group and gradient factor (p.grad.mul_(c), clipping:
        # applied as the kernel's grad_scale, the stored sums untouched)
        by_group: dict[tuple[int, float], list[_Segment]] = defaultdict(list)
        for seg in shard.segments:
            if seg.length and (seg.has_grad if shard.wrapped else seg.param.grad is not None):
                by_group[seg.group_index, seg.scale].append(seg)
        temp = None  # fp32 CPU copies of gradients that are not (plain parameters only)
        tracer = shard.store.tracer
        began = tracer.now() if tracer is not None else 0.0
        try:
            for (gi, factor), segs in by_group.items():
                if factor == 0.0:  # p.grad.mul_(0): as torch's (an inf element becomes NaN)
                    for seg in segs:
                        part = grads[seg.offset: seg.offset + seg.length].mul_(0.0)
                        if shard.grad_home is Tier.HOST:  # (the resting sum itself: its books follow)
                            seg.sumsq, seg.maxabs = noted_norms(part)
                            seg.scale = 1.0
                    factor = 1.0
                temp = self._update_group(shard, gi, segs, rows, grads, grad_scale / factor, temp, views)
                if shard.wrapped and shard.grad_home is Tier.HOST and grad_scale / factor != 1.0:
                    _unscaled_in_place(segs, grad_scale / factor, grad_scale)
        finally:
            if temp is not None:
                shard.store.staging.release(temp)
            if tracer is not None:
                tracer.span(f"update shard {shard.index}", "optimizer", began, tracer.now(), "optimizer",
                            {"elements": shard.numel})

    def _update_group(self, shard: _Shard, gi: int, segs: list[_Segment], rows, grads,
                      grad_scale: float, temp, views: dict | None = None):
        """One fused call for the segments of torch param group ``gi`` in ``shard``."""
        group = self.param_groups[gi]
        params, gs, state_rows, steps = [], [], [[] for _ in self._rows_for(group)], []
        first = 1 if shard.master else 0
        for seg in segs:
            a, b = seg.offset, seg.offset + seg.length
            if shard.master:
                params.append(rows[0, a:b])
            elif views is not None:
                params.append(views[id(seg)])
            else:
                params.append(seg.param.data.view(-1)[seg.start: seg.start + seg.length])
            if shard.wrapped:
                gs.append(grads[a:b])
            else:
                g = seg.param.grad.reshape(-1)[seg.start: seg.start + seg.length]
                if g.dtype != torch.float32 or g.device.type != "cpu":
                    if temp is None:  # from the pool: reused across steps
                        temp = shard.store.staging.acquire(shard.numel * 4)
                    dest = temp.view(torch.float32, (shard.numel,))[a:b]
                    dest.copy_(g)
                    g = dest
                gs.append(g)
            for r in range(len(state_rows)):
                state_rows[r].append(rows[first + r, a:b])
            steps.append(seg.step)
        self._update(group, params, gs, state_rows, steps, grad_scale)
        return temp

    def _group_writes(self, work: list[_Shard], pending: dict | None = None) -> dict:
        """For each wrapped parameter group touched by this step and not in ``pending``
        already: how many of the step's shards cover it, and whether its current bytes must
        be read first (some of its parameters are not updated by this step)."""
        pending = {} if pending is None else pending
        new: dict[int, _GroupWrite] = {}
        covered: dict[int, int] = defaultdict(int)
        for shard in work:
            if not shard.wrapped:
                continue
            for owner in {id(s.owner[1]): s.owner for s in shard.segments}.values():
                if id(owner[1]) in pending:
                    continue
                entry = _new_group_write(owner)
                if entry is not None:
                    new.setdefault(id(owner[1]), entry).remaining += 1
            for seg in shard.segments:
                covered[id(seg.owner[1])] += seg.length * seg.owner[2].dtype.itemsize
        for key, entry in new.items():
            if not entry.in_place and covered[key] < entry.group.nbytes:
                entry.data = entry.manager.group_bytes(entry.group)  # keep what this step does not update
        pending.update(new)
        return pending

    def _write_back(self, shard: _Shard, rows: torch.Tensor | None, pending: dict,
                    busy: list | None = None) -> None:
        if not shard.master and not shard.wrapped:
            return  # plain fp32 CPU parameters were updated in place
        if not shard.wrapped:
            for seg in shard.segments:
                if seg.param.grad is not None and seg.length:
                    dest = seg.param.data.view(-1)[seg.start: seg.start + seg.length]
                    dest.copy_(rows[0, seg.offset: seg.offset + seg.length])
            return
        done = []
        for seg in shard.segments:
            entry = pending.get(id(seg.owner[1]))
            if entry is None or entry.in_place:  # updated where it rests: nothing to assemble
                continue
            if entry.data is None:
                entry.data = torch.empty(entry.group.nbytes, dtype=torch.uint8)
            slot = seg.owner[2]
            begin, end = slot.elements(seg.start, seg.length)
            entry.data[begin: end].view(slot.dtype).copy_(rows[0, seg.offset: seg.offset + seg.length])
            entry.written.append((begin, end - begin))
        for key in {id(seg.owner[1]) for seg in shard.segments}:
            entry = pending.get(key)
            if entry is None:
                continue
            entry.remaining -= 1
            if entry.remaining == 0:
                done.append(entry)
        for entry in done:
            del pending[id(entry.group)]
            if busy is not None and _in_use(entry):
                busy.append(entry)  # a pass still computes with the old bytes: write it later
            else:
                self._finish_group(entry)

    def _finish_group(self, entry: _GroupWrite, current: torch.Tensor | None = None) -> None:
        """Write a parameter group's new bytes to its tier. ``current``: its bytes before
        the step, where some of its parameters were not updated (assembled groups only)."""
        manager, group = entry.manager, entry.group
        if entry.in_place:
            if entry.data is None:
                return  # never read: no shard of it was updated
            manager.coordinator.forget(group.whole or group)  # device copies hold the old bytes
            manager.store.mark_dirty(group.key, Tier.HOST)
            if manager.home is not Tier.HOST:  # written home; the host copy dropped
                manager.store.evict(group.key, Tier.HOST)
                self.stats["write_bytes"] += group.nbytes
            return
        data = entry.data
        if current is not None:
            for offset, n in entry.written:
                current[offset: offset + n] = data[offset: offset + n]
            data = current
        manager.write_group(group, data)

    # -- loss scaling ----------------------------------------------------------------------
    def _init_loss_scale(self, loss_scale) -> None:
        if loss_scale == "auto":
            fp16 = any(p.dtype == torch.float16 for g in self.param_groups for p in g["params"])
            fp16 = fp16 or any(_owner_of(p) is not None and _owner_of(p)[2].dtype == torch.float16
                               for g in self.param_groups for p in g["params"])
            loss_scale = "dynamic" if fp16 else None
        self._dynamic = loss_scale == "dynamic"
        self._loss_scaled = False  # scale_loss() called since the last step
        self._scaler_enabled = loss_scale is not None
        self.loss_scale = 2.0 ** 16 if self._dynamic else float(loss_scale or 1.0)
        self._good_steps = 0
        self.growth_interval = 2000

    def _skip_step(self) -> None:
        self.stats["skipped_steps"] += 1
        if self._dynamic:
            self._grads.loss_scale_changed(self.loss_scale, max(self.loss_scale / 2, 1.0))
            self.loss_scale = max(self.loss_scale / 2, 1.0)
            self._good_steps = 0
        log.info("gradients overflowed: step skipped, loss scale now %g", self.loss_scale)

    def _grow_scale(self) -> None:
        if not self._dynamic:
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self._grads.loss_scale_changed(self.loss_scale, self.loss_scale * 2)
            self.loss_scale *= 2
            self._good_steps = 0


def _unscaled_in_place(segs: list[_Segment], divisor: float, loss_scale: float) -> None:
    """The update divided these segments' resting gradient sums by ``divisor`` in place
    (torch's fused kernels unscale their grads; SGD does the same): p.grad's books follow,
    so it still shows the clipped, unscaled gradient, and the next backward adds to the
    loss-scaled sum."""
    for seg in segs:
        seg.sumsq /= divisor * divisor
        seg.maxabs /= abs(divisor)
        seg.scale = loss_scale
    renote(segs[0].shard)


def _settle(shard: _Shard, acc: torch.Tensor) -> None:
    """Before a backward adds into a kept sum: the slices of parameters whose gradient was
    dropped (``p.grad = None``) become zero, and factors noted on it (``p.grad.mul_(c)``,
    clipping) are applied, as torch's in-place calls would have."""
    for seg in shard.segments:
        part = acc[seg.offset: seg.offset + seg.length]
        if not seg.has_grad:
            part.zero_()
        elif seg.scale != 1.0:
            part.mul_(seg.scale)
        seg.scale = 1.0


def _staggered(numel: int) -> int:
    """``numel`` rounded up so that rows of that many fp32 elements start ``_ROW_STAGGER``
    apart modulo 2 MiB (128 KiB for rows under 16 MiB); rows under 1 MiB are left alone."""
    row = numel * 4
    if row < (1 << 20):
        return numel
    period = 2 << 20 if row >= 16 << 20 else 128 << 10
    return numel + ((_ROW_STAGGER - row) % period) // 4


def _write_back_staging(owner) -> int:
    """Host bytes the step needs to write a parameter group of ``owner``'s model back to a
    parameter tier that is not host memory (a staging buffer of the largest group)."""
    if owner is None:
        return 0
    manager = owner[0]
    if manager.home is not Tier.NVME:
        return 0
    # a shard may finish one group and start the next: two groups at once
    sizes = sorted((g.nbytes for g in manager.groups if not g.resident), reverse=True)
    return sum(sizes[:2])


def _new_group_write(owner) -> _GroupWrite | None:
    """The record that writes ``owner``'s group back after the step, or None when nothing
    needs writing (resident parameters updated where they are)."""
    manager, group, _ = owner
    mode = _in_place(owner)
    if mode == "param":
        return None
    return _GroupWrite(manager, group, in_place=mode == "group")


def _in_place(owner) -> str | None:
    """How an fp32 wrapped parameter is updated without a master row: ``"group"`` (its
    group rests on NVMe or in host memory, and all of its parameters are fp32: the step
    updates the group's host copy, its home or a copy read from NVMe and written back),
    ``"param"`` (a resident parameter on a CPU device, updated where it is), or None (it
    needs an fp32 master row: another dtype, or a tier the step cannot update in place)."""
    manager, group, slot = owner
    if slot.dtype != torch.float32:
        return None
    if group.resident:
        data = slot.param.data
        return "param" if data.device.type == "cpu" and data.dtype == torch.float32 else None
    if manager.home in (Tier.NVME, Tier.HOST) and all(s.dtype == torch.float32 for s in group.slots):
        return "group"
    return None


def _in_use(entry: _GroupWrite) -> bool:
    """Whether a forward or backward pass still computes with the group's old bytes."""
    return entry.manager.coordinator.in_use(entry.group.whole or entry.group)


def _managers_of(shards: list[_Shard]) -> set:
    """The ParamManagers of the wrapped models whose parameters ``shards`` hold."""
    return {s.segments[0].owner[0] for s in shards if s.wrapped}


def _owner_of(p: torch.Tensor):
    from ..params import owner_of

    return owner_of(p)
