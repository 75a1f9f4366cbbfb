"""Checkpoints as transformers keeps them on disk, read as ``from_pretrained`` reads them.

The layout transformers keeps for some architectures, which
``from_pretrained`` converts while loading: renamed tensors are read under the model's
names (in place too) and equal ``from_pretrained``'s; fused or split ones are built by
transformers' own converter (or, where it cannot run, refused with the way round)."""

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


def _mixtral():
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=300)
    return config, lambda: transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("shard", ["5GB", "40KB"])
def test_fused_experts_are_built_as_transformers_builds_them(tmp_path, shard, caplog, no_leaks):
    """Per-expert tensors of a save_pretrained file (sharded: one expert's in several
    files) are stacked and joined by transformers' own converter, into parameters equal to
    from_pretrained's; they are copied into the store, and train like any other."""
    config, build = _mixtral()
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "ckpt", max_shard_size=shard)
    ref = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    with caplog.at_level(logging.INFO, logger="offload"):
        model = _wrap(build, tmp_path / "ckpt", tmp_path / "swap")
    assert "as transformers builds them" in caplog.text and "fused experts" in caplog.text
    got = offload.state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                       ref.generate(ids, max_new_tokens=4, do_sample=False))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for m, o in ((model, opt), (ref, ref_opt)):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
    got = offload.state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, msg=name)
    opt.close()
    offload.unwrap(model)


def test_a_converter_with_several_targets_builds_each(tmp_path, no_leaks):
    """Dinov2's SwiGLU: one tensor of the file, mlp.weights_in, split into gate_proj and
    up_proj; the second is built along with the first and taken next."""
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, image_size=28, patch_size=14, use_swiglu_ffn=True)
    torch.manual_seed(0)
    transformers.Dinov2Model(config).save_pretrained(tmp_path / "ckpt")
    ref = transformers.Dinov2Model.from_pretrained(tmp_path / "ckpt").eval()
    model = _wrap(lambda: transformers.Dinov2Model(config), tmp_path / "ckpt", tmp_path / "swap")
    got = offload.state_dict(model)
    assert any("gate_proj" in n for n in got)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(pixel_values=pixels).last_hidden_state,
                                   ref(pixel_values=pixels).last_hidden_state, rtol=0, atol=0)
    offload.unwrap(model)


def test_a_converter_that_fails_is_refused_with_the_way_round(tmp_path, monkeypatch, no_leaks):
    config, build = _mixtral()
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "ckpt")

    def fails(self, mapping, load):
        raise RuntimeError("an operation this build cannot run")

    monkeypatch.setattr("offload.params._hf_built.BuiltParams._convert", fails)
    with pytest.raises(ValueError, match=r"transformers converts when it loads a MixtralForCausalLM.*cannot run.*"
                                         r"damaged or partly copied.*RAM for the whole model.*save_model"):
        _wrap(build, tmp_path / "ckpt", tmp_path / "swap")
    monkeypatch.undo()
    ref = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_model(ref, str(tmp_path / "as_named.safetensors"))  # (the message's way round)
    model = _wrap(build, tmp_path / "as_named.safetensors", tmp_path / "swap2")
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    offload.unwrap(model)


def test_parameters_computed_on_load_are_refused_with_the_way_round(tmp_path, no_leaks):
    """Marian's sinusoidal position tables are parameters its class does not save and
    from_pretrained computes: a meta model cannot; the message's way round reads."""
    config = transformers.MarianConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                       decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                       vocab_size=96, max_position_embeddings=32, pad_token_id=0,
                                       decoder_start_token_id=0)
    torch.manual_seed(0)
    transformers.MarianMTModel(config).save_pretrained(tmp_path / "ckpt")
    build = lambda: transformers.MarianMTModel(config)  # noqa: E731
    with pytest.raises(ValueError, match=r"embed_positions.*does not save them.*from_pretrained.*save_model"):
        _wrap(build, tmp_path / "ckpt", tmp_path / "swap")
    ref = transformers.MarianMTModel.from_pretrained(tmp_path / "ckpt").eval()
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_model(ref, str(tmp_path / "whole.safetensors"))
    model = _wrap(build, tmp_path / "whole.safetensors", tmp_path / "swap2")
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.generate(ids, max_new_tokens=4, num_beams=2),
                                   ref.generate(ids, max_new_tokens=4, num_beams=2))
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


def _tiny_llama_config(**kw):
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, **kw)


def _same_logits(model, ref, vocab):
    ids = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)


