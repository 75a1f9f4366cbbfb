"""Shared fixtures: small models and their configs, training against torch's optimizers, a
directory on a real disk, checks that nothing leaks, and injected disk faults."""

from __future__ import annotations

import errno
import os
import pathlib
import threading

import pytest
import torch

import offload
from offload._os import ram_file_system
from offload.io import FileBackend


# -- small models, their configs, batches and training ----------------------------------------------
@pytest.fixture
def tiny_gpt2():
    """``tiny_gpt2(dropout=0.0, **config)``: a GPT-2 language model of 2 layers, 64 wide, 4
    heads, 211 tokens, 64 positions, tied embeddings, built after ``torch.manual_seed(0)``
    (two builds are equal); ``dropout`` sets its three dropout rates, ``config`` overrides
    any other GPT2Config field."""
    return _tiny_gpt2


def _tiny_gpt2(*, dropout: float = 0.0, **config) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    args = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=64, tie_word_embeddings=True,
                resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    args.update(config)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**args))


@pytest.fixture
def wide_gpt2():
    """``wide_gpt2()``: the tiny GPT-2 with one layer and a 4099 x 128 embedding, whose
    optimizer shards have rows of 1 MiB and more, so padded."""
    return lambda: _tiny_gpt2(n_layer=1, n_embd=128, vocab_size=4099, n_positions=32, bos_token_id=0,
                              eos_token_id=0)


@pytest.fixture
def wide_llama():
    """``wide_llama()``: the tiny Llama with one layer, 128 wide and a 4099-token vocabulary:
    embedding and head of 4099 x 128, whose optimizer rows are 1 MiB and more, so padded.

    Where a test compares weights after clipped steps, use this rather than
    :func:`wide_gpt2`: GPT-2's key bias has a gradient that is zero in exact arithmetic (the
    softmax does not see it), so its trajectory under Adam is rounding noise, and the clip
    factor's last bit (the norm of a parameter split across shards is summed from its
    pieces) moves that noise by up to 1e-4 on some CPUs while no output changes."""
    return lambda: _tiny_llama(num_hidden_layers=1, hidden_size=128, intermediate_size=256, vocab_size=4099,
                               max_position_embeddings=32, bos_token_id=0, eos_token_id=0)


@pytest.fixture
def tiny_llama():
    """``tiny_llama(**config)``: a Llama language model of 2 layers, 64 wide (128 in the MLP),
    4 heads over 2 key-value heads, 197 tokens, 64 positions, untied embeddings, built after
    ``torch.manual_seed(0)``; ``config`` overrides any LlamaConfig field."""
    return _tiny_llama


def _tiny_llama(**config) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    args = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=197, max_position_embeddings=64, tie_word_embeddings=False)
    args.update(config)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**args))


@pytest.fixture
def offload_config():
    """``offload_config(path, preset=None, /, **settings)``: an OffloadConfig for a tiny model
    on the CPU, ``path`` created: both tiers on NVMe, 2 MiB device and 64 MiB host budgets,
    4 KiB kept resident, 16 MiB swap files, and ``nvme_path`` the directory ``swap`` (default
    "nvme") under ``path`` when a tier is on NVMe, else None. A ``preset`` mapping (a test
    file's own defaults), then ``settings``, override any of these."""
    return _offload_config


def _offload_config(path, preset=None, /, **settings) -> offload.OffloadConfig:
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="nvme", device_budget="2MiB",
                host_budget="64MiB", resident_bytes="4KiB", file_size="16MiB")
    args.update(preset or {})
    args.update(settings)
    swap = args.pop("swap", "nvme")
    if "nvme_path" not in args:
        args["nvme_path"] = str(path / swap) if "nvme" in (args["param_tier"], args["optimizer_tier"]) else None
    return offload.OffloadConfig(**args)


@pytest.fixture
def lm_batches():
    """``lm_batches(vocab, steps=5, micro=2)``: ``steps`` lists of ``micro`` batches of 2 x 12
    token ids below ``vocab``, the same every call (seed 1)."""
    return _lm_batches


def _lm_batches(vocab: int, steps: int = 5, micro: int = 2) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, vocab, (2, 12), generator=g) for _ in range(micro)] for _ in range(steps)]


@pytest.fixture
def train():
    """``train(model, opt, batches, *, clip=None, sched=None, set_branch=None, scale=None)``:
    a step per entry of ``batches`` (lists of micro-batches, the loss averaged over them):
    ``set_branch(model, step)`` first, ``scale(loss)`` for backward, gradients clipped to
    ``clip`` (offload's clip_grad_norm_ for offload's optimizers, torch's otherwise), then
    step, zero_grad and ``sched.step()``. Returns each step's loss."""
    return _train


