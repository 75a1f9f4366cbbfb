"""offload.plan's optimizer rows are the layout the optimizer builds: one sizing policy."""

from __future__ import annotations

import random

import pytest
import torch

import offload
from offload.io import PAGE_SIZE, BudgetError, round_up
from offload.optim._sizing import in_flight_bytes


def _built(opt) -> dict[str, int]:
    """The optimizer rows as the optimizer's own shards count them."""
    shards = opt._book.shards
    out = {"moments": sum(4 * s.numel * (s.rows - s.master) for s in shards),
           "masters": sum(4 * s.numel for s in shards if s.master)}
    for tier in ("host", "nvme"):
        out[f"grads {tier}"] = sum(s.grad_bytes for s in shards if s.grad_home is not None
                                   and s.grad_home.value == tier)
    placement = opt._book.placements[id(shards[0].store)]
    held = [in_flight_bytes(s, placement.param_home) - round_up(s.scratch_bytes, PAGE_SIZE) for s in shards]
    if {s.home.value for s in shards} == {"nvme"} or any(s.group_copy_bytes(placement.param_home) for s in shards):
        out["in flight"] = min(placement.host_budget, sum(sorted(held, reverse=True)[:4]))
    return out


def _planned(plan) -> dict[str, int]:
    out = {"moments": 0, "masters": 0, "grads host": 0, "grads nvme": 0}
    for r in plan.rows:
        if r.item.startswith("optimizer: exp_avg"):
            out["moments"] = r.nbytes
        elif r.item == "optimizer: master weights":
            out["masters"] = r.nbytes
        elif r.item == "optimizer: gradient accumulators":
            out[f"grads {r.tier}"] += r.nbytes
        elif r.item == "optimizer: shards in flight":
            out["in flight"] = r.nbytes
    return out


def test_the_plan_is_the_layout_the_optimizer_builds_under_tight_budgets(tmp_path, tiny_gpt2, offload_config,
                                                                          no_leaks):
    """Random tiers, dtypes, model shapes and host budgets from roomy down to too small: the
    optimizer builds exactly what the plan counted (moments, masters, gradients by tier,
    shards in flight), and refuses exactly where the plan says it would."""
    rng = random.Random(23)
    refused = built = 0
    for trial in range(10):
        n_embd, n_layer = rng.choice([(64, 2), (128, 2), (96, 3)])
        optimizer_tier = rng.choice(["nvme", "nvme", "host"])
        param_tier = rng.choice(["nvme", "host"])
        dtype = rng.choice([None, "bf16"])
        host_budget = rng.choice([1 << 20, 3 << 20, 6 << 20, 12 << 20, 64 << 20])
        cfg = offload_config(tmp_path / f"t{trial}", param_tier=param_tier, optimizer_tier=optimizer_tier,
                             device_budget="8MiB", host_budget=host_budget, compute_dtype=dtype, resident_bytes=0,
                             file_size="1GiB")
        what = f"trial {trial}: {n_embd}x{n_layer}, {param_tier}/{optimizer_tier}, {dtype}, host {host_budget}"
        model = tiny_gpt2(n_embd=n_embd, n_layer=n_layer, vocab_size=503, n_positions=32)
        plan = offload.plan(model, cfg, optimizer="adamw")
        if plan.problems and not any(p.startswith("optimizer:") for p in plan.problems):
            continue  # (the parameters alone do not fit: wrap refuses before any optimizer)
        try:
            offload.wrap(model, cfg)
        except BudgetError:
            continue
        try:
            try:
                opt = offload.AdamW(model.parameters(), lr=1e-3)
            except BudgetError as err:
                refused += 1
                assert any(p.startswith("optimizer:") for p in plan.problems), f"{what}: plan fits, optimizer: {err}"
                continue
            built += 1
            assert not any(p.startswith("optimizer:") for p in plan.problems), f"{what}: {plan.problems}"
            assert _built(opt) == _planned(plan), what
            opt.close()
        finally:
            offload.close(model)
    assert built >= 3 and refused >= 1, (built, refused)


