"""What ``offload.checkpoint`` sees of an offload optimizer: its shards' state rows (names,
elements, the bytes in the store), the loss scaler's state, and a load bracketed by
:meth:`CheckpointView.loading`, which poisons the optimizer when the load does not complete
(some rows would be new and some old) and otherwise leaves it as a fresh step would."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ._formats import Packing, RowCode
from ._layout import Segment, Shard
from ._scaler import LossScaler
from ._statedict import masters_to_take
from ._states import StateRows

__all__ = ["CheckpointView", "ShardRows"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRows:
    """One shard's state rows: ``names[r]`` is row ``r``, each ``numel`` fp32 elements, the
    segments saying which elements of which parameter lie where in a row."""
    shard: Shard
    names: list[str]

    @property
    def numel(self) -> int:
        return self.shard.numel

    @property
    def nbytes(self) -> int:
        """The rows' bytes as they rest (coded rows: smaller than ``decoded_nbytes``)."""
        return self.shard.state_bytes

    @property
    def decoded_nbytes(self) -> int:
        """The rows' bytes as fp32, ``len(names) x numel``, what ``CheckpointView.write`` takes."""
        return len(self.names) * self.shard.numel * 4

    @property
    def packing(self) -> Packing:
        """Where each row's bytes rest (``_formats``)."""
        return self.shard.packing if self.shard.packed else Packing((RowCode.FP32,) * len(self.names), self.numel)

    @property
    def segments(self) -> list[Segment]:
        return self.shard.segments

    def read_into(self, dest: torch.Tensor) -> Any:
        """Start copying the rows' bytes into ``dest``; returns a completion."""
        return self.shard.store.read_into(self.shard.state_key, dest)

    def borrow(self) -> tuple[torch.Tensor, Any] | None:
        """``(bytes, release)`` where the rows rest in host memory, else None."""
        return self.shard.store.borrow_host(self.shard.state_key)

    def overwrite_in_place(self) -> tuple[torch.Tensor, Any] | None:
        """``(bytes, done)`` of the resting rows to read new values into, else None."""
        key = self.shard.state_key
        return self.shard.store.overwrite_in_place(key) if key in self.shard.store else None


class CheckpointView:
    def __init__(self, *, prepare: Callable[[], list[Shard]], states: StateRows, scaler: LossScaler,
                 loading: Callable[[str], Any], reset_gradients: Callable[[], None],
                 holds_gradients: Callable[[], bool], staging: Any, moments: str = "fp32", master: str = "fp32",
                 scratch_released: Callable[[], Any] = contextlib.nullcontext):
        self._prepare, self._states, self._scaler = prepare, states, scaler
        self._scratch_released = scratch_released
        self._loading, self._reset_gradients = loading, reset_gradients
        self._holds_gradients = holds_gradients
        self._moments, self._master = moments, master
        self.staging = staging  # the optimizer's own host pool (parameters of no wrapped model), or None

    def shards(self) -> list[ShardRows]:
        """Every shard (SGD without momentum keeps no rows, only step counts), after the
        step's write-backs have landed."""
        return [ShardRows(s, self._states.names(s) if s.rows else []) for s in self._prepare()]

    def holds_gradients(self) -> bool:
        """Whether gradients accumulated since the last step are held (a checkpoint does
        not save them)."""
        return self._holds_gradients()

    @property
    def moments(self) -> str:
        """How the optimizer keeps its moment rows (``_formats.StateFormat``'s value)."""
        return self._moments

    @property
    def master(self) -> str:
        """How the optimizer keeps its master rows."""
        return self._master

    def scaler_state(self) -> dict:
        return self._scaler.state_dict()

    def masters_to_take(self) -> list[torch.Tensor]:
        """The fp32 parameters that are their own masters (no master row): a checkpoint's
        fp32 ``master_param`` for one replaces its narrower saved weight (``_statedict``)."""
        return masters_to_take(self._prepare())

    def current_values(self, seg: Segment) -> torch.Tensor:
        """The values a master row of ``seg`` starts from (a checkpoint without masters)."""
        return self._states.current_values(seg)

    def write(self, rows: ShardRows, values: torch.Tensor) -> None:
        """Replace a shard's rows (``rows x numel`` fp32; coded as the optimizer keeps them)."""
        self._states.write(rows.shard, values)

    @contextlib.contextmanager
    def loading(self, scaler_state: dict | None) -> Iterator[None]:
        """Bracket a load into this optimizer: a load that raises leaves it poisoned (it
        refuses to step until a load succeeds); one that completes takes the saved loss
        scale, drops held gradients and any writes to the parameters made before it."""
        with self._loading("checkpoint load"), self._scratch_released():  # (its coded rows decode in their own)
            yield
            self._states.forget_writes()  # its master rows came with the weights
            self._states.masters_taken()
            if self._holds_gradients():  # (torch's load_state_dict keeps p.grad: a load here does not)
                log.warning("load_checkpoint: gradients accumulated since the last step() were dropped (the "
                            "checkpoint's state has none); load before the backward whose step should use them")
            self._reset_gradients()
            self._scaler.load_state_dict(scaler_state or {})
