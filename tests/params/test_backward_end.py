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


class _Stats(nn.Module):
    """Returns, beside its output, a statistic of its input that no loss uses."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w), x.pow(2).mean()


class _WeightNorm(nn.Module):
    """Nodes made before the input is used (the weight from v and g) run after its consumers."""

    def __init__(self):
        super().__init__()
        self.v, self.g = nn.Parameter(torch.randn(16, 16)), nn.Parameter(torch.ones(16, 1))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.g * self.v / self.v.norm(dim=1, keepdim=True))


@pytest.mark.parametrize("layer", [_Stats, _WeightNorm])
def test_each_group_is_held_once_and_alone_in_backward(tmp_path, layer, offload_config, record_schedule, no_leaks):
    """A branch that never runs in backward does not hold the module's group to the end of
    backward, and nodes that run after the input's consumers do not fetch it again."""
    def make():
        torch.manual_seed(0)
        return nn.ModuleList(layer() for _ in range(4))

    def run(layers, x):
        for m in layers:
            out = m(x)
            x = out[0] if isinstance(out, tuple) else out
        return x.sum()

    ref, model = make(), make()
    offload.wrap(model, offload_config(tmp_path, resident_bytes=0, device_budget="64KiB"))
    events = record_schedule(model)
    try:
        x = torch.ones(2, 16, requires_grad=True)
        run(model, x).backward()
        run(ref, x.detach().requires_grad_()).backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
        backward = [(e, key) for e, key, phase in events if phase == "backward" and e in ("acquire", "release")]
        assert backward == [(e, str(i)) for i in (3, 2, 1, 0) for e in ("acquire", "release")]
        during = events[events.index(("acquire", "3", "backward")): events.index(("release", "0", "backward"))]
        fetched = [key for e, key, _ in during if e == "fetch"]
        assert len(fetched) == len(set(fetched))  # nothing fetched again for a late node
    finally:
        offload.unwrap(model)


def test_a_forward_under_inference_mode_with_grad_enabled(tmp_path, tiny_gpt2, offload_config, no_leaks):
    ref, model = tiny_gpt2(), tiny_gpt2()
    offload.wrap(model, offload_config(tmp_path, resident_bytes=0))
    try:
        ids = torch.randint(0, 211, (2, 8), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode(), torch.enable_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    finally:
        offload.unwrap(model)
