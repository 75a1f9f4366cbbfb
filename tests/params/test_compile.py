"""torch.compile over a wrapped model: what offload manages runs uncompiled
(``offload.params._eager``), so compiling the model or its layers gives the results of the
model without offload and leaves it usable; unwrap gives the forwards back."""

from __future__ import annotations

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")


def _train(model, step_model, opt, batches):
    losses = []
    for ids in batches:
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("how", ["model", "layers"])
def test_compiled_training_equals_the_model_without_offload(tmp_path, how, tiny_gpt2, lm_batches, offload_config,
                                                            no_leaks):
    batches = [micro[0] for micro in lm_batches(211, steps=3, micro=1)]
    ref = tiny_gpt2()
    want = _train(ref, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), batches)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, resident_bytes=0))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    try:
        if how == "model":  # aot_eager: AOTAutograd's graphs, where a captured weight buffer would show
            step_model = torch.compile(model, backend="aot_eager")
        else:  # as transformers compiles its layers
            for block in model.transformer.h:
                block.compile(backend="aot_eager")
            step_model = model
        got = _train(model, step_model, opt, batches)
        assert got == want
        with torch.no_grad():  # and uncompiled afterwards
            torch.testing.assert_close(model(input_ids=batches[0]).logits, ref(input_ids=batches[0]).logits,
                                       rtol=0, atol=0)
        assert offload.stats(model)["read_bytes"] > 0  # (the groups did stream)
    finally:
        opt.close()
        offload.unwrap(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
