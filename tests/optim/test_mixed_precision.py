"""compute_dtype lower than an fp32 model's: the master weights start from the model's own
fp32 values (as torch.amp, DeepSpeed's bf16 and Accelerate keep them), against a reference
that keeps fp32 masters and runs a copy of the model in the compute dtype."""

from __future__ import annotations

import copy

import pytest
import torch

import offload

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("source", ["memory", "checkpoint"])
def test_masters_start_from_the_models_values(tmp_path, tier, source, tiny_gpt2, offload_config, lm_batches, no_leaks):
    """(kept in the NVMe tier: the optimizer's states are there)"""
    model = tiny_gpt2()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    if source == "checkpoint":
        model.save_pretrained(tmp_path / "weights")
        with offload.init_empty_weights():
            model = type(model)(model.config)
    offload.wrap(model, offload_config(tmp_path, param_tier=tier, optimizer_tier="nvme", compute_dtype="bf16"),
                 checkpoint=tmp_path / "weights" if source == "checkpoint" else None)
    assert offload.params.manager_of(model).originals.kept  # until the optimizer takes them
    opt = offload.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    assert not offload.params.manager_of(model).originals.kept  # taken, and dropped
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # lr 0: the masters stay what they started from
    names = [n for n, _ in model.named_parameters()]
    state = opt.state_dict()["state"]
    for i, name in enumerate(names):
        torch.testing.assert_close(state[i]["master_param"], original[name], rtol=0, atol=0, msg=name)
    opt.close()
    offload.unwrap(model)


def test_without_nvme_nothing_is_kept_and_a_warning_says_so(tmp_path, caplog, tiny_gpt2, offload_config, no_leaks):
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, param_tier="host", optimizer_tier="host",
                                                     compute_dtype="bf16"))
    assert not offload.params.manager_of(model).originals.kept
    assert "rounded values" in caplog.text
    offload.unwrap(model)
    frozen = tiny_gpt2().requires_grad_(False)  # inference: nothing to keep, nothing said
    caplog.clear()
    offload.wrap(frozen, offload_config(tmp_path / "b", compute_dtype="bf16"))
    assert not offload.params.manager_of(frozen).originals.kept and "rounded" not in caplog.text
    offload.unwrap(frozen)


def test_writes_after_wrap(tmp_path, tiny_gpt2, offload_config, lm_batches, no_leaks):
    """load_state_dict of fp32 values after wrap: the masters start from them (kept like
    wrap's); an in-place change of one parameter: its master starts from the result,
    rounded to the compute dtype as the group holds it, the others keep theirs."""
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, compute_dtype="bf16"))
    other = tiny_gpt2()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model.load_state_dict(other.state_dict())
    changed = "transformer.h.0.mlp.c_fc.weight"
    with torch.no_grad():
        dict(model.named_parameters())[changed].mul_(2)
    opt = offload.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    (ids,) = lm_batches(211, steps=1, micro=1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    state = opt.state_dict()["state"]
    for i, (name, p) in enumerate(other.named_parameters()):
        want = (p.detach().to(torch.bfloat16) * 2).float() if name == changed else p.detach()
        torch.testing.assert_close(state[i]["master_param"], want, rtol=0, atol=0, msg=name)
    opt.close()
    offload.unwrap(model)


def test_optimizer_loaded_before_the_model_keeps_its_masters(tmp_path, tiny_llama, offload_config, lm_batches,
                                                              no_leaks):
    """Resumed the torch way in either order: the model's state dict (the masters rounded to
    bf16) loaded after the optimizer's does not replace the fp32 masters it loaded."""
    def run(model, opt, steps):
        for (ids,) in steps:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    full = offload.wrap(tiny_llama(), offload_config(tmp_path / "a", compute_dtype="bf16"))
    batches = lm_batches(full.config.vocab_size, steps=4, micro=1)
    opt = offload.AdamW(full.parameters(), lr=3e-3)
    run(full, opt, batches[:2])
    saved = {k: v.clone() for k, v in full.state_dict().items()}, opt.state_dict()
    run(full, opt, batches[2:])
    want = offload.state_dict(full)
    opt.close()
    offload.unwrap(full)
    resumed = offload.wrap(tiny_llama(), offload_config(tmp_path / "b", compute_dtype="bf16"))
    opt = offload.AdamW(resumed.parameters(), lr=3e-3)
    opt.load_state_dict(saved[1])
    resumed.load_state_dict(saved[0])
    run(resumed, opt, batches[2:])
    torch.testing.assert_close(offload.state_dict(resumed), want, rtol=0, atol=0)
    opt.close()
    offload.unwrap(resumed)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_low_precision_compute_trains_like_fp32_masters(tmp_path, dtype, tiny_llama, lm_batches, offload_config, train,
                                                        assert_bf16_master_close, no_leaks):
    """The trajectory of a model run in bf16 / fp16 (a fixed loss scale of 1024 for fp16)
    whose fp32 masters start from the fp32 model."""
    model = tiny_llama()
    batches = lm_batches(model.config.vocab_size)
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]  # the model's fp32 values
    work = copy.deepcopy(model)
    for p in work.parameters():  # as wrap() does: parameters in the compute dtype, buffers as they were
        p.data = p.data.to(DTYPES[dtype])
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.05, fused=True)
    scale = 1024.0 if dtype == "fp16" else 1.0
    ref_losses = []
    for micro in batches:
        total = 0.0
        for ids in micro:
            loss = work(input_ids=ids, labels=ids).loss.float() / len(micro)
            (loss * scale).backward()
            total += float(loss.detach())
            for m, p in zip(masters, work.parameters()):  # accumulated in fp32, unscaled at the step
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None
        for m in masters:
            m.grad /= scale
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, work.parameters()):
                p.copy_(m)
        ref_losses.append(total)

    # (bf16 given as torch.bfloat16, as from_pretrained(dtype=) takes it; fp16 by name)
    offload.wrap(model, offload_config(tmp_path, compute_dtype=DTYPES[dtype] if dtype == "bf16" else dtype))
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05,
                        loss_scale=scale if dtype == "fp16" else None)
    losses = train(model, opt, batches, scale=opt.scale_loss)
    torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=2e-2)
    state = opt.state_dict()["state"]
    for i, m in enumerate(masters):
        assert_bf16_master_close(state[i]["master_param"], m.detach())
    opt.close()
    offload.unwrap(model)