def _train(model, opt, batches, *, clip=None, sched=None, set_branch=None, scale=None) -> list[float]:
    losses = []
    for step, micro in enumerate(batches):
        if set_branch is not None:
            set_branch(model, step)
        total = 0.0
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            (scale(loss) if scale else loss).backward()
            total += float(loss.detach())
        if clip is not None:
            if isinstance(opt, offload.optim.OffloadOptimizer):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total)
    return losses


@pytest.fixture
def assert_rows_padded():
    """``assert_rows_padded(opt)``: some shard has rows of 1 MiB or more, each padded to 4 KiB
    past a multiple of 2 MiB (128 KiB under 16 MiB), and holds fewer elements than its rows."""
    return _assert_rows_padded


def _assert_rows_padded(opt) -> None:
    padded = [s for s in opt._book.shards if s.numel * 4 >= 1 << 20]
    assert padded
    for shard in padded:
        period = 2 << 20 if shard.numel * 4 >= 16 << 20 else 128 << 10
        assert shard.numel * 4 % period == 4096
        assert sum(seg.length for seg in shard.segments) < shard.numel


# -- the machine: leaks, a real disk -------------------------------------------------------------------


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves threads or file descriptors behind. Not counted: threads
    Python did not start (a _DummyThread is a C++ thread that called into Python, such as
    the CUDA autograd engine's device thread, which lives as long as the process) and the
    driver's device files (/dev/nvidia*), which the first use of CUDA opens for the process."""
    threads_before = set(threading.enumerate())
    fds_before = _fds()
    yield
    leaked_threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()
                      and t.name != "tqdm_monitor"  # transformers' progress bars, not ours
                      and not isinstance(t, threading._DummyThread)]
    assert not leaked_threads, f"threads left running: {leaked_threads}"
    leaked = {fd for fd in _fds() - fds_before if _is_file(fd) and not _is_device_file(fd)}
    assert not leaked, f"file descriptors left open: {[os.readlink(f'/proc/self/fd/{fd}') for fd in leaked]}"


