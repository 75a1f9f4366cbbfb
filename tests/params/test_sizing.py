"""Defaults yield to the budgets the user set, and a budget a refusal recommends runs."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import offload
from offload.io import BudgetError

transformers = pytest.importorskip("transformers")
T = transformers


def cfg(tmp_path, budget, **kw):
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="host", nvme_path=str(tmp_path / "nvme"),
                device_budget=budget, host_budget="64MiB", file_size="8MiB")
    args.update(kw)
    return offload.OffloadConfig(**args)


def three_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))


def train_two_steps(model, loss_of):
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss_of(model).backward()
        opt.step()
        opt.zero_grad()
    opt.close()


def test_default_resident_bytes_yields_to_a_small_budget(tmp_path, no_leaks):
    # each Linear(64, 64) is 16.25 KiB, under the 64 KiB default: all three would stay on the
    # device (48.75 KiB), which a 36 KiB budget cannot hold; streaming them fits
    model = three_linears()
    offload.wrap(model, cfg(tmp_path, "36KiB"))
    try:
        train_two_steps(model, lambda m: m(torch.randn(4, 64)).sum())
        assert offload.stats(model)["device_peak_bytes"] <= 36 << 10
    finally:
        offload.close(model)


def test_an_explicit_resident_bytes_is_refused_by_name(tmp_path, no_leaks):
    with pytest.raises(BudgetError, match=r"resident_bytes=64.00 KiB.*lower resident_bytes"):
        offload.wrap(three_linears(), cfg(tmp_path, "36KiB", resident_bytes="64KiB"))


def test_an_explicit_cache_bytes_that_cannot_fit_is_refused_by_name(tmp_path, no_leaks):
    with pytest.raises(BudgetError, match=r"cache_bytes=32.00 KiB does not fit.*leave it 'auto'"):
        offload.wrap(three_linears(), cfg(tmp_path, "36KiB", cache_bytes="32KiB"))


ARCHS = {
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128)), lambda m, x: m(input_ids=x, labels=x).loss),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)),
        lambda m, x: m(input_ids=x, labels=x).loss),
    "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(
        vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=8)), lambda m, x: m(input_ids=x, labels=x).loss),
    "mlp": (three_linears, lambda m, x: m(torch.randn(4, 64)).sum()),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_budget_a_refusal_recommends_runs(arch, tmp_path, no_leaks):
    make, loss_of = ARCHS[arch]
    torch.manual_seed(0)
    with pytest.raises(BudgetError) as refused:
        offload.wrap(make(), cfg(tmp_path, "1KiB"))
    found = re.search(r"set device_budget >= ([\d.]+) (KiB|MiB)", str(refused.value))
    assert found, refused.value
    budget = int(float(found.group(1)) * (1 << 10 if found.group(2) == "KiB" else 1 << 20))
    torch.manual_seed(0)
    model = make()
    offload.wrap(model, cfg(tmp_path, budget))
    try:
        x = torch.randint(0, 128, (2, 16))
        train_two_steps(model, lambda m: loss_of(m, x))
        assert offload.stats(model)["device_peak_bytes"] <= budget
    finally:
        offload.close(model)


@pytest.mark.parametrize("arch,reentrant", [("gpt2", False), ("gpt2", True), ("llama", False)])
def test_the_budget_a_run_time_refusal_recommends_runs(tmp_path, arch, reentrant, no_leaks):
    """Activation checkpointing turned on after wrap (as Trainer does): the first forward
    measures the layout again and refuses a budget that cannot hold a checkpointed block,
    and the budget it recommends runs at once, though resident_bytes="auto" spends part of
    a larger budget on keeping small groups. (The refusal used to come from the backward
    with the room that point lacked: a Llama took four tries, 68, 84, 76, 88 KiB...)"""
    def make():
        torch.manual_seed(0)
        if arch == "llama":
            return T.LlamaForCausalLM(T.LlamaConfig(
                num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128))
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64))

    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def run(budget, swap):
        model = offload.wrap(make(), cfg(tmp_path / swap, budget, optimizer_tier="nvme",
                                         nvme_path=str(tmp_path / swap)))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        try:
            train_two_steps(model.train(), lambda m: m(input_ids=x, labels=x).loss)
            return offload.stats(model)["device_peak_bytes"]
        finally:
            offload.close(model)

    refusal = "turned on after offload.wrap.*checkpointing on before offload.wrap"
    with pytest.raises(BudgetError, match=refusal) as refused:
        run("64KiB" if arch == "llama" else "256KiB", "a")
    if arch == "llama":  # (no backward, no recomputation: an evaluation runs; a retry is refused again)
        model = offload.wrap(make(), cfg(tmp_path / "c", "64KiB", nvme_path=str(tmp_path / "c")))
        try:
            model.gradient_checkpointing_enable()
            with torch.no_grad():
                model(input_ids=x)
            for _ in range(2):
                with pytest.raises(BudgetError, match=refusal):
                    model(input_ids=x, labels=x)
            model.gradient_checkpointing_disable()
            model(input_ids=x, labels=x).loss.backward()
        finally:
            offload.close(model)
    found = re.search(r"Set device_budget >= ([\d.]+) KiB", str(refused.value))
    assert found, refused.value
    budget = int(float(found.group(1)) * 1024)
    assert run(budget, "b") <= budget
