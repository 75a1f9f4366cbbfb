"""Checkpoints of offloaded training state, and export to safetensors.

``save_checkpoint`` / ``load_checkpoint`` stream every tier's state (parameters, master
weights, moments, step counts) a group or shard at a time into a directory that appears
atomically, with a JSON manifest of checksummed raw tensors (no pickle). ``export`` writes
``from_pretrained``-compatible safetensors shards. See ``_format.py`` for the layout.
"""

from ._export import export
from ._format import CheckpointError, checkpoint_exists
from ._load import load_checkpoint, load_state_dict_from
from ._rng import rng_state, set_rng_state
from ._save import save_checkpoint, state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_exists", "load_state_dict_from", "state_dict", "export",
           "rng_state", "set_rng_state", "CheckpointError"]