def test_the_files_from_pretrained_reads(tmp_path, no_leaks):
    """model.safetensors is the model, whatever else the directory holds (a variant, an
    adapter, a stale index), as from_pretrained takes it; without it, two files holding one
    tensor name are refused, not merged."""
    config = _tiny_llama_config()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt", variant="v2")  # model.v2.safetensors
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    build = lambda: transformers.LlamaForCausalLM(config)  # noqa: E731
    model = _wrap(build, tmp_path / "ckpt", tmp_path / "swap")
    _same_logits(model, ref, 128)
    offload.unwrap(model)
    (tmp_path / "ckpt" / "model.safetensors").rename(tmp_path / "ckpt" / "model.v1.safetensors")
    with pytest.raises(ValueError, match=r"is in both .*model.v1.safetensors.*model.v2.safetensors.*no index"):
        _wrap(build, tmp_path / "ckpt", tmp_path / "swap2")
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    shards[1].unlink()  # (a copy that stopped)
    with pytest.raises(FileNotFoundError, match=rf"index lists '{shards[1].name}', which is not there"):
        _wrap(build, tmp_path / "sharded", tmp_path / "swap3")


def test_tied_names_with_different_values_are_refused(tmp_path, no_leaks):
    """A file holding both names of a tied parameter with different values (transformers
    unties them) is refused with the way round, which then gives from_pretrained's model."""
    safetensors = pytest.importorskip("safetensors.torch")
    untied = _tiny_llama_config(tie_word_embeddings=False)
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(untied)
    safetensors.save_model(saved, str(tmp_path / "both.safetensors"))
    with pytest.raises(ValueError, match=r"holds both .*ties into one parameter, with different values.*"
                                         r"tie_word_embeddings=False"):
        _wrap(lambda: transformers.LlamaForCausalLM(_tiny_llama_config(tie_word_embeddings=True)),
              tmp_path / "both.safetensors", tmp_path / "swap")
    model = _wrap(lambda: transformers.LlamaForCausalLM(untied), tmp_path / "both.safetensors", tmp_path / "swap2")
    _same_logits(model, saved.eval(), 128)
    offload.unwrap(model)


@pytest.mark.parametrize("builder", ["accelerate", "assigned"])
def test_a_model_built_untied_where_its_config_ties_is_refused(builder, tmp_path, no_leaks):
    """A model whose config ties its output embedding, built with the two as separate
    parameters (accelerate.init_empty_weights builds it so), given a file holding both names
    with one value: from_pretrained ties them, so offload would train two parameters where
    it trains one. Refused naming tie_weights(), after which it is from_pretrained's model."""
    safetensors = pytest.importorskip("safetensors.torch")
    config = _tiny_llama_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(config)
    tensors = {k: v.clone() for k, v in saved.state_dict().items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # (both names, one value)
    config.save_pretrained(tmp_path / "both")
    safetensors.save_file(tensors, str(tmp_path / "both" / "model.safetensors"))

    def untied():
        if builder == "accelerate":
            with pytest.importorskip("accelerate").init_empty_weights():
                return transformers.LlamaForCausalLM(config)
        model = transformers.LlamaForCausalLM(config)
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
        return model

    assert untied().lm_head.weight is not untied().model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"ties 'lm_head.weight' to 'model.embed_tokens.weight'.*two parameters.*"
                                         r"model.tie_weights\(\) before offload.wrap"):
        _wrap(untied, tmp_path / "both", tmp_path / "swap")

    def retied():
        model = untied()
        model.tie_weights()
        return model

    model = _wrap(retied, tmp_path / "both", tmp_path / "swap2")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _same_logits(model, transformers.LlamaForCausalLM.from_pretrained(tmp_path / "both").eval(), 128)
    offload.unwrap(model)


def test_tensors_from_pretrained_passes_over(tmp_path, caplog, no_leaks):
    """Keys the class lists as ignorable (GPT-2's old causal masks) and buffers the model
    does not save (Llama's rotary inv_freq) are passed over, as from_pretrained does."""
    safetensors = pytest.importorskip("safetensors.torch")
    config = _tiny_llama_config()
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    tensors = {k: v.contiguous() for k, v in ref.state_dict().items()}
    tensors["model.rotary_emb.inv_freq"] = ref.model.rotary_emb.inv_freq.clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = ref.model.rotary_emb.inv_freq.clone()  # (older)
    safetensors.save_file(tensors, str(tmp_path / "old.safetensors"))
    with caplog.at_level(logging.INFO, logger="offload"):
        model = _wrap(lambda: transformers.LlamaForCausalLM(config), tmp_path / "old.safetensors", tmp_path / "s")
    assert "2 tensors not read, as from_pretrained does not read them" in caplog.text
    _same_logits(model, ref, 128)
    offload.unwrap(model)
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16)
    ref = transformers.GPT2LMHeadModel(gpt2).eval()
    tensors = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    tensors["transformer.h.0.attn.bias"] = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    safetensors.save_file(tensors, str(tmp_path / "gpt2.safetensors"))
    model = _wrap(lambda: transformers.GPT2LMHeadModel(gpt2), tmp_path / "gpt2.safetensors", tmp_path / "s2")
    _same_logits(model, ref, 128)
    offload.unwrap(model)