def _is_device_file(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia")
    except OSError:
        return False


def _is_file(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/")
    except OSError:
        return False


@pytest.fixture
def record_schedule():
    """``record_schedule(model) -> list``: the schedule of a wrapped model as it runs, as
    ``(event, group key, phase)`` tuples (events "acquire", "fetch", "ready", "release";
    phases "forward", "backward", "demand", "prefetch"). Call it after ``offload.wrap`` and
    before the first forward."""
    import offload

    def record(model) -> list:
        log: list = []
        offload.params.manager_of(model).coordinator.schedule_log = log
        return log

    return record


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a disk, where O_DIRECT reaches the device: pytest's ``tmp_path``, or,
    when that is on a file system held in RAM (tmpfs, ramfs), a fresh directory under
    ``$OFFLOAD_TEST_DISK``. Skips, naming the fix, when neither is on a disk."""
    in_ram = ram_file_system(tmp_path)
    if in_ram is None:
        yield str(tmp_path)
        return
    chosen = os.environ.get("OFFLOAD_TEST_DISK")
    if not chosen:
        pytest.skip(f"tmp_path {tmp_path} is on {in_ram} (files in RAM, not a disk): set OFFLOAD_TEST_DISK to "
                    "a directory on a local disk, or run pytest with --basetemp on one")
    if ram_file_system(chosen) is not None:
        pytest.fail(f"OFFLOAD_TEST_DISK={chosen!r} is on {ram_file_system(chosen)}, not a disk: point it at a "
                    "directory on a local disk")
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="offload-test-", dir=chosen)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def help_entries():
    """``help_entries(text)``: argparse's ``--help`` output as {flag: its help text}, for
    tests that each flag is explained (argparse lists a flag whether it is or not). An
    option's line holds its invocation (named by its first long flag) and, after two
    spaces or more, the start of its help; deeper-indented lines continue it. Run the
    command with a wide ``COLUMNS`` so that no word is broken at a hyphen."""
    return _help_entries


def _help_entries(text: str) -> dict[str, str]:
    import re

    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, rest = line.strip().partition("  ")
            flag = (re.findall(r"--[\w-]+", invocation) or invocation.split())[0].rstrip(",")
            entries[flag] = rest.strip()
        elif flag is not None and line.startswith(" " * 8) and line.strip():
            entries[flag] = f"{entries[flag]} {line.strip()}".strip()
        else:
            flag = None
    return entries


class FaultyBackend(FileBackend):
    """A FileBackend that misbehaves on request, for fault-injection tests.

    ``faults`` maps an operation ("preadv", "pwritev", "fallocate", "open_direct") to a list
    of actions used one per call: an errno int raises OSError(errno), "short" transfers
    half the bytes, "zero" returns 0 (end of file / nothing written), None behaves.
    ``sector`` makes direct descriptors refuse unaligned calls like a disk with that
    logical block size would. ``calls`` records (op, offset, length, direct).
    """

    def __init__(self, faults: dict | None = None, *, sector: int | None = None):
        self.faults = {k: list(v) for k, v in (faults or {}).items()}
        self.sector = sector
        self.direct_fds: set[int] = set()
        self.calls: list[tuple] = []

    def _next(self, op: str):
        queue = self.faults.get(op)
        return queue.pop(0) if queue else None

    def open(self, path, flags, mode=0o600):
        if flags & getattr(os, "O_DIRECT", 0):
            action = self._next("open_direct")
            if isinstance(action, int):
                raise OSError(action, os.strerror(action), path)
            fd = super().open(path, flags, mode)
            self.direct_fds.add(fd)
            return fd
        return super().open(path, flags, mode)

    def close(self, fd):
        self.direct_fds.discard(fd)
        super().close(fd)

    def _transfer(self, op, fd, buffer, offset, real):
        direct = fd in self.direct_fds
        self.calls.append((op, offset, len(buffer), direct))
        if direct and self.sector:
            import ctypes
            address = ctypes.addressof(ctypes.c_char.from_buffer(buffer)) if not buffer.readonly else 0
            if offset % self.sector or len(buffer) % self.sector or address % self.sector:
                raise OSError(errno.EINVAL, "unaligned O_DIRECT transfer")
        action = self._next(op)
        if isinstance(action, int):
            raise OSError(action, os.strerror(action))
        if action == "zero":
            return 0
        if action == "short" and len(buffer) > 1:
            return real(fd, buffer[: len(buffer) // 2], offset)
        return real(fd, buffer, offset)

    def preadv(self, fd, buffer, offset):
        return self._transfer("preadv", fd, buffer, offset, super().preadv)

    def pwritev(self, fd, buffer, offset):
        return self._transfer("pwritev", fd, buffer, offset, super().pwritev)

    def fallocate(self, fd, offset, length):
        action = self._next("fallocate")
        if isinstance(action, int):
            raise OSError(action, os.strerror(action))
        super().fallocate(fd, offset, length)


@pytest.fixture
def faulty():
    return FaultyBackend


@pytest.fixture
def loop_fs(tmp_path):
    """Factory: mount a fresh ext4 file system on a loop device with a given sector size.

    Real hardware behaviour (a 4 KiB logical sector refusing 512-byte O_DIRECT, a disk that
    fills up) without a special disk. Needs root, losetup and mkfs.ext4; skips otherwise.
    """
    import shutil
    import subprocess

    mounted: list[tuple[str, str]] = []

    def make(*, sector: int = 4096, size: str = "64M") -> str:
        if os.geteuid() != 0 or not shutil.which("losetup") or not shutil.which("mkfs.ext4"):
            pytest.skip("needs root, losetup and mkfs.ext4 for a loop-device file system")
        image = tmp_path / f"loop-{len(mounted)}.img"
        mountpoint = tmp_path / f"mnt-{len(mounted)}"
        mountpoint.mkdir()
        subprocess.run(["truncate", "-s", size, str(image)], check=True)
        try:
            dev = subprocess.run(["losetup", "-f", "--show", "--sector-size", str(sector), str(image)],
                                 check=True, capture_output=True, text=True).stdout.strip()
        except subprocess.CalledProcessError as err:
            pytest.skip(f"loop devices are not available here: {err.stderr.strip()}")
        try:
            subprocess.run(["mkfs.ext4", "-q", "-b", "4096", "-m", "0", dev], check=True, capture_output=True)
            subprocess.run(["mount", dev, str(mountpoint)], check=True, capture_output=True)
        except subprocess.CalledProcessError as err:
            subprocess.run(["losetup", "-d", dev])
            pytest.skip(f"could not make a loop file system: {err.stderr.strip()}")
        mounted.append((dev, str(mountpoint)))
        return str(mountpoint)

    yield make
    for dev, mountpoint in reversed(mounted):
        subprocess.run(["umount", mountpoint])
        subprocess.run(["losetup", "-d", dev])


@pytest.fixture
def as_nobody():
    """``as_nobody(body)``: see :func:`run_as_nobody_in_read_only_dir`."""
    return run_as_nobody_in_read_only_dir


def run_as_nobody_in_read_only_dir(body: str):
    """Root may write anywhere, so an unwritable directory is checked as uid 65534: a
    read-only directory ``ro`` under one that user can reach (pytest's tmp_path parents
    are private to root), and ``body`` (Python using ``ro``) run in a child process that
    imports offload as root and then drops privileges. Returns the CompletedProcess."""
    import subprocess
    import sys
    import tempfile
    import textwrap

    reachable = tempfile.mkdtemp(prefix="offload-test-")
    os.chmod(reachable, 0o755)
    ro = os.path.join(reachable, "ro")
    os.mkdir(ro, 0o555)
    code = f"import os, offload, torch\nfrom offload.store import create_store\nro = {ro!r}\n" \
        "os.setgid(65534); os.setuid(65534)\n" + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    finally:
        os.rmdir(ro)
        os.rmdir(reachable)