def test_where_the_plan_fits_the_steps_run_within_the_host_budget(tmp_path, tiny_llama, offload_config, make_opt,
                                                                   lm_batches, train):
    """fp32 groups resting on NVMe are updated in host copies of the whole group: the plan
    counts them beside the shard in flight, so a budget the plan accepts never stops a step
    for want of host room, the host peak stays inside it, and the losses are torch's."""
    ref = tiny_llama()
    batches = lm_batches(197, steps=2, micro=1)
    expected = train(ref, make_opt("adamw", ref.parameters(), offloaded=False), batches)
    ran = 0
    for budget in (1200 << 10, 1 << 20, 800 << 10, 400 << 10, 200 << 10):
        cfg = offload_config(tmp_path / str(budget), host_budget=budget)
        model = tiny_llama()
        if not offload.plan(model, cfg, optimizer="adamw").fits:
            continue
        offload.wrap(model, cfg)
        try:
            opt = make_opt("adamw", model.parameters(), offloaded=True)
            losses = train(model, opt, batches)
            assert offload.stats(model)["host_peak_bytes"] <= budget
            opt.close()
        finally:
            offload.close(model)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        ran += 1
    assert ran >= 3, ran


@pytest.mark.parametrize("param_tier", ["nvme", "host"])
def test_at_the_least_host_budget_the_plan_accepts_clipped_steps_run(tmp_path, param_tier, tiny_llama, offload_config,
                                                                    make_opt, lm_batches, train):
    """The tight end, found to a page: at the least host budget the plan accepts, clipped
    steps with the update in the next forward run and equal torch's; a page less, the plan and
    the optimizer both refuse. (Each pool buffer is whole pages, a norm's 256 bytes taking 4
    KiB, none is reused larger than the budget leaves room for, and parameters at home in
    host memory and the backward's gradient accumulators are counted: before, a budget the
    plan accepted stopped mid-step waiting for host room.)"""
    settings = dict(device_budget="256KiB", resident_bytes=0, param_tier=param_tier)
    ref = tiny_llama(vocab_size=1000, num_hidden_layers=3)  # (a 256 KB head beside 256-byte norms)
    batches = lm_batches(1000, steps=3, micro=1)
    expected = train(ref, make_opt("adamw", ref.parameters(), offloaded=False), batches, clip=0.5)

    def fits(budget: int) -> bool:
        cfg = offload_config(tmp_path / "plan", host_budget=budget, **settings)
        return offload.plan(tiny_llama(vocab_size=1000, num_hidden_layers=3), cfg, optimizer="adamw").fits

    lo, hi = 64 << 10, 4 << 20  # (refused, accepted)
    assert not fits(lo) and fits(hi)
    while hi - lo > PAGE_SIZE:
        mid = round_up((lo + hi) // 2, PAGE_SIZE)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    for budget, runs in ((lo, False), (hi, True)):
        model = tiny_llama(vocab_size=1000, num_hidden_layers=3)
        offload.wrap(model, offload_config(tmp_path / str(budget), host_budget=budget, **settings))
        try:
            if not runs:
                with pytest.raises(BudgetError, match="host_budget"):
                    make_opt("adamw", model.parameters(), offloaded=True)
                continue
            opt = make_opt("adamw", model.parameters(), offloaded=True)
            losses = train(model, opt, batches, clip=0.5)
            assert offload.stats(model)["host_peak_bytes"] <= budget
            opt.close()
        finally:
            offload.close(model)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("param_tier", ["nvme", "host"])
def test_bf16_groups_train_at_the_least_host_budget_the_plan_accepts(tmp_path, param_tier, tiny_llama, offload_config,
                                                                    lm_batches):
    """bf16 parameters are updated from fp32 master rows and each group is written home
    through a staging buffer: shards read ahead leave room for it. At the plan's least host
    budget and above, steps (update in the next forward, and in step()) run and give the
    roomy budget's weights bit for bit (before, the write-back found the pool full of shards
    read ahead and stopped the step at twice the plan's least budget; at home in host memory,
    a group is written where it rests, where a put freed its slot for a queued read to take).
    Unclipped: a bf16
    gradient split across shards has its norm summed from the pieces (README)."""
    batches = lm_batches(300, steps=3, micro=1)

    def run(budget, in_next_forward=True):
        model = tiny_llama(vocab_size=300).to(torch.bfloat16)
        offload.wrap(model, offload_config(tmp_path / f"{budget}-{in_next_forward}", host_budget=budget,
                                           device_budget="256KiB", resident_bytes=0, param_tier=param_tier))
        try:
            opt = offload.AdamW(model.parameters(), lr=1e-2, update_in_next_forward=in_next_forward)
            for (ids,) in batches:
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            assert offload.stats(model)["host_peak_bytes"] <= budget
            opt.close()
            return {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            offload.close(model)

    def fits(budget: int) -> bool:
        cfg = offload_config(tmp_path / "plan", host_budget=budget, device_budget="256KiB", resident_bytes=0,
                             param_tier=param_tier)
        return offload.plan(tiny_llama(vocab_size=300).to(torch.bfloat16), cfg, optimizer="adamw").fits

    lo, hi = 16 << 10, 4 << 20
    while hi - lo > PAGE_SIZE:
        mid = round_up((lo + hi) // 2, PAGE_SIZE)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    want = run(64 << 20)
    for budget, in_next_forward in ((hi, True), (2 * hi, True), (2 * hi, False)):
        got = run(budget, in_next_forward)
        for key in want:
            assert torch.equal(got[key], want[key]), (budget, in_next_forward, key)


def test_a_larger_host_budget_never_turns_a_fit_into_a_refusal(tmp_path, offload_config):
    """Shards are sized from the budget, and one that straddles more expert weights needs
    more group copies in flight: where a layout's shard does not fit, smaller shards are
    tried before the plan refuses, so fits only grows with the budget (a Mixtral fitted at
    512 KiB and was refused at 516-528 KiB)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    verdicts = []
    for kib in range(280, 560, 4):
        cfg = offload_config(tmp_path, host_budget=kib << 10, device_budget="1MiB", resident_bytes=0)
        verdicts.append(offload.plan(model, cfg, optimizer="adamw").fits)
    assert any(verdicts) and not all(verdicts)
    first = verdicts.index(True)
    assert all(verdicts[first:]), [280 + 4 * i for i, v in enumerate(verdicts) if not v and i > first]


def test_a_shard_spanning_two_copied_groups_does_not_turn_a_larger_budget_into_a_refusal(tmp_path, offload_config):
    """fp32 groups on NVMe are updated in host copies: a shard spanning the embedding's group
    and the next holds both in flight, and where the cut falls moved with the budget-sized
    cap, so this Llama fitted at 2144 KiB and was refused at 2208-2228 KiB (a 95M one the
    same way at 80-82 MiB). Shards are cut at those groups' edges before smaller ones are
    tried: fits only grows with the budget, and a step at a budget once refused trains as
    torch's AdamW, bit for bit."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=4000,
                                      max_position_embeddings=64, tie_word_embeddings=False)

    def settings(kib):
        return offload_config(tmp_path / f"{kib}", host_budget=kib << 10, device_budget="4MiB", resident_bytes=0)

    with offload.init_empty_weights():
        shape = transformers.LlamaForCausalLM(config)
    verdicts = [offload.plan(shape, settings(kib), optimizer="adamw").fits for kib in range(2040, 2240, 8)]
    assert any(verdicts) and not all(verdicts)
    first = verdicts.index(True)
    assert all(verdicts[first:]), [2040 + 8 * i for i, v in enumerate(verdicts) if not v and i > first]
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(ref.state_dict())
    offload.wrap(model, settings(2216))
    try:
        opts = offload.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        ids = torch.randint(0, 4000, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            for m, opt in zip((model, ref), opts):
                m(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
        opts[0].close()
    finally:
        offload.close(model)
