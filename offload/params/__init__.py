"""Parameter offload: groups, hooks, and the coordinator that prefetches along the recorded order."""

from ._empty import init_empty_weights
from ._loading import CheckpointReader
from ._inplace import InPlaceChoice, InPlaceLayout, align_to_files, choose_in_place
from .._autograd import graph_task
from ._calls import Kind, kind_of, write_targets, NO_DATA, LAYOUT
from ._gradients import defer_to, hold_gradients, holder_of as gradient_holder, release_gradients, watch_trainable
from ._groups import slice_groups
from ._hf_keys import kept_in_fp32
from ._sizing import DeviceLayout, check_partitioned, device_layout
from ._originals import narrows
from ._registry import find, holders_of, manager_of, owner_of
from ._manager import ParamManager, close, unwrap, wrap
from ._observe import log_step, note_step, reset_peak_stats, stats, write_trace

__all__ = ["wrap", "unwrap", "close", "stats", "reset_peak_stats", "init_empty_weights", "manager_of", "owner_of", "holders_of", "find",
           "ParamManager", "slice_groups", "log_step", "note_step", "write_trace", "device_layout", "DeviceLayout", "graph_task",
           "hold_gradients", "release_gradients", "watch_trainable", "gradient_holder", "defer_to", "narrows", "Kind", "kind_of", "write_targets", "NO_DATA", "LAYOUT",
           "CheckpointReader", "InPlaceChoice", "choose_in_place", "align_to_files", "InPlaceLayout", "kept_in_fp32",
           "check_partitioned"]
