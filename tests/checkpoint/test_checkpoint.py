"""save_checkpoint / load_checkpoint / state_dict / export against the same training run
without a save (crashes, corruption, wrong models and full disks: test_checkpoint_failures)."""

from __future__ import annotations

import json
import logging
import os
import pickle
from unittest import mock

import pytest
import torch

import offload
from offload.checkpoint import _format

from .processes import child, read

transformers = pytest.importorskip("transformers")


# -- exact resume -------------------------------------------------------------------------------
@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("host", "nvme"), ("nvme", "host")])
def test_resume_in_a_fresh_process_is_bit_exact(tmp_path, tiers):
    """Train 3 steps, save, train 3 more; a new process loads and trains the same 3: the
    losses, weights and moments are equal bit for bit (dropout on: the RNG state travels in
    ``extra``)."""
    ckpt = tmp_path / "ckpt"
    r = child("train", tmp_path / "a.json", ckpt, *tiers, tmp_path / "w1")
    assert r.returncode == 0, r.stderr
    r = child("resume", tmp_path / "b.json", ckpt, *tiers, tmp_path / "w2")
    assert r.returncode == 0, r.stderr
    a, b = read(tmp_path / "a.json"), read(tmp_path / "b.json")
    assert a["losses"] == b["losses"]
    assert a["weights"] == b["weights"]
    assert a["moments"] == b["moments"]


