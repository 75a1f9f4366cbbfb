"""Tests on the simulated asynchronous device (``sim.SimAccelerator``)."""

from __future__ import annotations

import pytest

from .sim import simulated


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/simdevice/" in str(item.fspath):
            item.add_marker(pytest.mark.simdevice)


@pytest.fixture
def sim():
    """The CPU device run as a simulated asynchronous one for the test."""
    with simulated(seed=0) as acc:
        yield acc


@pytest.fixture
def slow_sim():
    """The simulated device with delays of up to 20 ms a queued item: a copy issued by a
    test is still in flight at the test's next line, whatever the machine's load."""
    with simulated(seed=0, max_delay=0.02) as acc:
        yield acc
