"""Tiers, residency states and the checked transitions between them."""

from __future__ import annotations

import enum

__all__ = ["Tier", "Residency", "StoreError", "check_transition"]


class Tier(enum.Enum):
    """Where bytes can rest, fastest first."""

    DEVICE = "device"  # the compute device: cuda, cuda:N or cpu
    HOST = "host"  # host memory (pinned on CUDA)
    NVME = "nvme"  # preallocated files on a local disk

    @classmethod
    def parse(cls, value: "Tier | str") -> "Tier":
        if isinstance(value, Tier):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(repr(t.value) for t in cls)
            raise ValueError(f"unknown tier {value!r}: use one of {names}") from None


class Residency(enum.Enum):
    """The state of one copy of a stored tensor in one tier."""

    ABSENT = "absent"  # no copy, no space held
    QUEUED = "queued"  # a fetch waits for space in the tier's budget
    LOADING = "loading"  # space held, bytes on their way in
    RESIDENT = "resident"  # bytes here and valid
    STORING = "storing"  # valid bytes here, being written back before the copy is dropped


class StoreError(RuntimeError):
    """An operation that the current state of a stored tensor does not allow."""


class TransferInterrupted(StoreError):
    """A transfer whose start was cut short by a KeyboardInterrupt (or another
    BaseException): the copy it was filling is dropped; a put's bytes are lost."""


_ALLOWED = {
    Residency.ABSENT: {Residency.QUEUED, Residency.LOADING, Residency.RESIDENT},
    Residency.QUEUED: {Residency.LOADING, Residency.ABSENT},
    Residency.LOADING: {Residency.RESIDENT, Residency.ABSENT},
    Residency.RESIDENT: {Residency.STORING, Residency.ABSENT},
    Residency.STORING: {Residency.ABSENT, Residency.RESIDENT},
}


def check_transition(key: str, tier: Tier, old: Residency, new: Residency) -> None:
    if new not in _ALLOWED[old]:
        raise StoreError(
            f"tensor {key!r} in tier {tier.value}: cannot go from {old.value} to {new.value}"
        )
