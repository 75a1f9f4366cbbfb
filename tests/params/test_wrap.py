"""offload.wrap against the same model without offload: outputs, losses, gradients, weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload

transformers = pytest.importorskip("transformers")

TIERS = ["device", "host", "nvme"]


def config(tmp_path, tier, **kw):
    args = dict(device="cpu", param_tier=tier, optimizer_tier="host",
                nvme_path=str(tmp_path / "nvme") if tier == "nvme" else None,
                device_budget="64MiB", host_budget="256MiB", resident_bytes=0, file_size="16MiB", group_bytes=0)
    args.update(kw)
    return offload.OffloadConfig(**args)


def tiny_gpt2():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=211, n_positions=64,
                                  tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def tiny_llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=197,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def assert_grads_match_and_clear(model, ref):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
        p.grad = q.grad = None


def _batches(vocab, n=2, seq=16):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, seq), generator=g) for _ in range(n)]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_forward_backward_match_reference(tmp_path, tier, build, no_leaks):
    ref, model = build(), build()
    ids = _batches(model.config.vocab_size)[0]
    offload.wrap(model, config(tmp_path, tier, device_budget="2MiB" if tier != "device" else "64MiB"))
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


def test_tied_embeddings_share_one_group_and_grad(tmp_path, no_leaks):
    ref, model = tiny_gpt2(), tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    offload.wrap(model, config(tmp_path, "nvme", device_budget="2MiB"))
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
def test_modules_called_twice_and_activation_checkpointing(tmp_path, tier, make, no_leaks):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 16 if isinstance(model, CalledTwice) else 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    offload.wrap(model, config(tmp_path, tier, device_budget="64KiB" if tier != "device" else "1MiB"))
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
def test_inference_modes(tmp_path, mode, no_leaks):
    ref, model = tiny_llama(), tiny_llama()
    ids = _batches(model.config.vocab_size)[0]
    offload.wrap(model, config(tmp_path, "nvme", device_budget="1MiB"))
    try:
        ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
        for _ in range(3):
            with ctx():
                torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    finally:
        offload.unwrap(model)


def test_generate_matches(tmp_path, no_leaks):
    ref, model = tiny_gpt2(), tiny_gpt2()
    ids = torch.tensor([[5, 17, 42, 9]])
    offload.wrap(model, config(tmp_path, "nvme", device_budget="1MiB"))
    try:
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        out = model.generate(ids, **kwargs)
        assert torch.equal(out, ref.generate(ids, **kwargs))
        assert offload.stats(model)["prefetch_hits"] > 0
    finally:
        offload.unwrap(model)


def test_compute_dtype_runs_an_fp32_model_in_bf16(tmp_path, no_leaks):
    ref, model = tiny_llama(), tiny_llama()
    ids = _batches(model.config.vocab_size)[0]
    offload.wrap(model, config(tmp_path, "host", compute_dtype="bf16", device_budget="1MiB"))
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
def test_groups_merged_by_size_match_reference(tmp_path, group_bytes, no_leaks):
    ref, model = tiny_gpt2(), tiny_gpt2()
    ids = _batches(model.config.vocab_size)[0]
    offload.wrap(model, config(tmp_path, "nvme", group_bytes=group_bytes, resident_bytes="4KiB",
                               device_budget="2MiB"))
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
def test_checkpointed_layers_of_several_modules_under_a_tight_budget(tmp_path, tier, reentrant, no_leaks):
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
    offload.wrap(model, config(tmp_path, tier, device_budget=layer + 2 * largest, cache_bytes=0,
                               prefetch_bytes=0))
    try:
        for ids in _batches(model.config.vocab_size):
            torch.testing.assert_close(model(input_ids=ids, labels=ids).loss.detach(), ref(input_ids=ids, labels=ids).loss.detach())
            model(input_ids=ids, labels=ids).loss.backward()
            ref(input_ids=ids, labels=ids).loss.backward()
            assert_grads_match_and_clear(model, ref)
    finally:
        offload.unwrap(model)
