"""examples/finetune.py end to end with a tiny model: it trains, checkpoints, resumes
exactly where an uninterrupted run would be, and exports weights from_pretrained loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune.py")
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "300", "--seq-len", "32",
        "--device-budget", "4MiB", "--host-budget", "64MiB", "--device", "cpu", "--grad-accum", "2"]


def run(tmp_path, *args, log=None):
    out = subprocess.run([sys.executable, SCRIPT, *TINY, "--nvme-path", str(tmp_path / "nvme"), *args],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    if log is not None:
        log.append(out.stderr)
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+)/\d+ loss ([\d.]+)", out.stderr)}


def test_train_resume_and_export(tmp_path):
    full = run(tmp_path, "--steps", "4", "--export-dir", str(tmp_path / "full"))
    assert sorted(full) == [1, 2, 3, 4] and full[4] < full[1]
    part = run(tmp_path, "--steps", "4", "--stop-at", "2", "--save-dir", str(tmp_path / "ckpt"), "--export-dir", "")
    assert part == {1: full[1], 2: full[2]}
    # (a save killed between its two renames, where the file system cannot swap directories:
    # only the previous checkpoint beside the path; --resume puts it back and goes on)
    os.rename(tmp_path / "ckpt", tmp_path / "ckpt.prev-999999999-deadbeef")
    rest = run(tmp_path, "--steps", "4", "--save-dir", str(tmp_path / "ckpt"), "--resume",
               "--export-dir", str(tmp_path / "resumed"))
    assert rest == {3: full[3], 4: full[4]}  # bit-exact: same batches, RNG, states
    a = safetensors.load_file(str(tmp_path / "full" / "model.safetensors"))
    b = safetensors.load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"))
    for name, p in model.named_parameters():
        key = name if name in a else "transformer.wte.weight"  # tied lm_head
        assert torch.equal(p, a[key]), name


@pytest.mark.parametrize("bad, says", [(["--grad-accum", "0"], "--grad-accum: must be at least 1"),
                                        (["--model", "no-such-dir"], "no such file or directory: 'no-such-dir'"),
                                        (["--export-dir", "/dev/null/x"], "'/dev/null' is a file, not a directory"),
                                        (["--nvme-path", "/dev/null"], "--nvme-path '/dev/null': '/dev/null' is a file")])
def test_bad_values_are_refused_before_anything_runs(tmp_path, bad, says):
    """--steps 0 or --grad-accum 0 trained nothing and exported the untrained model; a
    --model that is not here went to the Hugging Face Hub; an --export-dir that cannot be
    written was found after the training."""
    out = subprocess.run([sys.executable, SCRIPT, *bad], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and says in out.stderr, out.stderr[-2000:]
    assert not os.listdir(tmp_path)


def test_a_save_dir_that_holds_something_else_is_refused_before_training(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    out = subprocess.run([sys.executable, SCRIPT, "--save-dir", str(tmp_path / "notes"), "--resume"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and "holds no offload checkpoint" in out.stderr, out.stderr[-2000:]
    assert os.listdir(tmp_path / "notes") == ["todo.txt"]


def test_update_in_backward_gives_the_same_run(tmp_path):
    plain = run(tmp_path, "--steps", "3", "--clip", "0", "--export-dir", str(tmp_path / "plain"))
    overlapped = run(tmp_path, "--steps", "3", "--clip", "0", "--update-in-backward",
                     "--export-dir", str(tmp_path / "overlapped"))
    assert overlapped == plain
    a = safetensors.load_file(str(tmp_path / "plain" / "model.safetensors"))
    b = safetensors.load_file(str(tmp_path / "overlapped" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    out = subprocess.run([sys.executable, SCRIPT, "--update-in-backward"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--clip 0" in out.stderr  # the default clips: refused up front


def test_checkpoints_offloaded_to_nvme_give_the_same_run(tmp_path):
    plain = run(tmp_path, "--steps", "2", "--checkpointing", "--export-dir", str(tmp_path / "plain"))
    log = []
    moved = run(tmp_path, "--steps", "2", "--checkpointing", "--activations", "nvme", "--activation-budget", "0",
                "--activation-min-bytes", "0", "--export-dir", str(tmp_path / "moved"), log=log)
    assert moved == plain
    written = re.findall(r"activations: written ([\d.]+) (\w+)", log[0])
    assert len(written) == 2 and all(float(n) > 0 for n, _ in written)  # (the checkpoints did move)
    a = safetensors.load_file(str(tmp_path / "plain" / "model.safetensors"))
    b = safetensors.load_file(str(tmp_path / "moved" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_help_explains_every_flag(help_entries):
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, COLUMNS="1000"))  # one line per entry: no word broken at a hyphen
    assert out.returncode == 0
    flags = re.findall(r"add_argument\(\"(--[\w-]+)\"", open(SCRIPT).read())
    for flag in flags:
        assert flag in out.stdout
    assert "python examples/finetune.py" in out.stdout
    # argparse lists every flag, explained or not: each one's own entry must say something
    entries = help_entries(out.stdout)
    assert set(flags) <= entries.keys(), set(flags) - entries.keys()
    unexplained = [flag for flag in flags if len(entries[flag].split()) < 3]
    assert not unexplained, f"flags without a help text: {unexplained}"
    # and what a user needs before a first run is said where they look for it
    for flag, says in (("--nvme-path", "./offload-nvme"), ("--export-dir", "./finetuned"),
                       ("--update-in-backward", "--clip 0"), ("--clip", "0 to disable"), ("--steps", "20"),
                       ("--device-budget", "1GiB"), ("--host-budget", "4GiB"), ("--resume", "--save-dir")):
        assert says in entries[flag], (flag, entries[flag])


HF = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_trainer.py")


def test_hf_trainer_matches_the_same_trainer_without_offload(tmp_path):
    """transformers.Trainer with its defaults (clipping at 1.0), the wrapped model and
    offload.AdamW gives the losses of the same Trainer run on the plain model with torch
    AdamW; its save_steps checkpoints and the export are written."""
    pytest.importorskip("accelerate")
    common = [sys.executable, HF, *TINY, "--steps", "4", "--save-steps", "2", "--output-dir", str(tmp_path / "out")]
    losses = {}
    for mode in ("offload", "plain"):
        extra = ["--nvme-path", str(tmp_path / "nvme")] + (["--no-offload"] if mode == "plain" else [])
        out = subprocess.run(common + extra, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        losses[mode] = [float(m.group(1)) for m in re.finditer(r"step \d+ loss ([\d.]+)", out.stderr)]
    assert len(losses["offload"]) == 4
    torch.testing.assert_close(losses["offload"], losses["plain"], rtol=1e-4, atol=1e-5)
    assert (tmp_path / "out" / "model" / "model.safetensors").exists()
    assert (tmp_path / "out" / "checkpoint-2" / "optimizer.pt").exists()


INFER = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "inference.py")


def test_inference_from_nvme_generates_what_the_plain_model_does(tmp_path):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg).eval()
    plain.save_pretrained(tmp_path / "model")
    prompt = "17 plus 25 is"
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        want = plain.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    out = subprocess.run([sys.executable, INFER, "--model", str(tmp_path / "model"), "--prompt", prompt,
                          "--max-new-tokens", "8", "--device", "cpu", "--device-budget", "1MiB",
                          "--host-budget", "16MiB", "--nvme-path", str(tmp_path / "nvme")],
                         capture_output=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.decode().rstrip("\n") == prompt + bytes(t for t in want if t < 256).decode(errors="replace")
    assert b"tokens/s" in out.stderr and b"read" in out.stderr


@pytest.mark.parametrize("bad, says", [(["--prompt", ""], "--prompt is empty"),
                                        (["--nvme-path", "/proc/no-such"], "cannot create it"),
                                        (["--model", "t5"], "has no causal language model class")])
def test_inference_refuses_bad_values_with_the_flag(tmp_path, bad, says):
    if bad[1] == "t5":
        config = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)
        transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
        bad = ["--model", str(tmp_path / "t5")]
    swap = [] if bad[0] == "--nvme-path" else ["--nvme-path", str(tmp_path / "nvme")]
    out = subprocess.run([sys.executable, INFER, *bad, *swap], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 2 and says in out.stderr, out.stderr[-2000:]


def test_two_ranks_under_torchrun(tmp_path):
    """torchrun --nproc_per_node 2: the ranks train together (rank 0 logs the mean loss),
    save one checkpoint and export one model, both holding the whole trained weights."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, *TINY,
           "--nvme-path", str(tmp_path / "nvme"), "--steps", "3", "--save-dir", str(tmp_path / "ckpt"),
           "--export-dir", str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "partitioned over 2 ranks" in out.stderr
    losses = re.findall(r"\[rank (\d)\] step \d+/3 loss", out.stderr)
    assert losses == ["0", "0", "0"]  # one line per step, from rank 0
    assert sorted(os.listdir(tmp_path / "nvme")) == ["rank0", "rank1"]
    exported = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    import offload

    saved = offload.load_state_dict_from(str(tmp_path / "ckpt"))
    assert all(torch.equal(exported[k], saved[k]) for k in exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, exported["transformer.h.1.mlp.c_fc.weight"])
