"""OffloadConfig: one frozen dataclass, validated at construction, loadable from a file.

Pure data: constructing a config reads no file and no cached profile. What depends on
the machine (the engine settings of ``io="auto"``, the backend of ``io_backend="auto"``,
whether ``log_path`` can be written) is resolved by ``offload._resolve`` where a config is
used.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ._units import parse_size

__all__ = ["OffloadConfig"]

_AUTO_WINDOW_MIN, _AUTO_WINDOW_MAX = 64 << 20, 256 << 20
_TIERS_PARAM = ("device", "host", "nvme")
_TIERS_OPTIM = ("host", "nvme")
_TIERS_ACT = ("host", "nvme")
_IO_MODES = ("auto", "manual")
_IO_BACKENDS = ("auto", "direct", "mmap")
_HOST_ALLOCATORS = ("auto", "lean", "system")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class OffloadConfig:
    """Where parameters and optimizer states rest, and the budgets that bound them.

    Sizes accept ints (bytes) or strings such as ``"8GiB"``; they are stored as ints.

    Attributes:
        device: compute device, ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        param_tier: where parameters rest between uses: ``"device"``, ``"host"`` or ``"nvme"``.
        optimizer_tier: where optimizer states rest: ``"host"`` or ``"nvme"``.
        nvme_path: directory for swap files; required when a tier is ``"nvme"``.
        device_budget: most bytes of managed parameters on the device at once, prefetch included.
        host_budget: most bytes of host buffers (pinned on CUDA) the runtime may hold.
        prefetch_bytes: bytes fetched ahead of use; ``"auto"``: four median-sized groups,
            between 64 and 256 MiB, within what the device budget leaves after the resident
            parameters and the groups a pass holds at once.
        compute_dtype: run parameters in this dtype (``"bf16"``, ``"fp16"``, ``"fp32"``, or a
            ``torch.dtype`` of those);
            ``None`` keeps the model's.
        resident_bytes: parameters of a module below this stay on the device, counted in
            the device budget (norms, biases). ``"auto"`` (default): 64 KiB, lowered as far as
            needed for the device budget to hold them and the groups in use at once; a value
            set explicitly is kept (and refused when the budget cannot hold it).
        group_bytes: consecutive modules are merged into one parameter group up to this size
            (fewer, larger transfers); 0 (default) keeps one group per module, which read
            fewer bytes per token in the inference benchmark (docs/benchmarks.md).
        cache_bytes: device bytes that keep parameter groups resident across passes (the
            most used first), so they are not read again every step or token; ``"auto"``:
            what the device budget leaves after the resident parameters, the groups in use
            at once and the prefetch window. A value set explicitly must fit next to the
            first two.
        io: where the file engine's settings come from when ``block_size``, ``io_threads``
            or ``queue_depth`` is not given: ``"auto"`` (default) reads the profile that
            ``offload-profile --path DIR`` cached for ``nvme_path`` (DIR is ``nvme_path`` or
            a parent of it on the same file system) and falls back to the built-in
            settings when there is none; ``"manual"`` always uses the built-in settings.
            Values given explicitly are always kept. Resolved at ``wrap`` (and by an
            optimizer's own store): ``offload._resolve.resolve_engine(config)`` gives the
            settings and their ``source``.
        io_backend: how NVMe bytes move: ``"direct"`` (the file engine, O_DIRECT: honest
            memory, fastest cold), ``"mmap"`` (shared mappings of the same swap files: the
            page cache serves repeated reads at memory speed; the pages the tier keeps on
            purpose stay within ``host_budget``), or ``"auto"`` (default): mmap where the
            file system refuses O_DIRECT, or where the NVMe data fits in ``host_budget`` and
            in the RAM left free after the budgets and the cached profile measured warm
            mmap reads faster than direct ones; direct otherwise. The choice and the reason
            are logged once at wrap (``offload._resolve.choose_io_backend``).
        log_path: append one JSON line per step here (what moved and waited; see
            ``offload.log_step``); ``tools/plot_log.py`` plots it. ``None``: no log.
            ``wrap`` refuses a path whose directory is missing or not writable.
        trace_path: record the timeline of transfers, compute, stalls and optimizer updates
            and write it here as a Chrome trace at ``unwrap`` (or ``offload.write_trace``).
            A debugging aid: it keeps every event in memory.
        block_size, io_threads, queue_depth: the file engine's settings: bytes per system
            call, worker threads, blocks in the kernel at once. ``None`` (default): resolved
            as ``io`` says (built-in: 8MiB, 32, 32).
        file_size: bytes per preallocated swap file.
        host_allocator: how torch's CPU tensors (activations and gradients on a CPU device,
            the host side's temporaries on CUDA) get their memory back to the kernel:
            ``"lean"`` fixes glibc's mmap threshold at 256 KiB, so RSS follows the tensors
            alive (each one above it is faulted in anew: step time where tensors churn in
            host memory); ``"system"`` leaves malloc as it is (fastest; glibc keeps freed
            memory, about the activations' size again, which ``offload.plan`` counts);
            ``"auto"`` (default): "lean" on CUDA, "system" on a CPU device (docs/memory.md).
            Process-wide, applied at ``wrap``; once "lean", the process stays lean.
        world_size: ranks the parameters are partitioned over (ZeRO-3, see
            docs/distributed.md). ``None`` (default): the default process group's size when
            ``torch.distributed`` is initialised, else 1. A number > 1 requires an initialised
            process group of that size. ``nvme_path`` may hold ``{rank}`` and
            ``{local_rank}``, filled in per rank at ``wrap``.
        activation_tier: where the tensors autograd saves for backward rest between forward
            and backward (``offload.activations``): ``None`` (default) leaves them where
            autograd put them; ``"host"`` (host buffers, pinned on CUDA) or ``"nvme"``
            (swap files under ``nvme_path/activations``). With activation checkpointing
            (``model.gradient_checkpointing_enable()``, ``torch.utils.checkpoint``) what is
            saved is the checkpoints' inputs; without it, every tensor the forward saves.
        activation_budget: bytes of saved activations kept where autograd put them (device
            memory on CUDA, RAM on a CPU device), the most recently saved first: backward
            needs them first. Older ones are moved to ``activation_tier`` as forward goes on.
        activation_host_budget: host buffers for activations: where they rest with
            ``activation_tier="host"``; with ``"nvme"``, the writes in flight (a forward
            that saves faster than the disk writes waits for them). ``"auto"`` (default):
            64 MiB for ``"nvme"`` (four 16 MiB pieces in flight keep the disk busy, two of
            them the copy buffers on an accelerator; the pool holds its buffers for the next
            step, so more would only raise RSS), 1 GiB for ``"host"``; see
            ``activation_host_bytes()``.
        activation_prefetch: bytes of offloaded activations read back ahead of backward (in
            the reverse of the order they were saved), in compute-device memory.
        read_in_place: with ``param_tier="nvme"`` and ``wrap(..., checkpoint=...)`` (safetensors),
            parameter groups whose tensors the file holds as the model computes on them rest
            in the checkpoint's files and are read from there (O_DIRECT, straight into
            place): setup writes nothing, and a group moves to a swap file only on
            its first write (copy on first write; the checkpoint is opened read-only and never
            written). A checkpoint file changed while the model runs is refused at the next
            read, naming it. ``False`` copies every group into swap files at ``wrap``.
        activation_min_bytes: saved tensors whose storage is smaller than this stay in place
            (not worth a transfer); each such save counts toward ``offload.stats``'
            ``act_small_bytes``.
    """

    device: str = "cuda"
    param_tier: str = "nvme"
    optimizer_tier: str = "nvme"
    nvme_path: str | None = None
    device_budget: int | str = "8GiB"
    host_budget: int | str = "16GiB"
    prefetch_bytes: int | str = "auto"
    compute_dtype: str | torch.dtype | None = None
    resident_bytes: int | str = "auto"
    group_bytes: int | str = 0
    cache_bytes: int | str = "auto"
    io: str = "auto"
    io_backend: str = "auto"
    block_size: int | str | None = None
    io_threads: int | None = None
    queue_depth: int | None = None
    file_size: int | str = "1GiB"
    log_path: str | None = None
    trace_path: str | None = None
    host_allocator: str = "auto"
    world_size: int | None = None
    activation_tier: str | None = None
    activation_budget: int | str = "512MiB"
    activation_host_budget: int | str = "auto"
    activation_prefetch: int | str = "64MiB"
    activation_min_bytes: int | str = "1MiB"
    read_in_place: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.read_in_place, bool):
            raise ValueError(f"read_in_place={self.read_in_place!r}: use True (read a checkpoint's weights where "
                             "they are) or False (copy them into swap files at wrap)")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for name in ("nvme_path", "log_path", "trace_path"):  # str or os.PathLike
            if getattr(self, name) is not None:
                set_(name, os.fspath(getattr(self, name)))
        set_("device", _check_device(self.device))
        set_("param_tier", _check_choice("param_tier", self.param_tier, _TIERS_PARAM))
        set_("optimizer_tier", _check_choice("optimizer_tier", self.optimizer_tier, _TIERS_OPTIM))
        for name in ("device_budget", "host_budget", "file_size", "activation_prefetch"):
            set_(name, parse_size(getattr(self, name), name=name))
        if self.activation_host_budget != "auto":
            set_("activation_host_budget", parse_size(self.activation_host_budget, name="activation_host_budget"))
        for name in ("activation_budget", "activation_min_bytes"):
            set_(name, parse_size(getattr(self, name), name=name, allow_zero=True))
        if self.activation_tier is not None:
            set_("activation_tier", _check_choice("activation_tier", self.activation_tier, _TIERS_ACT,
                                                  what="an activation tier (or None)"))
        if self.block_size is not None:
            set_("block_size", parse_size(self.block_size, name="block_size"))
        if self.resident_bytes != "auto":
            set_("resident_bytes", parse_size(self.resident_bytes, name="resident_bytes", allow_zero=True))
        set_("group_bytes", parse_size(self.group_bytes, name="group_bytes", allow_zero=True))
        if self.prefetch_bytes != "auto":
            set_("prefetch_bytes", parse_size(self.prefetch_bytes, name="prefetch_bytes", allow_zero=True))
        if self.cache_bytes != "auto":
            set_("cache_bytes", parse_size(self.cache_bytes, name="cache_bytes", allow_zero=True))
        if isinstance(self.compute_dtype, torch.dtype):  # (torch.bfloat16, as from_pretrained(dtype=) takes it)
            set_("compute_dtype", str(self.compute_dtype).removeprefix("torch."))
        if self.compute_dtype is not None and str(self.compute_dtype).lower() not in _DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not supported: use one of "
                             f"{sorted(set(_DTYPES))} or None to keep the model's dtype")
        for name in ("io_threads", "queue_depth"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.world_size is not None and (isinstance(self.world_size, bool) or
                                            not isinstance(self.world_size, int) or self.world_size < 1):
            raise ValueError(f"world_size={self.world_size!r} must be an int >= 1, or None to follow "
                             "torch.distributed")
        if self.block_size is not None and self.block_size % 4096:
            raise ValueError(f"block_size={self.block_size} must be a multiple of 4096 bytes")
        uses_nvme = "nvme" in (self.param_tier, self.optimizer_tier, self.activation_tier)
        if uses_nvme and not self.nvme_path:
            raise ValueError("nvme_path is required when param_tier, optimizer_tier or activation_tier is "
                             "'nvme': set OffloadConfig(nvme_path='/path/on/a/local/ssd') or choose 'host'")
        if self.nvme_path is not None:
            set_("nvme_path", os.path.abspath(os.path.expanduser(str(self.nvme_path))))
        for name in ("log_path", "trace_path"):  # checked for writing at wrap (offload._resolve)
            if getattr(self, name) is not None:
                set_(name, os.path.abspath(os.path.expanduser(str(getattr(self, name)))))
        set_("io", _check_choice("io", self.io, _IO_MODES, what="an I/O mode"))
        set_("io_backend", _check_choice("io_backend", self.io_backend, _IO_BACKENDS, what="an I/O backend"))
        set_("host_allocator", _check_choice("host_allocator", self.host_allocator, _HOST_ALLOCATORS,
                                             what="an allocator setting"))

    # -- derived ---------------------------------------------------------------------------
    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.compute_dtype is None else _DTYPES[str(self.compute_dtype).lower()]

    def prefetch_limit(self, room: int, typical_group: int = 0) -> int:
        """Bytes the prefetcher may have in flight or resident ahead of use, given the
        ``room`` the device budget leaves after what a pass holds at once.

        ``"auto"``: four typical (median) groups, at least 64 MiB and at most 256 MiB, and
        never more than ``room``. Enough to keep the disk's queue full; what the budget
        leaves beyond it keeps groups resident across passes, which reads fewer bytes per
        step (docs/benchmarks.md: a 64 MiB window generated 1.2 tok/s where 256 MiB gave 0.9).
        """
        if self.prefetch_bytes != "auto":
            return int(self.prefetch_bytes)
        window = min(max(4 * typical_group, _AUTO_WINDOW_MIN), _AUTO_WINDOW_MAX)
        return max(0, min(window, room))

    def activation_host_bytes(self) -> int:
        """``activation_host_budget`` in bytes (``"auto"`` resolved, see the attribute)."""
        if self.activation_host_budget != "auto":
            return int(self.activation_host_budget)
        return (64 << 20) if self.activation_tier != "host" else (1 << 30)

    def replace(self, **changes: Any) -> OffloadConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # -- files -----------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> OffloadConfig:
        """Load from JSON (or YAML when PyYAML is installed). Unknown keys are an error."""
        path = os.fspath(path)
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError as err:
            raise ValueError(f"cannot read config file {path!r}: {err.strerror}") from err
        data = _parse(path, text)
        if not isinstance(data, dict):
            raise ValueError(f"config file {path!r} must hold a mapping of settings, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config file {path!r} has unknown keys {unknown}: the known keys are "
                             f"{sorted(known)}")
        return cls(**data)


def _parse(path: str, text: str) -> Any:
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path!r} is YAML but PyYAML is not installed: pip install pyyaml, "
                             "or write the config as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path!r} is not valid YAML: {err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"config file {path!r} is not valid JSON: {err.msg} at line {err.lineno} "
                         f"column {err.colno}") from None


def _check_choice(name: str, value: Any, choices: tuple[str, ...], what: str = "a tier") -> str:
    text = str(value).lower()
    if text not in choices:
        raise ValueError(f"{name}={value!r} is not {what}: use one of {list(choices)}")
    return text


def _check_device(value: Any) -> str:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={value!r} is not a device: use 'cuda', 'cuda:N' or 'cpu'") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device={value!r} is not supported: use 'cuda', 'cuda:N' or 'cpu'")
    return str(device)
