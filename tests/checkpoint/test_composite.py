"""Modules that contain wrapped modules (a PeftModel around a wrapped base, a wrapped model
inside the user's own module): trained, checkpointed, resumed, merged and exported with
their own names, LoRA adapters included, equal to the same run without offload."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def lora(base):
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))


def build(order, cfg):
    """``wrap`` then ``get_peft_model``, or the other way round."""
    if order == "wrap-then-peft":
        return lora(offload.wrap(llama(), cfg))
    return offload.wrap(lora(llama()), cfg)


def batches():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 128, (2, 10), generator=g) for _ in range(5)]


def step(model, opt, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return out.loss.item()


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("order", ["wrap-then-peft", "peft-then-wrap"])
def test_lora_trains_checkpoints_resumes_merges_and_exports(order, tmp_path, no_leaks):
    def cfg(name):
        return offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme",
                                     nvme_path=str(tmp_path / name), device_budget="160KiB", host_budget="64MiB",
                                     file_size="8MiB", resident_bytes=0)

    ref = lora(llama())
    ref_opt = torch.optim.AdamW(trainable(ref), lr=1e-2, fused=True)
    model = build(order, cfg("a"))
    resumed = None
    try:
        for (n, p), (m, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert n == m
            torch.testing.assert_close(p, q, msg=n)
        opt = offload.AdamW(trainable(model), lr=1e-2)
        data = batches()
        for ids in data[:3]:
            torch.testing.assert_close(step(model, opt, ids), step(ref, ref_opt, ids))
        expected = ref.state_dict()
        for got in (offload.state_dict(model), model.state_dict()):  # the outer module's names, LoRA included
            assert list(got) == list(expected)
            for k in expected:
                torch.testing.assert_close(got[k], expected[k], msg=k)
        offload.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
        later = [step(model, opt, ids) for ids in data[3:]]
        resumed = build(order, cfg("b"))
        resumed_opt = offload.AdamW(trainable(resumed), lr=1e-2)
        offload.load_checkpoint(str(tmp_path / "ckpt"), resumed, resumed_opt)
        assert [step(resumed, resumed_opt, ids) for ids in data[3:]] == later  # bit-exact
        for ids in data[3:]:
            step(ref, ref_opt, ids)
        merged, ref_merged = resumed.merge_and_unload(), ref.merge_and_unload()
        ids = data[0]
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits)
        offload.export(merged, str(tmp_path / "export"))
        loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "export"))
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref_merged(input_ids=ids).logits)
        opt.close()
        resumed_opt.close()
    finally:
        for m in (model, resumed):
            if m is not None:
                for sub in m.modules():
                    offload.close(sub)


class Outer(nn.Module):
    """The user's own module around a wrapped model, with parameters of its own."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.scale = inner, nn.Parameter(torch.ones(()))

    def forward(self, ids, labels):
        return self.inner(input_ids=ids, labels=labels).loss * self.scale


def test_a_wrapped_model_inside_the_users_module(tmp_path, no_leaks):
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="host",
                                nvme_path=str(tmp_path / "nvme"), device_budget="160KiB", host_budget="64MiB",
                                file_size="8MiB", resident_bytes=0)
    ref = Outer(llama())
    outer = Outer(offload.wrap(llama(), cfg))
    try:
        opt = offload.AdamW(outer.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        for ids in batches()[:3]:
            loss, ref_loss = outer(ids, ids), ref(ids, ids)
            torch.testing.assert_close(loss, ref_loss)
            for m, o, lo in ((outer, opt, loss), (ref, ref_opt, ref_loss)):
                lo.backward()
                o.step()
                o.zero_grad()
        offload.save_checkpoint(str(tmp_path / "ckpt"), outer, opt)
        saved = offload.load_state_dict_from(str(tmp_path / "ckpt"))
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(saved[k], v, msg=k)
        opt.close()
    finally:
        offload.close(outer.inner)
