"""Checkpoints in the layout transformers keeps on disk for some architectures, which
``from_pretrained`` converts while loading: renamed tensors are read under the model's
names (in place too) and equal ``from_pretrained``'s; fused or split ones are refused with
the way round, which then works."""

from __future__ import annotations

import logging

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")  # (transformers 5: older ones save models as named)


def _wrap(build, path, swap, **settings):
    with offload.init_empty_weights():
        model = build()
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme", nvme_path=str(swap),
                                device_budget="1MiB", host_budget="16MiB", resident_bytes=0, **settings)
    return offload.wrap(model, cfg, checkpoint=str(path)).eval()


@pytest.mark.parametrize("read_in_place", [True, False])
def test_renamed_tensors_are_read_under_the_models_names(tmp_path, read_in_place, caplog, no_leaks):
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, image_size=32, patch_size=8, num_labels=3)
    torch.manual_seed(0)
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "ckpt")
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "ckpt").eval()
    with caplog.at_level(logging.INFO, logger="offload"):
        model = _wrap(lambda: transformers.ViTForImageClassification(config), tmp_path / "ckpt", tmp_path / "swap",
                      read_in_place=read_in_place)
    assert "under the names transformers gives them" in caplog.text
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(pixel_values=pixels).logits, ref(pixel_values=pixels).logits,
                                   rtol=0, atol=0)
    offload.unwrap(model)


def test_fused_tensors_are_refused_with_the_way_round(tmp_path, no_leaks):
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=300)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    build = lambda: transformers.MixtralForCausalLM(config)  # noqa: E731
    with pytest.raises(ValueError, match=r"transformers converts when it loads a MixtralForCausalLM.*"
                                         r"from_pretrained.*save_model"):
        _wrap(build, tmp_path / "ckpt", tmp_path / "swap")
    ref = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_model(ref, str(tmp_path / "as_named.safetensors"))  # (the message's way round)
    model = _wrap(build, tmp_path / "as_named.safetensors", tmp_path / "swap2")
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    offload.unwrap(model)


def test_a_saved_buffer_takes_the_checkpoints_value(tmp_path, no_leaks):
    """A persistent buffer the model builds with a value of its own (Bart's
    final_logits_bias, zeros) is read from the checkpoint, as from_pretrained does."""
    config = transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     vocab_size=120, max_position_embeddings=64)
    torch.manual_seed(0)
    saved = transformers.BartForConditionalGeneration(config)
    saved.final_logits_bias.fill_(0.5)
    saved.save_pretrained(tmp_path / "ckpt")
    ref = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "ckpt").eval()
    model = _wrap(lambda: transformers.BartForConditionalGeneration(config), tmp_path / "ckpt", tmp_path / "swap")
    assert float(model.final_logits_bias[0, 0]) == 0.5
    ids = torch.randint(3, 120, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    offload.unwrap(model)
