"""The end of a module's backward is seen without a node in the graph
(``offload.params._backward_end``): gradients are torch's to the bit where a streamed
module uses its input twice and something outside uses it too (an RMSNorm), a hook on a
module's input sees its whole gradient, and each group is released as backward leaves its
module, not at the end of backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload

transformers = pytest.importorskip("transformers")


def test_gradients_of_inputs_used_inside_and_outside_are_torchs(tmp_path, tiny_llama, lm_batches, offload_config,
                                                               no_leaks):
    ref, model = tiny_llama(), tiny_llama()
    offload.wrap(model, offload_config(tmp_path, resident_bytes=0))  # the norms stream too
    try:
        ids = lm_batches(197, steps=1, micro=1)[0][0]
        for m in (model, ref):
            m(input_ids=ids, labels=ids).loss.backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    finally:
        offload.unwrap(model)


class _Uses(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        return (self.b(h) + h).sum()  # h: into b, and around it


def test_a_hook_on_a_modules_input_sees_its_whole_gradient(tmp_path, offload_config, record_schedule, no_leaks):
    ref, model = _Uses(), _Uses()
    offload.wrap(model, offload_config(tmp_path, resident_bytes=0, device_budget="64KiB"))
    events = record_schedule(model)
    try:
        seen = {}

        def watch(name):
            def pre(mod, args):
                args[0].register_hook(lambda g: seen.__setitem__(name, g.clone()))
            return pre

        for name, m in (("ref", ref), ("ours", model)):
            m.b.register_forward_pre_hook(watch(name))
            m(torch.ones(2, 16, requires_grad=True)).backward()
        torch.testing.assert_close(seen["ours"], seen["ref"], rtol=0, atol=0)
        backward = [(e, key) for e, key, phase in events if phase == "backward"]
        # b's group is released as backward leaves b, before a's is acquired
        assert backward.index(("release", "b")) < backward.index(("acquire", "a"))
    finally:
        offload.unwrap(model)
