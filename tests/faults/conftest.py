"""Fixtures of the fault-injection suite (the harness itself is fault_harness.py)."""

from __future__ import annotations

import pytest

import offload.optim._shards as optimizer_module
import offload.params._manager as manager_module
from offload.store import create_store


@pytest.fixture
def inject(monkeypatch):
    """``inject(backend)``: every store that wrap or an optimizer creates from now on uses
    ``backend`` (a FaultyBackend) for its system calls."""
    def use(backend):
        def faulty_store(*args, **kw):
            kw["file_backend"] = backend
            return create_store(*args, **kw)
        monkeypatch.setattr(manager_module, "create_store", faulty_store)
        monkeypatch.setattr(optimizer_module, "create_store", faulty_store)
        return backend
    return use
