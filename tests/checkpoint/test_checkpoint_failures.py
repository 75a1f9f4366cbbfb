"""save_checkpoint / load_checkpoint against crashes (a process killed at each point of a
save), corruption, wrong models and optimizers, bad input and full or read-only disks:
each refused with an error that names the cause, and nothing already saved is lost."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import offload
from offload.io import DiskFullError

from .processes import child, read

transformers = pytest.importorskip("transformers")


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
    with pytest.raises(offload.CheckpointError, match=f"checksum mismatch in .*{section}.*{entry['name']}") as info:
        offload.load_checkpoint(str(path), m, opt)
    # (the error's traceback, kept by a caller until its cycle is collected, held a view of the
    # pool buffer the bytes were checked in: the pool, dropping it later, warned of a tensor
    # offload did not hand out)
    held, error = [], info.value
    while error is not None:
        tb = error.__traceback__
        while tb is not None:
            held += [k for k, v in tb.tb_frame.f_locals.items() if isinstance(v, torch.Tensor) and v.numel() > 8]
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    assert not held, held


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


def test_a_manifest_the_disk_cannot_take_is_named_and_replaces_nothing(tmp_path, monkeypatch, tiny_gpt2):
    """The disk filling after the tensors are written, at the manifest: a bare OSError
    without a path before."""
    import errno

    from offload.checkpoint import _format
    path = str(tmp_path / "ckpt")
    small = tiny_gpt2()
    offload.save_checkpoint(path, small)
    before = sorted(os.listdir(path))
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("manifest.json.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(_format.os, "fsync", fsync)
    with pytest.raises(DiskFullError, match=r"manifest\.json\.tmp.*ENOSPC.*nothing was replaced"):
        offload.save_checkpoint(path, small)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and sorted(os.listdir(path)) == before
    offload.load_checkpoint(path, tiny_gpt2())


def test_a_load_beside_a_save_of_another_process_says_so(saved, monkeypatch):
    """While another process's first save is under way, or when its save swaps the directory
    in during the load: said so, not an interrupted save or a corrupt checkpoint."""
    path, m, opt = saved
    other = subprocess.Popen(["sleep", "60"])
    try:
        first = path.parent / "first"
        (path.parent / f"first.tmp-{other.pid}-0123abcd").mkdir()
        with pytest.raises(offload.CheckpointError, match="being saved by a process still running"):
            offload.load_checkpoint(str(first), m, opt)
    finally:
        other.kill()
        other.wait()
    run = offload.checkpoint._load.BlobReader.run

    def swapped_during(self, items, total=0):
        offload.save_checkpoint(str(path), m, opt)  # (another save, a new manifest id)
        raise offload.CheckpointError("checksum mismatch in model.bin: the checkpoint is corrupt")

    monkeypatch.setattr(offload.checkpoint._load.BlobReader, "run", swapped_during)
    with pytest.raises(offload.CheckpointError, match="was replaced while it was being read.*load it again"):
        offload.load_checkpoint(str(path), m, opt)
    monkeypatch.setattr(offload.checkpoint._load.BlobReader, "run", run)
    offload.load_checkpoint(str(path), m, opt)


def test_an_edited_manifest_is_refused(saved):
    """The manifest carries a checksum of itself: a learning rate or a step count changed in
    it (an edit, a flipped bit) used to load silently, the tensors' own checksums intact. A
    manifest without one (saved before) loads as before."""
    path, m, opt = saved
    manifest = read(path / "manifest.json")
    offload.load_checkpoint(str(path), m, opt)  # (as saved: it loads)
    edited = json.loads(json.dumps(manifest).replace('"lr": 0.01', '"lr": 0.09', 1))
    assert edited != manifest
    (path / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(offload.CheckpointError, match="manifest.json.*does not match its own checksum"):
        offload.load_checkpoint(str(path), m, opt)
    del manifest["manifest_crc32"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    offload.load_checkpoint(str(path), m, opt)