def test_load_into_another_tier_layout(tmp_path, offload_config, train_pair, tiny_gpt2):
    """Saved with parameters on NVMe and states in host memory; loaded with parameters in
    host memory, states on NVMe, merged groups, small shards and another budget."""
    save_cfg = offload_config(tmp_path / "s", param_tier="nvme", optimizer_tier="host")
    load_cfg = offload_config(tmp_path / "l", param_tier="host", optimizer_tier="nvme", host_budget="48MiB",
                              group_bytes="64KiB")
    want, got, (ref, opt), (other, opt2) = train_pair(tmp_path, save_cfg, load_cfg, tiny_gpt2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    a, b = offload.state_dict(ref), offload.state_dict(other)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    for m, o in ((ref, opt), (other, opt2)):
        offload.unwrap(m)
        o.close()


def test_load_with_other_shard_boundaries(tmp_path, offload_config, lm_batches, tiny_gpt2, train):
    """A parameter split across shards differently at save and at load (states read
    through the scratch path) still resumes exactly."""
    save_cfg = offload_config(tmp_path / "s")
    load_cfg = offload_config(tmp_path / "l")
    batches = lm_batches(211, steps=4)
    ref = offload.wrap(tiny_gpt2(), save_cfg)
    opt = offload.AdamW(ref.parameters(), lr=1e-2, shard_size=5000)
    train(ref, opt, batches[:2])
    offload.save_checkpoint(str(tmp_path / "ckpt"), ref, opt)
    want = train(ref, opt, batches[2:])
    other = offload.wrap(tiny_gpt2(), load_cfg)
    opt2 = offload.AdamW(other.parameters(), lr=1e-2, shard_size=7777)
    offload.load_checkpoint(str(tmp_path / "ckpt"), other, opt2)
    assert train(other, opt2, batches[2:]) == want
    for m, o in ((ref, opt), (other, opt2)):
        offload.unwrap(m)
        o.close()


def test_unsaved_gradients_are_warned_of_only_when_added_since_the_step(tmp_path, offload_config, lm_batches,
                                                                         tiny_gpt2, caplog):
    """Gradients held after step() were that step's: saving then (before zero_grad, as the
    loop may) loses nothing; a backward since, whose sum a checkpoint leaves out, is said,
    and so is a load that drops it."""
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "s"))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    (ids,), (more,) = lm_batches(211, steps=2, micro=1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with caplog.at_level(logging.WARNING, logger="offload"):
        offload.save_checkpoint(str(tmp_path / "a"), model, opt)
        assert "are not saved" not in caplog.text
        model(input_ids=more, labels=more).loss.backward()
        offload.save_checkpoint(str(tmp_path / "b"), model, opt)
        assert "are not saved" in caplog.text
        assert "were dropped" not in caplog.text
        offload.load_checkpoint(str(tmp_path / "a"), model, opt)  # (drops them, as said; torch's would keep p.grad)
        assert "gradients accumulated since the last step() were dropped" in caplog.text
    assert all(p.grad is None for p in model.parameters())
    offload.unwrap(model)
    opt.close()


def test_padded_rows_save_and_load_exactly(tmp_path, train_pair, offload_config, wide_gpt2, assert_rows_padded):
    """Shards whose rows are padded apart: saved from NVMe, loaded into host memory with other
    shard boundaries (and the other way), the run resumes bit for bit."""
    kw = dict(host_budget="256MiB", file_size="64MiB", device_budget="8MiB")
    for name, (a, b) in {"n2h": ("nvme", "host"), "h2n": ("host", "nvme")}.items():
        want, got, (ref, opt), (other, opt2) = train_pair(
            tmp_path / name, offload_config(tmp_path / name / "s", param_tier="nvme", optimizer_tier=a, **kw),
            offload_config(tmp_path / name / "l", param_tier="host", optimizer_tier=b, **kw), model_fn=wide_gpt2,
            shard_size=300_000)
        assert got == want
        assert_rows_padded(opt)
        assert_rows_padded(opt2)
        for m, o in ((ref, opt), (other, opt2)):
            offload.unwrap(m)
            o.close()


def test_bf16_parameters_keep_fp32_master(tmp_path, offload_config, train_pair, tiny_llama):
    """bf16 parameters with fp32 master weights: the master travels in the checkpoint, so
    the resumed run is exact (reloading from bf16 weights would not be)."""
    cfg = lambda d: offload_config(tmp_path / d, compute_dtype="bf16")  # noqa: E731
    want, got, (ref, opt), (other, opt2) = train_pair(tmp_path, cfg("s"), cfg("l"), model_fn=tiny_llama)
    assert got == want
    for m, o in ((ref, opt), (other, opt2)):
        offload.unwrap(m)
        o.close()


def test_plain_model_and_torch_optimizer(tmp_path, lm_batches, tiny_gpt2, train):
    """Without wrap and with torch's own AdamW the same files and guarantees apply."""
    batches = lm_batches(211, steps=4)
    ref = tiny_gpt2()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, opt, batches[:2])
    offload.save_checkpoint(str(tmp_path / "ckpt"), ref, opt)
    want = train(ref, opt, batches[2:])
    other = tiny_gpt2()
    torch.manual_seed(5)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    opt2 = torch.optim.AdamW(other.parameters(), lr=1.0)
    offload.load_checkpoint(str(tmp_path / "ckpt"), other, opt2)
    assert train(other, opt2, batches[2:]) == want
    for (n, p), (_, q) in zip(ref.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n


def test_state_dict_and_load_state_dict_from(tmp_path, tiny_gpt2, offload_config, train, lm_batches):
    """offload.state_dict of a wrapped model equals the plain model's state_dict (tied names
    included); load_state_dict_from gives a plain model the same outputs."""
    plain = tiny_gpt2()
    wrapped = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    sd = offload.state_dict(wrapped)
    want = plain.state_dict()
    assert sd.keys() == want.keys()
    for k in want:
        assert torch.equal(sd[k], want[k]), k
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    opt = offload.AdamW(wrapped.parameters(), lr=1e-2)
    train(wrapped, opt, lm_batches(211, steps=2))
    offload.save_checkpoint(str(tmp_path / "ckpt"), wrapped, opt)
    fresh = tiny_gpt2()
    fresh.load_state_dict(offload.load_state_dict_from(str(tmp_path / "ckpt")))
    ids = torch.randint(0, 211, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, wrapped(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    offload.unwrap(wrapped)
    opt.close()


def test_no_pickle_is_read(tmp_path, monkeypatch, tiny_gpt2, offload_config):
    """The manifest is JSON and the data raw bytes: loading never unpickles."""
    m = offload.wrap(tiny_gpt2(), offload_config(tmp_path))
    opt = offload.AdamW(m.parameters(), lr=1e-2)
    offload.save_checkpoint(str(tmp_path / "ckpt"), m, opt)

    def refuse(*a, **k):
        raise AssertionError("unpickling during load")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    offload.load_checkpoint(str(tmp_path / "ckpt"), m, opt)
    manifest = read(tmp_path / "ckpt" / "manifest.json")
    names = {e["name"] for e in manifest["tensors"]}
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # tied: once, with alias
    assert all({"name", "dtype", "shape", "file", "offset", "length", "crc32"} <= e.keys()
               for e in manifest["tensors"])
    offload.unwrap(m)
    opt.close()


def test_peak_rss_while_saving_is_bounded_by_the_host_budget(tmp_path):
    """A 29M-parameter model (117 MB of weights, 470 MB with fp32 states) on NVMe with a
    64 MiB host budget: resident memory grows by no more than the budget plus 32 MiB."""
    r = child("rss", tmp_path / "rss.json", tmp_path / "ckpt", tmp_path / "w", timeout=600)
    assert r.returncode == 0, r.stderr
    got = read(tmp_path / "rss.json")
    assert got["checkpoint_bytes"] > 3 * got["param_bytes"] > 5 * got["host_budget"]
    assert got["peak"] - got["before"] <= got["host_budget"] + (32 << 20), got


# -- export -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tier", [("gpt2", "nvme"), ("llama", "host")])
def test_export_loads_with_from_pretrained(tmp_path, arch, tier, tiny_gpt2, tiny_llama, offload_config, train,
                                           lm_batches):
    """Exported shards (several, with an index) load with transformers' from_pretrained and
    give the wrapped model's logits; tied weights are written once."""
    model_fn = tiny_gpt2 if arch == "gpt2" else tiny_llama
    wrapped = offload.wrap(model_fn(), offload_config(tmp_path / "w", param_tier=tier, optimizer_tier=tier))
    opt = offload.AdamW(wrapped.parameters(), lr=1e-2)
    train(wrapped, opt, lm_batches(wrapped.config.vocab_size, steps=2))
    opt.synchronize()
    out = tmp_path / "export"
    files = offload.export(wrapped, str(out), shard_size="40KiB")
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    index = read(out / "model.safetensors.index.json")
    if arch == "gpt2":
        assert "lm_head.weight" not in index["weight_map"]
    loaded = type(wrapped).from_pretrained(str(out))
    ids = torch.randint(0, wrapped.config.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, wrapped(input_ids=ids).logits)
    before = sorted(os.listdir(out))
    with mock.patch("offload.checkpoint._export._stream", side_effect=OSError(28, "No space left on device")):
        with pytest.raises(OSError, match="No space"):  # (a failed export leaves the earlier one whole)
            offload.export(wrapped, str(out))
    assert sorted(os.listdir(out)) == before
    offload.export(wrapped, str(out))  # again, as one file: the old shards and index are gone
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]

    def killed(self, directory, *args, **kwargs):  # (stopped half way through writing config.json)
        with open(os.path.join(directory, "config.json"), "w") as fh:
            fh.write("{")
        raise KeyboardInterrupt

    exported, config = sorted(os.listdir(out)), (out / "config.json").read_bytes()
    with mock.patch.object(type(wrapped.config), "save_pretrained", killed), pytest.raises(KeyboardInterrupt):
        offload.export(wrapped, str(out))
    assert sorted(os.listdir(out)) == exported and (out / "config.json").read_bytes() == config  # (the earlier one)
    type(wrapped).from_pretrained(str(out))
    offload.unwrap(wrapped)
    opt.close()


class _ConfigSavingModel(torch.nn.Module):
    """The interface of a diffusers model that export relies on: ``config`` a plain mapping,
    saved by the model's ``save_config`` (diffusers' ConfigMixin)."""

    def __init__(self):
        super().__init__()
        self.config = {"_class_name": "Tiny", "width": 8}
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x))

    def save_config(self, directory):
        with open(os.path.join(directory, "config.json"), "w") as fh:
            json.dump(self.config, fh)


