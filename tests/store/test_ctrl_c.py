"""Ctrl-C held back during the store's bookkeeping and delivered as that section ends:
the store's books stay balanced (nothing counted in flight without a transfer, no copy
held for a caller who never got its release), so close() returns."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from offload.store import Tier, create_store
from offload.store._store import TensorStore

MiB = 1 << 20


def closes_within(store, seconds: float = 20.0) -> bool:
    done = threading.Event()

    def close() -> None:
        store.close()
        done.set()

    threading.Thread(target=close, daemon=True).start()
    return done.wait(seconds)


@pytest.fixture
def store(tmp_path):
    s = create_store(device="cpu", device_budget="32MiB", host_budget="32MiB", nvme_path=str(tmp_path),
                     file_size="16MiB", block_size="256KiB")
    yield s
    if not s.closed:
        closes_within(s)


def sigint_inside(monkeypatch, method: str, when=lambda *a: True) -> None:
    """Send SIGINT to this process from inside the store's ``method`` (a section that holds
    Ctrl-C back), once."""
    original = getattr(TensorStore, method)
    fired = []

    def patched(self, *args, **kwargs):
        if not fired and when(*args):
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TensorStore, method, patched)


def test_ctrl_c_as_a_put_books_its_transfer(store, monkeypatch):
    from offload.store import Residency

    data = torch.arange(MiB, dtype=torch.float32)
    sigint_inside(monkeypatch, "_move", lambda record, copy, new: new is Residency.LOADING)
    with pytest.raises(KeyboardInterrupt):
        store.put("w", data, Tier.NVME)
    monkeypatch.undo()
    store.wait("w", Tier.NVME, timeout=20)  # the put's transfer was issued and lands
    assert torch.equal(store.read_copy("w").view(torch.float32), data)
    assert closes_within(store) and store._in_flight == 0


@pytest.mark.parametrize("loan", ["borrow_host", "read_into", "overwrite_in_place"])
def test_ctrl_c_as_a_loan_is_made_returns_it(store, monkeypatch, loan):
    data = torch.arange(MiB, dtype=torch.float32)
    store.put("w", data, Tier.HOST)
    store.wait("w", Tier.HOST)
    sigint_inside(monkeypatch, "_record")
    dest = torch.empty(4 * MiB, dtype=torch.uint8)
    with pytest.raises(KeyboardInterrupt):
        store.read_into("w", dest).wait() if loan == "read_into" else getattr(store, loan)("w")
    monkeypatch.undo()
    home = store._tensors["w"].copies[Tier.HOST]
    for _ in range(200):  # read_into's transfer ends on a worker: its release follows
        if home.readers == 0 and store._in_flight == 0:
            break
        threading.Event().wait(0.01)
    assert home.readers == 0 and store._in_flight == 0
    assert closes_within(store)
