"""Optimizers with states in host memory or on NVMe, updated on the CPU shard by shard."""

from ._checkpoint import CheckpointView, ShardRows
from ._formats import BLOCK, StateFormat, decode_piece
from ._optimizer import OffloadOptimizer
from ._phase import OptimizerPhase
from ._rules import SGD, Adam, AdamW, state_rows
from ._sizing import plan_rows
from ._early import SettingsChangedError
from ._statemap import OptimizerStateError

__all__ = ["AdamW", "Adam", "SGD", "OffloadOptimizer", "OptimizerPhase", "CheckpointView", "ShardRows",
           "plan_rows", "state_rows", "StateFormat", "BLOCK", "decode_piece", "OptimizerStateError",
           "SettingsChangedError"]