@pytest.mark.parametrize("shard_size", ["5GiB", "300B"])
def test_export_names_a_diffusers_models_files_as_diffusers_does(tmp_path, shard_size, offload_config):
    from safetensors.torch import load_file
    torch.manual_seed(0)
    ref = _ConfigSavingModel()
    wrapped = offload.wrap(_ConfigSavingModel(), offload_config(tmp_path / "w", param_tier="nvme"))
    wrapped.load_state_dict(ref.state_dict())
    out = tmp_path / "export"
    offload.export(wrapped, str(out), shard_size=shard_size)
    names = sorted(os.listdir(out))
    assert read(out / "config.json") == ref.config
    assert not [n for n in names if n.startswith("model")], names
    if shard_size == "5GiB":
        assert names == ["config.json", "diffusion_pytorch_model.safetensors"]
        files = ["diffusion_pytorch_model.safetensors"]
    else:
        files = sorted(set(read(out / "diffusion_pytorch_model.safetensors.index.json")["weight_map"].values()))
        assert len(files) > 1 and all(f.startswith("diffusion_pytorch_model-0") for f in files)
    got = {k: v for f in files for k, v in load_file(out / f).items()}
    assert got.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    offload.unwrap(wrapped)


def test_rng_state_round_trips_through_json():
    import random

    import numpy as np
    state = json.loads(json.dumps(offload.rng_state()))
    a = (torch.rand(3), random.random(), np.random.rand())
    offload.set_rng_state(state)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    with pytest.raises(ValueError, match="rng_state"):
        offload.set_rng_state({"nope": 1})


