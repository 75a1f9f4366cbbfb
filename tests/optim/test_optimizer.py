"""offload.AdamW / Adam / SGD against torch's optimizers on the same model without offload."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import offload
from offload.io import BudgetError

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_trajectory_matches_torch(tmp_path, tier, kind, arch, tiny_gpt2, tiny_llama, lm_batches, make_opt, decay_groups,
                                  train, offload_config, assert_losses, assert_same_weights, no_leaks):
    """5 steps of 2 accumulated micro-batches, clipping, LambdaLR, no decay on norms and
    biases: losses and final weights equal torch's optimizer on the plain model."""
    build = tiny_gpt2 if arch == "gpt2" else tiny_llama
    ref, model = build(), build()
    batches = lm_batches(model.config.vocab_size)
    ref_opt = make_opt(kind, decay_groups(ref), False)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    ref_losses = train(ref, ref_opt, batches, clip=0.5, sched=ref_sched)

    offload.wrap(model, offload_config(tmp_path, param_tier="nvme", optimizer_tier=tier))
    try:
        opt = make_opt(kind, decay_groups(model), True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        losses = train(model, opt, batches, clip=0.5, sched=sched)
        assert_losses(losses, ref_losses)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        opt.close()
    finally:
        offload.unwrap(model)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("param_tier", ["device", "host"])
def test_other_param_tiers_and_tied_weights(tmp_path, param_tier, tiny_gpt2, lm_batches, train, make_opt,
                                            offload_config, assert_losses, assert_same_weights, no_leaks):
    ref, model = tiny_gpt2(), tiny_gpt2()
    batches = lm_batches(model.config.vocab_size, steps=3)
    ref_losses = train(ref, make_opt("adamw", ref.parameters(), False), batches)
    offload.wrap(model, offload_config(tmp_path, param_tier=param_tier, optimizer_tier="host"))
    try:
        assert model.lm_head.weight is model.transformer.wte.weight
        opt = make_opt("adamw", model.parameters(), True)
        # fp32 weights in host memory (or resident on this CPU device) are their own master
        # weights: updated where they rest, with no fp32 copy in the optimizer
        opt.step()
        assert opt._book.shards and not any(s.master for s in opt._book.shards)
        assert_losses(train(model, opt, batches), ref_losses)
        opt.close()
    finally:
        offload.unwrap(model)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_parameter_without_gradient_in_a_step(tmp_path, tier, branchy, offload_config, assert_losses,
                                              assert_same_weights, no_leaks):
    """The side layer gets no gradient on odd steps: no update at all (not even decay),
    and its step count (bias correction) lags, as in torch."""
    ref, model = branchy(), branchy()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 32, generator=g) for _ in range(5)]

    def run(m, opt):
        out = []
        for step, x in enumerate(xs):
            m.use_side = step % 2 == 0
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(float(loss.detach()))
        return out

    ref_losses = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))
    offload.wrap(model, offload_config(tmp_path, optimizer_tier=tier, resident_bytes=0))
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        assert_losses(run(model, opt), ref_losses)
        sd = opt.state_dict()
        ref_sd = torch.optim.AdamW(ref.parameters()).state_dict()  # layout only
        side = [i for i, (n, _) in enumerate(model.named_parameters()) if n.startswith("side")]
        assert all(float(sd["state"][i]["step"]) == 3 for i in side)
        assert len(sd["param_groups"][0]["params"]) == len(ref_sd["param_groups"][0]["params"])
        opt.close()
    finally:
        offload.unwrap(model)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_plain_parameters(tmp_path, tier, kind, tiny_gpt2, lm_batches, train, make_opt, decay_groups, offload_config,
                          assert_losses, assert_same_weights, no_leaks):
    """The optimizer alone offloaded: the model is not wrapped, p.grad as usual."""
    ref, model = tiny_gpt2(), tiny_gpt2()
    batches = lm_batches(model.config.vocab_size, steps=3)
    ref_losses = train(ref, make_opt(kind, decay_groups(ref), False), batches, clip=1.0)
    cfg = offload_config(tmp_path, param_tier="host", optimizer_tier=tier) if tier == "nvme" else None
    opt = make_opt(kind, decay_groups(model), True, config=cfg, shard_size=5000)
    assert_losses(train(model, opt, batches, clip=1.0), ref_losses)
    assert len(opt._book.shards) > 3  # several shards, parameters split across them
    opt.close()
    assert_same_weights(model, ref)


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("wrapped", [True, False], ids=["wrapped", "plain"])
def test_padded_rows_match_torch(tmp_path, tier, wrapped, wide_llama, lm_batches, make_opt, decay_groups, train,
                                 offload_config, assert_losses, assert_rows_padded, assert_same_weights, no_leaks):
    """Rows padded apart (for the cache) change nothing: the trajectory equals torch's, and
    the state dict holds each parameter's moments and nothing of the padding."""
    ref, model = wide_llama(), wide_llama()
    batches = lm_batches(model.config.vocab_size, steps=3)
    ref_opt = make_opt("adamw", decay_groups(ref), False)
    ref_losses = train(ref, ref_opt, batches, clip=1.0)
    cfg = offload_config(tmp_path, param_tier="nvme" if wrapped else "host", optimizer_tier=tier,
                         host_budget="256MiB", file_size="64MiB", device_budget="8MiB")
    if wrapped:
        offload.wrap(model, cfg)
    opt = make_opt("adamw", decay_groups(model), True, config=None if wrapped or tier == "host" else cfg,
                   shard_size=300_000)
    try:
        assert_losses(train(model, opt, batches, clip=1.0), ref_losses)
        assert_rows_padded(opt)
        got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        assert got.keys() == want.keys()
        for i in want:
            for key in ("exp_avg", "exp_avg_sq"):
                # (the clip norm is summed in another order than torch's: last-bit differences)
                torch.testing.assert_close(got[i][key], want[i][key], rtol=1e-5, atol=5e-7)
        opt.close()
    finally:
        if wrapped:
            offload.unwrap(model)
    assert_same_weights(model, ref)


