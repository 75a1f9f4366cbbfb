"""The seeded stress run: 50 trainings on the simulated device, each with other stream
delays, cycling through GPT-2 and Llama, optimizer states on NVMe or in host memory, the
update during backward or after it; every one equal to the reference without offload."""

from __future__ import annotations

import itertools

import pytest

from .training import STEPS, reference, run_and_compare

RUNS = 50
_CASES = list(itertools.islice(itertools.cycle(itertools.product(
    ["gpt2", "llama"], ["nvme", "host"], [False, True])), RUNS))


@pytest.mark.parametrize("seed", range(RUNS))
def test_seeded_run_equals_the_reference(tmp_path, seed, tiny_gpt2, tiny_llama, lm_batches):
    arch, optimizer_tier, during_backward = _CASES[seed]
    build = tiny_gpt2 if arch == "gpt2" else tiny_llama
    batches = lm_batches(211 if arch == "gpt2" else 197, steps=STEPS)
    run_and_compare(tmp_path, build, batches, reference(build, batches, arch), seed=1000 + seed,
                    max_delay=0.002, optimizer_tier=optimizer_tier, during_backward=during_backward)