def test_fp32_checkpoint_into_a_bf16_run_keeps_fp32_masters(tmp_path, tiny_gpt2, offload_config, train, lm_batches,
                                                            no_leaks):
    """An fp32 run's checkpoint (its parameters are their own masters: no master rows)
    loaded into a bf16-compute run: the masters start from the saved fp32 values."""
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "a"))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, lm_batches(211, steps=1))
    offload.save_checkpoint(tmp_path / "ckpt", model, opt)
    saved = offload.state_dict(model)
    opt.close()
    offload.unwrap(model)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "b", compute_dtype="bf16"))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    offload.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert not offload.params.manager_of(model).originals.kept  # taken by the optimizer, dropped
    state = opt.state_dict()["state"]
    for i, (name, _) in enumerate(model.named_parameters()):
        torch.testing.assert_close(state[i]["master_param"], saved[name], rtol=0, atol=0, msg=name)
    opt.close()
    offload.unwrap(model)


@pytest.mark.parametrize("how,shard_size", [("load_checkpoint", None), ("load_checkpoint", 3000),
                                            ("state_dicts", None)])
def test_bf16_run_into_an_fp32_run_takes_the_fp32_masters(tmp_path, how, shard_size, tiny_llama, offload_config,
                                                          train, lm_batches, no_leaks):
    """A bf16-compute run's checkpoint (bf16 weights, fp32 masters in the optimizer's state)
    loaded into an fp32 run, whose parameters are their own masters: the parameters take the
    saved fp32 masters, not their bf16 rounding, by load_checkpoint and by the state dicts
    loaded model first (Trainer's and Accelerate's order)."""
    model = offload.wrap(tiny_llama(), offload_config(tmp_path / "a", compute_dtype="bf16"))
    opt = offload.AdamW(model.parameters(), lr=1e-2, **({"shard_size": shard_size} if shard_size else {}))
    train(model, opt, lm_batches(197, steps=2))  # (shard_size 3000: masters saved in pieces)
    offload.save_checkpoint(tmp_path / "ckpt", model, opt)
    saved_opt, saved_model = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    masters = {n: saved_opt["state"][i]["master_param"] for i, n in enumerate(names)}
    assert sum(not torch.equal(masters[n], saved_model[n].float()) for n in names) >= len(names) // 2
    opt.close()
    offload.unwrap(model)
    model = offload.wrap(tiny_llama(), offload_config(tmp_path / "b"))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    if how == "load_checkpoint":
        offload.load_checkpoint(tmp_path / "ckpt", model, opt)
    else:
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
    weights = offload.state_dict(model)
    for name in names:
        torch.testing.assert_close(weights[name], masters[name], rtol=0, atol=0, msg=name)
    state = opt.state_dict()["state"]
    for i, name in enumerate(names):  # the moments as saved
        torch.testing.assert_close(state[i]["exp_avg"], saved_opt["state"][i]["exp_avg"], rtol=0, atol=0)
    opt.close()
    offload.unwrap(model)
