"""Transformers architectures of every family, wrapped with parameters on NVMe and a device
budget of about 40% of the parameter bytes, against the same model without offload:
logits, loss and every gradient of a first pass, losses of three AdamW steps, the weights
after them, and greedy generation where the model generates."""

from __future__ import annotations

import copy

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")
T = transformers
V = 96  # vocabulary of the text models
LM = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def ids(batch=2, seq=12, seed=1):
    return torch.randint(3, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def causal(inputs):
    return {"input_ids": inputs, "labels": inputs}


def seq2seq(inputs):
    return {"input_ids": inputs, "labels": inputs.flip(1)}


def classify(inputs):
    return {"input_ids": inputs, "labels": torch.tensor([0, 1])}


def image(inputs):
    g = torch.Generator().manual_seed(int(inputs[0, 0]))
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([1, 2])}


def speech_ctc(inputs):
    g = torch.Generator().manual_seed(int(inputs[0, 0]))
    return {"input_values": torch.randn(2, 1600, generator=g), "labels": inputs[:, :6] % 20 + 1}


def speech_seq2seq(inputs):
    g = torch.Generator().manual_seed(int(inputs[0, 0]))
    return {"input_features": torch.randn(2, 16, 64, generator=g), "labels": inputs[:, :8]}


# name: (model class, config, inputs, generates)
ARCHITECTURES = {
    "llama-gqa": (T.LlamaForCausalLM, lambda: T.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        **LM), causal, True),
    "qwen2-gqa-bias": (T.Qwen2ForCausalLM, lambda: T.Qwen2Config(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
        **LM), causal, True),
    "gemma-tied": (T.GemmaForCausalLM, lambda: T.GemmaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, **LM), causal, True),
    "gpt2-conv1d-tied": (T.GPT2LMHeadModel, lambda: T.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, n_positions=64, **LM), causal, True),
    "gpt-neox": (T.GPTNeoXForCausalLM, lambda: T.GPTNeoXConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, **LM), causal, True),
    "mixtral-moe-fused-experts": (T.MixtralForCausalLM, lambda: T.MixtralConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, **LM), causal, True),
    "switch-moe-module-per-expert": (T.SwitchTransformersForConditionalGeneration, lambda: T.SwitchTransformersConfig(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
        encoder_sparse_step=1, decoder_sparse_step=1, decoder_start_token_id=0, **LM), seq2seq, True),
    "t5-encoder-decoder": (T.T5ForConditionalGeneration, lambda: T.T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4, decoder_start_token_id=0, **LM), seq2seq, True),
    "bart-encoder-decoder": (T.BartForConditionalGeneration, lambda: T.BartConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64, decoder_start_token_id=2, **LM),
        seq2seq, True),
    "bert-encoder-mlm": (T.BertForMaskedLM, lambda: T.BertConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, vocab_size=V), causal, False),
    "roberta-classifier": (T.RobertaForSequenceClassification, lambda: T.RobertaConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, num_labels=3, vocab_size=V, pad_token_id=0), classify, False),
    "vit-vision": (T.ViTForImageClassification, lambda: T.ViTConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, num_labels=4), image, False),
    "convnext-vision-cnn": (T.ConvNextForImageClassification, lambda: T.ConvNextConfig(
        num_channels=3, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 2, 1], num_labels=4, image_size=32), image, False),
    "wav2vec2-speech-ctc": (T.Wav2Vec2ForCTC, lambda: T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        vocab_size=24, ctc_zero_infinity=True, ctc_loss_reduction="mean"), speech_ctc, False),
    "whisper-speech-seq2seq": (T.WhisperForConditionalGeneration, lambda: T.WhisperConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
        max_target_positions=32, decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
        **LM), speech_seq2seq, False),
    "mamba-ssm": (T.MambaForCausalLM, lambda: T.MambaConfig(
        hidden_size=64, state_size=8, num_hidden_layers=4, expand=2, conv_kernel=4, time_step_rank=8, **LM),
        causal, True),
}


def build(name):
    cls, make_config, _, _ = ARCHITECTURES[name]
    torch.manual_seed(0)
    return cls(make_config()).eval()  # eval: no dropout, so both runs draw the same numbers


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_trains_and_generates_like_the_reference(name, tmp_path, train_like_reference, no_leaks):
    _, _, inputs, generates = ARCHITECTURES[name]
    ref = build(name)
    model = copy.deepcopy(ref)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    budget = int(0.4 * total)
    offload.wrap(model, offload.OffloadConfig(
        device="cpu", param_tier="nvme", optimizer_tier="host", nvme_path=str(tmp_path / "nvme"),
        device_budget=budget, host_budget="64MiB", file_size="8MiB",
        resident_bytes=0))  # every group streams: each way a model reaches its weights is exercised
    try:
        def run(m, batch):
            out = m(**batch)
            return {"logits": out.logits, "loss": out.loss}

        batches = [inputs(ids(seed=seed)) for seed in (1, 10, 11, 12)]
        train_like_reference(model, ref, batches, run)
        if generates:
            prompt = ids(batch=1, seq=5, seed=7)
            with torch.no_grad():
                got = model.generate(prompt, max_new_tokens=4, do_sample=False)
                want = ref.generate(prompt, max_new_tokens=4, do_sample=False)
            torch.testing.assert_close(got, want)
        stats = offload.stats(model)
        assert stats["device_peak_bytes"] <= budget
        assert stats["read_bytes"] > 0  # the parameters did stream from NVMe
    finally:
        offload.close(model)


SSMS = {
    "mamba": (T.MambaForCausalLM, lambda: T.MambaConfig(
        hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=4, **LM)),
    "mamba2": (T.Mamba2ForCausalLM, lambda: T.Mamba2Config(
        hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, head_dim=8, n_groups=1, num_heads=8,
        chunk_size=4, conv_kernel=4, **LM)),
}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", list(SSMS))
def test_ssm_mixers_under_checkpointing_give_torchs_gradients(name, reentrant, tmp_path, no_leaks):
    """Mamba's mixers use their children's weights directly (demand fetches) inside a
    checkpointed block: non-reentrant checkpointing saw those saves in the recompute only
    (CheckpointError), and under a tight budget the reentrant recompute read reused
    buffers (Mamba2's gradients off by up to 1.2)."""
    cls, make_config = SSMS[name]
    torch.manual_seed(0)
    ref = cls(make_config())
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model = copy.deepcopy(ref)
    offload.wrap(model, offload.OffloadConfig(
        device="cpu", param_tier="nvme", optimizer_tier="host", nvme_path=str(tmp_path / "nvme"),
        device_budget="2MiB", host_budget="64MiB", file_size="8MiB", resident_bytes=0))
    try:
        batch = causal(ids())
        for m in (ref, model):
            m(**batch).loss.backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
        assert offload.stats(model)["demand_fetches"] > 0
    finally:
        offload.close(model)
