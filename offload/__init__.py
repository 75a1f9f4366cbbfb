"""offload: train and run PyTorch models larger than GPU memory and RAM.

Parameters (and, in later layers, gradients and optimizer states) rest on the cheapest
tier that can serve them (device memory, host memory, NVMe files) and come back just in
time, driven by the model's own forward and backward.

    cfg = offload.OffloadConfig(device="cuda", param_tier="nvme", nvme_path="/mnt/nvme/x")
    model = offload.wrap(model, cfg)
    stats = offload.stats(model)   # bytes per tier, bytes moved, stall seconds, prefetch hits
    opt = offload.AdamW(model.parameters(), lr=1e-4)   # states in cfg.optimizer_tier
    offload.save_checkpoint("ckpt/step-100", model, opt, extra={"step": 100})

The lower layers are importable too: ``offload.io`` (aligned buffers, the async file
engine) and ``offload.store`` (the tiered tensor store); ``offload.profile`` measures the
machine (the ``offload-profile`` command).
"""

from ._units import format_size, parse_size
from .checkpoint import (CheckpointError, checkpoint_exists, export, load_checkpoint, load_state_dict_from, rng_state,
                         save_checkpoint, set_rng_state, state_dict)
from .config import OffloadConfig
from .optim import SGD, Adam, AdamW
from ._plan import MemoryPlan, MemoryPlanError
from ._planner import plan
from .params import close, init_empty_weights, log_step, note_step, reset_peak_stats, stats, unwrap, wrap, write_trace

from ._memory import mark_baseline

__version__ = "0.1.0"
mark_baseline()  # the RSS breakdown's "baseline": the interpreter and what was imported up to here

__all__ = ["OffloadConfig", "wrap", "unwrap", "close", "stats", "reset_peak_stats", "init_empty_weights",
           "log_step", "note_step", "write_trace",
           "AdamW", "Adam", "SGD", "plan", "MemoryPlan", "MemoryPlanError", "save_checkpoint",
           "load_checkpoint", "checkpoint_exists", "load_state_dict_from", "state_dict", "export", "rng_state", "set_rng_state", "CheckpointError", "parse_size",
           "format_size", "__version__"]
