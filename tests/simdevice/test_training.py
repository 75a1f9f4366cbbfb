"""GPT-2 and Llama training on the simulated asynchronous device, against the same model
trained without offload: parameters on NVMe, optimizer states on NVMe or in host memory,
the update during backward or after it."""

from __future__ import annotations

import pytest

from .training import STEPS, reference, run_and_compare


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("optimizer_tier", ["nvme", "host"])
@pytest.mark.parametrize("during_backward", [False, True])
def test_training_equals_the_reference(tmp_path, arch, optimizer_tier, during_backward, tiny_gpt2, tiny_llama,
                                       lm_batches):
    build = tiny_gpt2 if arch == "gpt2" else tiny_llama
    vocab = 211 if arch == "gpt2" else 197
    batches = lm_batches(vocab, steps=STEPS)
    run_and_compare(tmp_path, build, batches, reference(build, batches, arch), seed=0,
                    optimizer_tier=optimizer_tier, during_backward=during_backward)