def test_fp16_loss_scaling_skips_overflow(tmp_path, branchy, offload_config, no_leaks):
    model = branchy()
    offload.wrap(model, offload_config(tmp_path, compute_dtype="fp16", resident_bytes=0))
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        assert opt.loss_scale == 2.0 ** 16  # dynamic by default for fp16 parameters
        x = torch.randn(4, 32).half()
        with torch.no_grad():
            before = model(x)  # wrapped weights are only readable inside forward
        opt.loss_scale = 1e30  # overflows fp16 gradients
        opt.scale_loss(model(x).float().pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
        assert opt.stats["skipped_steps"] == 1 and opt.loss_scale == 5e29
        with torch.no_grad():
            torch.testing.assert_close(model(x), before, rtol=0, atol=0)  # nothing changed
        opt.loss_scale = 1024.0
        loss = model(x).float().pow(2).mean()
        opt.scale_loss(loss).backward()
        norm = opt.clip_grad_norm_(1e9)  # unscaled norm
        opt.step()
        assert opt.stats["steps"] == 1 and 0 < float(norm) < 1e3
        with torch.no_grad():
            assert not torch.equal(model(x), before)
        opt.close()
    finally:
        offload.unwrap(model)


def test_state_dict_round_trip_continues_trajectory(tmp_path, tiny_gpt2, lm_batches, offload_config, decay_groups,
                                                    train, assert_losses, assert_same_weights, no_leaks):
    full, first = tiny_gpt2(), tiny_gpt2()
    batches = lm_batches(full.config.vocab_size)
    offload.wrap(full, offload_config(tmp_path / "a"))
    opt = offload.AdamW(decay_groups(full), lr=1e-2)
    losses = train(full, opt, batches)
    opt.close()
    offload.unwrap(full)

    offload.wrap(first, offload_config(tmp_path / "b"))
    opt = offload.AdamW(decay_groups(first), lr=1e-2)
    head = train(first, opt, batches[:3])
    sd = opt.state_dict()
    opt.close()
    offload.unwrap(first)
    weights = {k: v.clone() for k, v in first.state_dict().items()}

    second = tiny_gpt2()
    second.load_state_dict(weights)
    offload.wrap(second, offload_config(tmp_path / "c"))
    opt = offload.AdamW(decay_groups(second), lr=1e-2)
    opt.load_state_dict(sd)
    tail = train(second, opt, batches[3:])
    opt.close()
    offload.unwrap(second)
    assert_losses(head + tail, losses, rtol=0, atol=0)
    assert_same_weights(second, full)
    # torch's AdamW loads it too: the format is torch's, and its fused kernel (offload's) stays on
    plain = tiny_gpt2()
    t = torch.optim.AdamW(decay_groups(plain), lr=1e-2, fused=True)
    t.load_state_dict(sd)
    assert float(t.state_dict()["state"][0]["step"]) == 3
    assert all(g["fused"] is True for g in t.param_groups)


def test_state_dict_keeps_the_loss_scale(tmp_path, branchy, offload_config, caplog, no_leaks):
    """offload's own dynamic loss scale travels in the state dict (as in a checkpoint), so a
    run resumed the torch way (Accelerate's save_state) skips the steps the saved run would."""
    model = branchy()
    offload.wrap(model, offload_config(tmp_path, compute_dtype="fp16", resident_bytes=0))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    opt.loss_scale = 512.0
    sd = opt.state_dict()
    opt.close()
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    assert opt.loss_scale == 2.0 ** 16
    opt.load_state_dict(sd)
    assert opt.loss_scale == 512.0
    del sd["loss_scaler"]  # (a torch optimizer's dict: the scale stays, said)
    opt.loss_scale = 1024.0
    with caplog.at_level(logging.WARNING, logger="offload"):
        opt.load_state_dict(sd)
    assert "holds no loss scale" in caplog.text and opt.loss_scale == 1024.0
    opt.close()
    offload.unwrap(model)


def test_pipeline_event_log(tmp_path, tiny_gpt2, offload_config, train, lm_batches, no_leaks):
    """With states on NVMe: shard i+1 is read before shard i's update ends (unless the writes
    in flight were backlogged then: the disk decides, and the pipeline says so), and shard
    i-1's write is issued (not waited for) before shard i's update starts."""
    model = tiny_gpt2()
    offload.wrap(model, offload_config(tmp_path))
    try:
        events = []
        # (the pipeline inside step(); its order during the next forward: test_next_forward.py)
        opt = offload.AdamW(model.parameters(), lr=1e-3, shard_size=8192, update_in_next_forward=False)
        opt.events = events
        train(model, opt, lm_batches(model.config.vocab_size, steps=2))
        step = events[len(events) // 2:]  # the second step
        pos = {e: i for i, e in enumerate(step)}
        shards = sorted({s for _, s in step})
        assert len(shards) > 4
        ahead = 0
        for a, b in zip(shards, shards[1:]):
            if ("read_later", b) not in pos:
                assert pos[("read", b)] < pos[("update_end", a)]
                ahead += 1
            assert pos[("write", a)] < pos[("update_start", b)]
        assert ahead > 0
        assert opt.stats["read_bytes"] > 0 and opt.stats["write_bytes"] > 0
        opt.close()
    finally:
        offload.unwrap(model)


def test_errors(tmp_path, tiny_gpt2, offload_config, no_leaks):
    a, b = tiny_gpt2(), tiny_gpt2()
    offload.wrap(a, offload_config(tmp_path / "a"))
    offload.wrap(b, offload_config(tmp_path / "b", optimizer_tier="host", host_budget="128KiB"))
    try:
        with pytest.raises(ValueError, match="different configs"):
            offload.AdamW(list(a.parameters()) + list(b.parameters()))
        with pytest.raises(BudgetError, match="host_budget is 128.00 KiB"):
            offload.AdamW(b.parameters())  # ~1 MiB of states resting in host memory
    finally:
        offload.unwrap(a)
        offload.unwrap(b)
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device"):
        offload.AdamW(m.parameters())
    with pytest.raises(ValueError, match="betas"):
        offload.AdamW(nn.Linear(2, 2).parameters(), betas=(1.0, 0.9))
    closed = offload.AdamW(nn.Linear(2, 2).parameters())
    closed.close()
    for call in (closed.step, closed.state_dict, closed.synchronize):
        with pytest.raises(RuntimeError, match="is closed: close.. released its states"):
            call()


def test_plain_bf16_parameters_keep_an_fp32_master(branchy, no_leaks):
    """Plain (unwrapped) bf16 parameters: fp32 master rows in the shard, gradients converted
    through a pooled buffer, the bf16 parameters rewritten from the master after each step."""
    model = branchy().to(torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1, fused=True)
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, shard_size=3000)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 32, generator=g).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        ref_opt.step()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    for i, (m, p) in enumerate(zip(master, model.parameters())):
        torch.testing.assert_close(sd["state"][i]["master_param"], m.detach(), rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), m.detach().to(torch.bfloat16), rtol=0, atol=0)
    opt.close()


def test_model_zero_grad_is_enough(tmp_path, lm_batches, tiny_gpt2, make_opt, offload_config):
    """Loops that reset gradients with model.zero_grad() (transformers' Trainer) never call
    the optimizer's zero_grad(); a step consumes the offloaded gradients, so they do not
    leak into the next step."""
    batches = lm_batches(211, steps=3, micro=1)
    ref = tiny_gpt2()
    ref_opt = make_opt("adamw", ref.parameters(), offloaded=False)
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    opt = make_opt("adamw", model.parameters(), offloaded=True)
    for m, o in ((ref, ref_opt), (model, opt)):
        for (ids,) in batches:
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            m.zero_grad()
    got, want = offload.state_dict(model), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    offload.unwrap(model)
    opt.close()