def test_generation_settings_come_with_the_checkpoint(tmp_path, no_leaks):
    """A save_pretrained directory's generation_config.json becomes the wrapped model's, as
    from_pretrained makes it; a model whose settings were changed before keeps them."""
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(_tiny_llama_config(eos_token_id=1, bos_token_id=2))
    saved.generation_config.repetition_penalty = 2.0
    saved.generation_config.max_new_tokens = 5
    saved.save_pretrained(tmp_path / "ckpt")
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    config = transformers.AutoConfig.from_pretrained(tmp_path / "ckpt")
    model = _wrap(lambda: transformers.LlamaForCausalLM(config), tmp_path / "ckpt", tmp_path / "swap")
    assert model.generation_config.repetition_penalty == 2.0
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert model.generate(ids, do_sample=False).tolist() == ref.generate(ids, do_sample=False).tolist()
    offload.unwrap(model)

    def own():
        m = transformers.LlamaForCausalLM(config)
        m.generation_config.max_new_tokens = 3
        return m
    model = _wrap(own, tmp_path / "ckpt", tmp_path / "swap2")
    assert model.generation_config.max_new_tokens == 3 and model.generation_config.repetition_penalty != 2.0
    offload.unwrap(model)

    # a single file saved beside its configs (the way round offload's refusals name): the
    # settings beside it come too (they were dropped, and generate ran 20 tokens, not 5)
    safetensors = pytest.importorskip("safetensors.torch")
    (tmp_path / "named").mkdir()
    safetensors.save_model(saved, str(tmp_path / "named" / "weights.safetensors"))
    saved.generation_config.save_pretrained(tmp_path / "named")
    model = _wrap(lambda: transformers.LlamaForCausalLM(config), tmp_path / "named" / "weights.safetensors",
                  tmp_path / "swap3")  # (no config.json beside it: a folder of other files, not taken)
    assert model.generation_config.repetition_penalty != 2.0
    offload.unwrap(model)
    saved.config.save_pretrained(tmp_path / "named")
    model = _wrap(lambda: transformers.LlamaForCausalLM(config), tmp_path / "named" / "weights.safetensors",
                  tmp_path / "swap4")
    assert model.generation_config.repetition_penalty == 2.0 and model.generation_config.max_new_tokens == 5
    offload.unwrap(model)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_compute_dtype_keeps_in_fp32_what_from_pretrained_keeps(tmp_path, dtype, no_leaks):
    """``from_pretrained(dtype=torch.float16)`` keeps T5's ``wo`` weights in fp32 (its
    ``_keep_in_fp32_modules``: their products overflow fp16); ``compute_dtype="fp16"`` used
    to cast them too, and the logits parted from from_pretrained's (4e-3 here, inf on real
    T5 checkpoints). Now they stay fp32 under fp16, as from_pretrained keeps them, and are
    cast under bf16, where transformers keeps only ``_keep_in_fp32_modules_strict``: logits
    equal from_pretrained's, bit for bit."""
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "ckpt")
    ref = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ckpt", dtype=torch_dtype).eval()
    model = _wrap(lambda: transformers.T5ForConditionalGeneration(config), tmp_path / "ckpt", tmp_path / "swap",
                  compute_dtype=dtype)
    try:
        kept = {n: p.dtype for n, p in model.named_parameters()}
        assert kept == {n: p.dtype for n, p in ref.named_parameters()}
        assert (kept["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == torch.float32) == (dtype == "fp16")
        ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids, decoder_input_ids=ids).logits,
                                       ref(input_ids=ids, decoder_input_ids=ids).logits, rtol=0, atol=0)
    finally:
        offload.close(model)

    class Outer(torch.nn.Module):  # (a T5 inside a module of the user's keeps them too)
        def __init__(self):
            super().__init__()
            self.t5, self.head = transformers.T5ForConditionalGeneration(config), torch.nn.Linear(4, 4)

    kept = offload.params.kept_in_fp32(Outer(), torch_dtype)
    assert (kept is not None and kept("t5.encoder.block.0.layer.1.DenseReluDense.wo.weight")) == (dtype == "fp16")
    assert kept is None or not kept("head.weight")
