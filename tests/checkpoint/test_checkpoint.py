"""save_checkpoint / load_checkpoint / state_dict / export against the same training run
without a save, and against crashes, corruption, wrong models and full disks."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from unittest import mock

import pytest
import torch

import offload
from offload.checkpoint import _format
from offload.io import DiskFullError

transformers = pytest.importorskip("transformers")

CHILD = os.path.join(os.path.dirname(__file__), "child.py")


def child(*args, kill=None, fallback=False, timeout=240):
    env = dict(os.environ)
    env.pop("CHILD_KILL_AT", None)
    if kill:
        env["CHILD_KILL_AT"] = kill
    code = None
    if fallback:  # the file system has no renameat2 RENAME_EXCHANGE: two renames
        code = ("import sys, runpy; import offload.checkpoint._format as f; f._exchange = lambda a, b: False; "
                f"sys.argv = {[CHILD, *map(str, args)]!r}; runpy.run_path({CHILD!r}, run_name='__main__')")
    cmd = [sys.executable, "-c", code] if code else [sys.executable, CHILD, *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def read(path):
    with open(path) as fh:
        return json.load(fh)


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
    loop may) loses nothing; a backward since, whose sum a checkpoint leaves out, is said."""
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


# -- crashes, corruption, bad input -------------------------------------------------------------
@pytest.mark.parametrize("point,expect", [("blob:0", "old"), ("blob:5", "old"), ("before_manifest", "old"),
                                          ("after_manifest", "old"), ("before_swap", "old"),
                                          ("after_swap", "new")])
def test_killed_during_save_leaves_a_complete_checkpoint(tmp_path, point, expect, tiny_gpt2, offload_config):
    """SIGKILL at each step of re-saving a checkpoint: the path then holds the old complete
    checkpoint (or the new one once it was swapped in), never a partial one."""
    ckpt = tmp_path / "ckpt"
    r = child("train", tmp_path / "first.json", ckpt, "nvme", "nvme", tmp_path / "w0")
    assert r.returncode == 0, r.stderr
    old = read(ckpt / "manifest.json")["id"]
    r = child("train", tmp_path / "second.json", ckpt, "nvme", "nvme", tmp_path / "w1", kill=point)
    assert r.returncode == -9, (r.returncode, r.stderr)
    m = offload.wrap(tiny_gpt2(dropout=0.1), offload_config(tmp_path / "w2"))
    opt = offload.AdamW(m.parameters(), lr=1e-2)
    assert offload.load_checkpoint(str(ckpt), m, opt)["step"] == 3
    assert (read(ckpt / "manifest.json")["id"] == old) == (expect == "old")
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".prev-" in p]  # cleaned up
    offload.unwrap(m)
    opt.close()


def test_killed_between_the_two_renames_is_recovered(tmp_path, tiny_gpt2, offload_config):
    """Without renameat2 the swap is two renames; a crash between them leaves no checkpoint
    at the path and a complete previous one beside it, which load puts back."""
    ckpt = tmp_path / "ckpt"
    assert child("train", tmp_path / "a.json", ckpt, "nvme", "nvme", tmp_path / "w0").returncode == 0
    r = child("train", tmp_path / "b.json", ckpt, "nvme", "nvme", tmp_path / "w1", kill="between_renames",
              fallback=True)
    assert r.returncode == -9, r.stderr
    assert not ckpt.exists()
    m = offload.wrap(tiny_gpt2(dropout=0.1), offload_config(tmp_path / "w2"))
    opt = offload.AdamW(m.parameters(), lr=1e-2)
    assert offload.load_checkpoint(str(ckpt), m, opt)["step"] == 3
    offload.unwrap(m)
    opt.close()


def test_first_save_killed_is_refused(tmp_path, tiny_gpt2, offload_config):
    ckpt = tmp_path / "ckpt"
    r = child("train", tmp_path / "a.json", ckpt, "nvme", "nvme", tmp_path / "w0", kill="blob:2")
    assert r.returncode == -9
    m = offload.wrap(tiny_gpt2(dropout=0.1), offload_config(tmp_path / "w2"))
    with pytest.raises(offload.CheckpointError, match="incomplete checkpoint"):
        offload.load_checkpoint(str(ckpt), m)
    offload.unwrap(m)


