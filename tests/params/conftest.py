"""Fixtures of the parameter-offload tests."""

from __future__ import annotations

import pytest
import torch

import offload


def _train_like_reference(model, ref, batches, run, lr=1e-3):
    """``run(model, batch)`` -> dict of output tensors with a ``"loss"``: every output and
    gradient of a first pass, then an AdamW step per further batch (losses compared), then
    the weights, against the reference ``ref`` (the same model without offload).

    Note: conditioning. The hooks add identity nodes to the autograd graph, so a gradient
    summed from several uses (q, k and v read one input) may be summed in another order:
    equal to rounding (checked). Adam's first steps turn a gradient near eps into an update
    of lr * g / (|g| + eps), which magnifies such rounding; eps 1e-6, a small lr and torch's
    fused kernel (offload.AdamW's) in the reference keep that under the tolerance, while a
    wrong gradient moves weights by about lr."""
    out, expected = run(model, batches[0]), run(ref, batches[0])
    for key in expected:
        torch.testing.assert_close(out[key], expected[key], msg=key)
    out["loss"].backward()
    expected["loss"].backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
        p.grad = q.grad = None
    opt = offload.AdamW(model.parameters(), lr=lr, eps=1e-6, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=1e-6, weight_decay=0.01, fused=True)
    for batch in batches[1:]:
        loss, ref_loss = run(model, batch)["loss"], run(ref, batch)["loss"]
        torch.testing.assert_close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    weights = offload.state_dict(model)
    for n, q in ref.state_dict().items():
        torch.testing.assert_close(weights[n], q, msg=n)
    opt.close()


@pytest.fixture
def train_like_reference():
    return _train_like_reference
