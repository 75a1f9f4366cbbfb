"""offload.wrap against the same model without offload: outputs, losses, gradients, weights."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload

transformers = pytest.importorskip("transformers")

TIERS = ["device", "host", "nvme"]


# this file's models and config: a 3-layer GPT-2 with transformers' default dropout (off in
# eval mode); optimizer states in host memory, budgets that bind only where a test sets
# them, nothing kept resident, one group per module
GPT2 = dict(n_layer=3, dropout=0.1)
WRAP = dict(optimizer_tier="host", device_budget="64MiB", host_budget="256MiB", resident_bytes=0, group_bytes=0)


def assert_grads_match_and_clear(model, ref):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
        p.grad = q.grad = None


def _batches(vocab, n=2, seq=16):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, seq), generator=g) for _ in range(n)]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_forward_backward_match_reference(tmp_path, tier, arch, tiny_gpt2, tiny_llama, offload_config, no_leaks):
    build = functools.partial(tiny_gpt2, **GPT2) if arch == "gpt2" else tiny_llama
    ref, model = build().eval(), build().eval()
    ids = _batches(model.config.vocab_size)[0]
    offload.wrap(model, offload_config(tmp_path, WRAP, param_tier=tier,
                                       device_budget="2MiB" if tier != "device" else "64MiB"))
    try:
        for _ in range(2):  # the second pass runs on the recorded order, with prefetch
            out, expected = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
            torch.testing.assert_close(out.logits, expected.logits)
            torch.testing.assert_close(out.loss, expected.loss)
            out.loss.backward()
            expected.loss.backward()
            assert_grads_match_and_clear(model, ref)
        s = offload.stats(model)
        assert s["device_peak_bytes"] <= 2 << 20 or tier == "device"
        if tier != "device":
            assert s["prefetch_hits"] > 0
    finally:
        offload.unwrap(model)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_tied_embeddings_share_one_group_and_grad(tmp_path, tiny_gpt2, offload_config, no_leaks):
    ref, model = tiny_gpt2(**GPT2).eval(), tiny_gpt2(**GPT2).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    offload.wrap(model, offload_config(tmp_path, WRAP, param_tier="nvme", device_budget="2MiB"))
    try:
        assert model.lm_head.weight is model.transformer.wte.weight
        ids = _batches(model.config.vocab_size)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        ref(input_ids=ids, labels=ids).loss.backward()
        torch.testing.assert_close(model.transformer.wte.weight.grad, ref.transformer.wte.weight.grad)
        keys = [g.key for g in offload.params.manager_of(model).groups]
        assert not any(k.startswith("lm_head") for k in keys)
    finally:
        offload.unwrap(model)


class CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.shared = nn.Linear(32, 32)
        self.outp = nn.Linear(32, 4)
        self.scale = nn.Parameter(torch.ones(32))  # used by this module outside any child

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.shared(h)) * self.scale
        h = torch.relu(self.shared(h))  # the same module again
        return self.outp(h)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("make", [CalledTwice, lambda: Checkpointed(True), lambda: Checkpointed(False)],
                         ids=["called_twice", "checkpoint_reentrant", "checkpoint_nonreentrant"])
def test_modules_called_twice_and_activation_checkpointing(tmp_path, tier, make, offload_config, no_leaks):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 16 if isinstance(model, CalledTwice) else 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    offload.wrap(model, offload_config(tmp_path, WRAP, param_tier=tier,
                                       device_budget="64KiB" if tier != "device" else "1MiB"))
    try:
        for _ in range(3):
            out, expected = model(x), ref(x_ref)
            torch.testing.assert_close(out, expected)
            out.square().sum().backward()
            expected.square().sum().backward()
            torch.testing.assert_close(x.grad, x_ref.grad)
            assert_grads_match_and_clear(model, ref)
            x.grad = x_ref.grad = None
    finally:
        offload.unwrap(model)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_modes(tmp_path, mode, tiny_llama, offload_config, no_leaks):
    ref, model = tiny_llama().eval(), tiny_llama().eval()
    ids = _batches(model.config.vocab_size)[0]
    offload.wrap(model, offload_config(tmp_path, WRAP, param_tier="nvme", device_budget="1MiB"))
    try:
        ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
        for _ in range(3):
            with ctx():
                torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    finally:
        offload.unwrap(model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_wrapped_under_inference_mode_then_trained(tmp_path, arch, tiny_llama, tiny_gpt2, offload_config, no_leaks):
    """wrap() called within inference mode (an inference script that goes on to fine-tune):
    what it makes is ordinary, so a training step after it equals the reference's."""
    build = tiny_llama if arch == "llama" else tiny_gpt2
    ref, model = build(), build()
    ids = _batches(model.config.vocab_size)[0]
    with torch.inference_mode():  # (the default config keeps small parameters resident: made by wrap())
        offload.wrap(model, offload_config(tmp_path))
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    try:
        loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        assert_grads_match_and_clear(model, ref)
    finally:
        with torch.inference_mode():
            offload.unwrap(model)
    model(input_ids=ids, labels=ids).loss.backward()  # unwrapped within inference mode: ordinary tensors