@pytest.mark.parametrize("section", ["model.bin", "optimizer.bin"])
def test_corrupted_byte_is_detected(saved, section):
    path, m, opt = saved
    entry = next(e for e in read(path / "manifest.json")["tensors"] if e["file"] == section and e["length"] > 100)
    with open(path / section, "r+b") as fh:
        fh.seek(entry["offset"] + entry["length"] // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(offload.CheckpointError, match=f"checksum mismatch in .*{section}.*{entry['name']}"):
        offload.load_checkpoint(str(path), m, opt)


def test_a_load_that_fails_half_way_leaves_the_optimizer_refusing_to_step(tmp_path, tiny_gpt2, offload_config,
                                                                         lm_batches, train):
    """States in host memory load in place (read straight into the resting rows): a
    checksum mismatch found after some rows were overwritten leaves a mix of old and new
    states, so the optimizer refuses to step until a load succeeds."""
    m = offload.wrap(tiny_gpt2(), offload_config(tmp_path / "w", param_tier="nvme", optimizer_tier="host"))
    opt = offload.AdamW(m.parameters(), lr=1e-2)
    batches = lm_batches(211, steps=2)
    try:
        train(m, opt, batches[:1])
        good, bad = tmp_path / "good", tmp_path / "bad"
        offload.save_checkpoint(str(good), m, opt)
        offload.save_checkpoint(str(bad), m, opt)
        entry = [e for e in read(bad / "manifest.json")["tensors"] if e["file"] == "optimizer.bin"][-1]
        with open(bad / "optimizer.bin", "r+b") as fh:
            fh.seek(entry["offset"] + entry["length"] - 1)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(offload.CheckpointError, match="checksum mismatch"):
            offload.load_checkpoint(str(bad), m, opt)
        with pytest.raises(RuntimeError, match="checkpoint load stopped half way.*load_checkpoint"):
            train(m, opt, batches[1:])
        offload.load_checkpoint(str(good), m, opt)
        train(m, opt, batches[1:])
    finally:
        opt.close()
        offload.unwrap(m)


def test_missing_manifest_and_truncated_file_are_refused(saved):
    path, m, opt = saved
    size = os.path.getsize(path / "optimizer.bin")
    os.truncate(path / "optimizer.bin", size // 2)
    with pytest.raises(offload.CheckpointError, match="incomplete checkpoint: .*optimizer.bin"):
        offload.load_checkpoint(str(path), m, opt)
    os.remove(path / "manifest.json")
    with pytest.raises(offload.CheckpointError, match="incomplete checkpoint: missing manifest"):
        offload.load_checkpoint(str(path), m, opt)


def test_wrong_model_lists_the_differences(saved, tmp_path, tiny_llama):
    path, _, _ = saved
    other = tiny_llama()
    with pytest.raises(offload.CheckpointError) as info:
        offload.load_checkpoint(str(path), other)
    text = str(info.value)
    assert "missing from the checkpoint" in text and "model.embed_tokens.weight" in text
    assert "not in the model" in text and "transformer.wpe.weight" in text
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64)
    with pytest.raises(offload.CheckpointError, match=r"shapes differ.*transformer.wte.weight: checkpoint \(211, 64\), model \(300, 64\)"):
        offload.load_checkpoint(str(path), transformers.GPT2LMHeadModel(cfg))


def test_wrong_optimizer_is_refused(saved):
    path, m, opt = saved
    opt.close()  # (one open optimizer per parameter)
    sgd = offload.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(offload.CheckpointError, match="optimizer is offload.optim._rules.AdamW"):
        offload.load_checkpoint(str(path), m, sgd)
    sgd.close()
    fewer = offload.AdamW(list(m.parameters())[:3], lr=0.1)
    with pytest.raises(offload.CheckpointError, match="parameters differ"):
        offload.load_checkpoint(str(path), m, fewer)
    fewer.close()


def test_bad_extra_and_unwritable_paths_fail_before_writing(tmp_path, tiny_gpt2):
    m = tiny_gpt2()
    with pytest.raises(offload.CheckpointError, match="extra cannot be saved"):
        offload.save_checkpoint(str(tmp_path / "c"), m, extra={"tensor": torch.zeros(1)})
    assert not os.listdir(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(offload.CheckpointError, match="cannot create the directory"):
        offload.save_checkpoint(str(blocker / "sub" / "c"), m)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("keep me")
    with pytest.raises(offload.CheckpointError, match="not an offload checkpoint"):
        offload.save_checkpoint(str(tmp_path / "user"), m)
    assert (tmp_path / "user" / "notes.txt").read_text() == "keep me"


def test_read_only_directory_is_refused(loop_fs, tmp_path, tiny_gpt2):
    mnt = loop_fs(size="32M")
    subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    try:
        with pytest.raises(offload.CheckpointError, match="not writable"):
            offload.save_checkpoint(os.path.join(mnt, "ckpt"), tiny_gpt2())
    finally:
        subprocess.run(["mount", "-o", "remount,rw", mnt], check=True)


def test_disk_full_keeps_the_previous_checkpoint(loop_fs, tmp_path, monkeypatch, tiny_gpt2):
    """A disk that cannot hold the new checkpoint: the error says how many bytes were needed,
    nothing is left behind, the previous checkpoint loads. Checked both when free space is
    short up front and when the disk fills during the save (free space misreported)."""
    mnt = loop_fs(size="24M")
    path = os.path.join(mnt, "ckpt")
    small = tiny_gpt2()
    offload.save_checkpoint(path, small)
    big_cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2000, n_positions=64)
    big = transformers.GPT2LMHeadModel(big_cfg)  # ~16 MB of fp32 weights + 2x Adam moments
    opt = torch.optim.AdamW(big.parameters(), lr=1e-3)
    ids = torch.randint(0, 2000, (1, 8))
    big(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with pytest.raises(DiskFullError, match=r"needs .* \(\d+ bytes\).*previous checkpoint .* is intact") as info:
        offload.save_checkpoint(path, big, opt)
    assert info.value.needed > info.value.free
    real = os.statvfs

    class Roomy:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1 << 40

    monkeypatch.setattr(os, "statvfs", lambda p: Roomy(real(p)))
    with pytest.raises(DiskFullError, match=r"needs .* \(\d+ bytes\)"):
        offload.save_checkpoint(path, big, opt)
    monkeypatch.undo()
    assert sorted(os.listdir(mnt)) == ["ckpt", "lost+found"]
    fresh = tiny_gpt2()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    offload.load_checkpoint(path, fresh)
    for (n, p), (_, q) in zip(small.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n


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
    offload.unwrap(wrapped)
    opt.close()


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