def test_atomic_directory_exchange_is_used_here(tmp_path):
    """On this Linux file system the swap is one atomic renameat2 exchange."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    assert _format._exchange(str(a), str(b))
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


@pytest.mark.parametrize("tiers", [("nvme", "nvme", "768KiB"), ("nvme", "host", "2MiB")],
                         ids=["states_on_nvme", "states_in_host_memory"])
def test_a_checkpoint_loads_at_the_host_budget_it_was_saved_at(tmp_path, tiers, tiny_gpt2, lm_batches, offload_config,
                                                               train):
    """A new user's trial: trained and saved at a tight host budget, the load into a fresh
    model at the same budget found no room to stage a group for NVMe beside the buffers it
    had read ahead (a window of half the budget, though the gradients resting in host memory
    held much of the rest). The window is half the pool's free room now; the states load.
    With the states resting in host memory (written from where they rest), their size still
    set the stream's one buffer size, which the budget had no room for: a blob now takes a
    buffer of its own size where that is all that fits (save and load refused at 2 MiB)."""
    param_tier, optimizer_tier, budget = tiers

    def build(where):
        m = offload.wrap(tiny_gpt2(), offload_config(tmp_path / where, host_budget=budget, device_budget="128KiB",
                                                     resident_bytes=0, param_tier=param_tier,
                                                     optimizer_tier=optimizer_tier))
        return m, offload.AdamW(m.parameters(), lr=1e-2)

    _saved_loads_alike(tmp_path, build, lambda m, opt: train(m, opt, lm_batches(211, steps=2)))


def _saved_loads_alike(tmp_path, build, train_some, *, budget=None):
    """Train what ``build("a")`` gives, save it, load it into ``build("b")``: the weights and
    the optimizer's states equal the saved ones (and the host peak stays within ``budget``)."""
    m, opt = build("a")
    train_some(m, opt)
    offload.save_checkpoint(str(tmp_path / "ckpt"), m, opt)
    want, want_opt = {k: v.clone() for k, v in m.state_dict().items()}, opt.state_dict()["state"]
    opt.close()
    offload.close(m)
    m, opt = build("b")
    try:
        offload.load_checkpoint(str(tmp_path / "ckpt"), m, opt)
        got = m.state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        for i, rows in opt.state_dict()["state"].items():
            for key, value in rows.items():
                assert torch.equal(value, want_opt[i][key]), (i, key)
        assert budget is None or offload.stats(m)["host_peak_bytes"] <= budget
    finally:
        opt.close()
        offload.close(m)


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_coded_moments_load_at_the_least_host_budget_the_plan_accepts(tmp_path, moments, tiny_llama, lm_batches,
                                                                    offload_config, train):
    """States in host memory with coded moments, at the least host budget the plan accepts
    (found to a page): save, then load into a fresh model and optimizer at that budget; the
    weights and the states are the saved ones. (The load decodes a shard's rows into a
    buffer beside them: it was refused at the budget that saved, 2 MiB of a plan minimum of
    1.41 MiB, while the update's own decode buffer stayed held. The load now has that buffer
    back, codes into the resting rows in place, packs the saved pieces as the file holds
    them, and the plan counts what is left.)"""
    settings = dict(device_budget="256KiB", resident_bytes=0, param_tier="host", optimizer_tier="host")

    def fits(budget: int) -> bool:
        cfg = offload_config(tmp_path / "plan", host_budget=budget, **settings)
        return offload.plan(tiny_llama(), cfg, optimizer="adamw", moments=moments).fits

    lo, hi = 16 << 10, 8 << 20
    assert not fits(lo) and fits(hi)
    while hi - lo > 4096:
        mid = -(-(lo + hi) // 8192) * 4096
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)

    def build(where):
        m = offload.wrap(tiny_llama(), offload_config(tmp_path / where, host_budget=hi, **settings))
        return m, offload.AdamW(m.parameters(), lr=1e-2, moments=moments)

    _saved_loads_alike(tmp_path, build, lambda m, opt: train(m, opt, lm_batches(197, steps=2), clip=1.0), budget=hi)