def test_generate_matches(tmp_path, tiny_gpt2, offload_config, no_leaks):
    ref, model = tiny_gpt2(**GPT2).eval(), tiny_gpt2(**GPT2).eval()
    ids = torch.tensor([[5, 17, 42, 9]])
    offload.wrap(model, offload_config(tmp_path, WRAP, param_tier="nvme", device_budget="1MiB"))
    try:
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        out = model.generate(ids, **kwargs)
        assert torch.equal(out, ref.generate(ids, **kwargs))
        assert offload.stats(model)["prefetch_hits"] > 0
    finally:
        offload.unwrap(model)


def test_compute_dtype_runs_an_fp32_model_in_bf16(tmp_path, tiny_llama, offload_config, no_leaks):
    ref, model = tiny_llama().eval(), tiny_llama().eval()
    ids = _batches(model.config.vocab_size)[0]
    offload.wrap(model, offload_config(tmp_path, WRAP, param_tier="host", compute_dtype="bf16",
                                       device_budget="1MiB"))
    try:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        for p in ref.parameters():  # parameters only: buffers (rotary frequencies) keep their dtype
            p.data = p.data.to(torch.bfloat16)
        with torch.no_grad():
            expected = ref(input_ids=ids).logits
        torch.testing.assert_close(logits, expected)
    finally:
        offload.unwrap(model)


@pytest.mark.parametrize("group_bytes", ["100KiB", "1MiB"])
def test_groups_merged_by_size_match_reference(tmp_path, group_bytes, tiny_gpt2, offload_config, no_leaks):
    ref, model = tiny_gpt2(**GPT2).eval(), tiny_gpt2(**GPT2).eval()
    ids = _batches(model.config.vocab_size)[0]
    offload.wrap(model, offload_config(tmp_path, WRAP, param_tier="nvme", group_bytes=group_bytes,
                                       resident_bytes="4KiB", device_budget="2MiB"))
    try:
        groups = offload.params.manager_of(model).groups
        streamed = [g for g in groups if not g.resident]
        assert any(len(g.slots) >= 4 for g in streamed)  # several modules (weight + bias each) share a group
        assert all(g.nbytes <= 100 << 10 for g in streamed if len(g.slots) > 2) or group_bytes == "1MiB"
        for _ in range(2):
            out, expected = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
            torch.testing.assert_close(out.loss, expected.loss)
            out.loss.backward()
            expected.loss.backward()
            assert_grads_match_and_clear(model, ref)
    finally:
        offload.unwrap(model)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_checkpointed_layers_of_several_modules_under_a_tight_budget(tmp_path, tier, reentrant, tiny_llama,
                                                                     offload_config, no_leaks):
    """A checkpointed transformer layer recomputes several modules (q/k/v/o, the MLP) inside
    backward before backward reaches them: what the recomputation saves are views of their
    group buffers, which must not be reused by the next module's group in the meantime."""
    ref, model = tiny_llama().train(), tiny_llama().train()
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    # room for one layer's groups (held from its recomputation to the end of its backward)
    # and two more groups: a fraction of the model, so buffers are reused all along
    largest = max(p.numel() * 4 for p in model.parameters())
    layer = max(sum(p.numel() * 4 for p in block.parameters()) for block in model.model.layers)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert layer + 2 * largest < 0.8 * total
    offload.wrap(model, offload_config(tmp_path, WRAP, param_tier=tier, device_budget=layer + 2 * largest,
                                       cache_bytes=0, prefetch_bytes=0))
    try:
        for ids in _batches(model.config.vocab_size):
            torch.testing.assert_close(model(input_ids=ids, labels=ids).loss.detach(), ref(input_ids=ids, labels=ids).loss.detach())
            model(input_ids=ids, labels=ids).loss.backward()
            ref(input_ids=ids, labels=ids).loss.backward()
            assert_grads_match_and_clear(model, ref)
    finally:
        offload.unwrap(model)
