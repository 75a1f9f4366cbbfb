"""``offload-profile --validate``: the profile's disk figures against what offload's store
then achieves on a workload of distinct tensors, as a training run moves them."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable

import torch

from .._units import format_size

__all__ = ["validate", "validation_dir", "format_validation", "CHUNK"]

CHUNK = 32 << 20  # bytes per stored tensor: a transformer layer group of a ~1B-parameter model


def validation_dir(path: str) -> str:
    """Where the validation's swap files go: a directory the next run removes if this one is
    killed (the test files' pattern)."""
    return os.path.join(path, f".offload-profile-{os.getpid()}-validate.tmp")


def validate(path: str, report: dict[str, Any], nbytes: int,
             note: Callable[[str], None] = lambda label: None) -> dict[str, Any]:
    """Write ``nbytes`` of distinct 32 MiB tensors through the store's NVMe tier with the
    engine setting the profile chose (new extents), write them again (the steady state:
    each step overwrites what it wrote a step before), read them all back into the compute
    tier with a prefetch window; each phase timed to its last byte. Returns the store's
    figures and, per figure, the profile's prediction over what the store achieved."""
    from ..store import Tier, create_store

    choice = report["engine_choice"]
    count = max(1, nbytes // CHUNK)
    directory = validation_dir(path)
    source = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    # each tensor's number in the first 8 bytes of every 4 KiB page: no two pages of any two
    # tensors alike (nothing for a deduplicating disk to gain), at 16 KiB of writes a tensor
    stamp = source.view(-1, 4096)[:, :8].view(torch.int64)
    keys = [f"validate{i}" for i in range(count)]
    seconds: dict[str, float] = {}
    try:
        os.makedirs(directory)
        # one swap file for all, made (fallocated) by an untimed first put, as the profile's
        # test file is made before its clock starts
        with create_store(device="cpu", nvme_path=directory, device_budget=8 * CHUNK, host_budget=12 * CHUNK,
                          file_size=(count + 1) * CHUNK, block_size=choice["block_size"], threads=choice["threads"],
                          queue_depth=choice["queue_depth"], direct=choice["direct"]) as store:
            store.put("validate-open", source[:4096], Tier.NVME)
            store.wait("validate-open", Tier.NVME)
            for phase in ("first_write", "write"):
                note(f"validate: {phase.replace('_', ' ')} of {format_size(count * CHUNK)} through the store")
                started = time.perf_counter()
                for i, key in enumerate(keys):
                    stamp.fill_(i if phase == "first_write" else count + i)
                    store.put(key, source, Tier.NVME)  # copies before it returns; waits for staging room
                for key in keys:
                    store.wait(key, Tier.NVME)
                seconds[phase] = time.perf_counter() - started
            note(f"validate: read of {format_size(count * CHUNK)} through the store")
            ahead = store.tiers[Tier.DEVICE].budget // CHUNK - 1
            started = time.perf_counter()
            for key in keys[:ahead]:
                store.fetch(key, Tier.DEVICE)
            for i, key in enumerate(keys):
                data = store.wait(key, Tier.DEVICE)
                if int(data[:8].view(torch.int64)) != count + i:
                    raise RuntimeError(f"validate: {key} read back from {directory} is not what was written")
                del data  # (a view kept past evict would keep its buffer from reuse)
                store.evict(key, Tier.DEVICE)
                if i + ahead < count:
                    store.fetch(keys[i + ahead], Tier.DEVICE)
            seconds["read"] = time.perf_counter() - started
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    moved = count * CHUNK
    # without O_DIRECT the store's writes end in the page cache, not on the disk
    out: dict[str, Any] = {"bytes": moved, "tensor_bytes": CHUNK, "direct": bool(choice["direct"])}
    for phase, s in seconds.items():
        achieved = moved / s / 1e9
        predicted = report[f"disk_{phase}_gbps"]
        out[f"{phase}_gbps"] = round(achieved, 4)
        out[f"{phase}_predicted_gbps"] = round(predicted, 4)
        out[f"{phase}_ratio"] = round(predicted / achieved, 4)
    return out


def format_validation(v: dict[str, Any]) -> str:
    lines = [f"validation: offload's store on {format_size(v['bytes'])} of distinct "
             f"{format_size(v['tensor_bytes'])} tensors, against the profile"
             + ("" if v.get("direct", True) else " (buffered: no O_DIRECT here, writes land in the page cache; "
                "the ratios say little)")]
    for phase, name in (("read", "read"), ("write", "overwrite"), ("first_write", "first write")):
        lines.append(f"  {name:<12} store {v[f'{phase}_gbps']:.2f} GB/s, profile "
                     f"{v[f'{phase}_predicted_gbps']:.2f} GB/s: predicted/achieved {v[f'{phase}_ratio']:.2f}")
    return "\n".join(lines)
