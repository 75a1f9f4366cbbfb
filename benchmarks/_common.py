"""Measuring helpers shared by the benchmarks (scripts in this folder import it by path)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from offload._os import ram_file_system


class PeakRss:
    """Largest resident set over the ``with`` block (``peak``) and its growth over the RSS at
    entry (``growth``), sampled every 5 ms."""

    def start(self) -> "PeakRss":
        self.proc = psutil.Process()
        self.before = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling; returns the peak RSS in bytes."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.growth = self.peak - self.before
        return self.peak

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()


def disk_io_bytes() -> tuple[int, int]:
    """(read, written) block-device bytes of this process so far, all threads (/proc/self/io)."""
    fields = {}
    with open("/proc/self/io") as fh:
        for line in fh:
            k, v = line.split(":")
            fields[k] = int(v)
    return fields["read_bytes"], fields["write_bytes"]


def disk_bandwidth(path: str, size: int) -> dict:
    """The disk under ``path`` as ``offload-profile`` measures it, through its public API
    (``offload.profile.run_profile``, quick mode, report not cached so that io="auto" is
    unaffected): offload's file engine swept over block sizes and queue depths, O_DIRECT,
    on a test file of ``size`` bytes (at least 12 GiB, its default: smaller files make
    shorter passes that re-read their half of the file) that it removes. Returns
    ``read_gbps`` and ``write_gbps``: the profile's sustained figures (data not moved
    recently, after the first second's burst, median of its passes with the setting it
    chose, which is ``setting``), and its cached re-read and rewrite beside them
    (``cached_read_gbps``, ``cached_write_gbps``), which a benchmark must not divide by.
    Also measures host copies and the CPU AdamW step, which run_profile always does (a few
    seconds)."""
    from offload.profile import run_profile

    report = run_profile(path, max(size, 12 << 30), mode="quick", cache=False)  # the profile's default size
    return {"read_gbps": report["disk_read_gbps"], "write_gbps": report["disk_write_gbps"],
            "cached_read_gbps": report["disk_cached_read_gbps"], "cached_write_gbps": report["disk_cached_write_gbps"],
            "setting": report["engine_choice"]}


def evict_host_cache(directory: str, size: int = 12 << 30, chunk: int = 16 << 20, depth: int = 8) -> float:
    """Write ``size`` bytes of random data to a scratch file in ``directory``, read them
    back, O_DIRECT through offload's engine, and remove the file; returns the seconds it
    took. This machine's disk is virtual, and its host caches what was recently written
    or read: a file written a minute ago reads faster than one written days ago, so a
    mode that has just copied the weights would read them from that cache. Moving more
    data than the host keeps leaves other data in it. It does not make old and new data
    read alike: after 40 GiB of it, a file written minutes before still read 4-16% faster
    than one written hours before (docs/benchmarks.md, "How old the data is"). Every 4 KiB block written differs
    (a host that stores equal blocks once would keep little otherwise), and the guest's
    page cache is untouched where O_DIRECT is available."""
    import torch

    from offload.io import FileEngine, HostBuffer

    started = time.perf_counter()
    buffers = [HostBuffer(chunk) for _ in range(depth)]
    words = [b.view(torch.int64, (chunk // 8,)) for b in buffers]
    for i, w in enumerate(words):
        w.random_(generator=torch.Generator().manual_seed(i))
    path = os.path.join(directory, f".evict-{os.getpid()}")
    with FileEngine(name="evict") as engine:
        file = engine.open(path, create=True)
        try:
            for op in (engine.write, engine.read):
                for base in range(0, size, chunk * depth):
                    offsets = range(base, min(base + chunk * depth, size), chunk)
                    if op == engine.write:
                        for w in words:
                            w[::512].add_(1)  # (one word of each 4 KiB block: no two blocks written alike)
                    for handle in [op(file, at, buffer) for at, buffer in zip(offsets, buffers)]:
                        handle.wait()
        finally:
            engine.close_file(file)
            os.unlink(path)
    return time.perf_counter() - started


def profile_cli(path: str, size: str, report: str, *extra: str) -> tuple[float, dict, str]:
    """``offload-profile --quick`` on ``path`` in a subprocess, its report written to
    ``report``: (wall-clock seconds, the report, the printed table). Raises with its stderr
    if it fails."""
    import sys

    cmd = [sys.executable, "-m", "offload.profile", "--no-progress", "--path", path, "--size", size, "--quick",
           "--json", report, *extra]
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"offload-profile failed:\n{out.stderr}")
    with open(report) as fh:
        return wall, json.load(fh), out.stdout


def gpt2_config(shape: tuple[int, int, int]):
    """A GPT-2 config of ``shape`` (layers, hidden, heads): vocabulary 50257, 1024 positions."""
    import transformers

    layers, hidden, heads = shape
    return transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=50257,
                                   n_positions=1024)


def saved_gpt2(root: str, name: str, shape: tuple[int, int, int]) -> str:
    """``root/gpt2-NAME``: the model of ``shape`` with random weights (seed 0, transformers'
    init) saved as safetensors, built once and kept for re-runs."""
    import torch
    import transformers

    path = os.path.join(root, f"gpt2-{name}")
    if not os.path.exists(os.path.join(path, "config.json")):
        logging.getLogger("bench").info("building and saving the %s model in %s (once)", name, path)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(gpt2_config(shape))
        model.save_pretrained(path, max_shard_size="2GB")
        del model
    return path


def run_json_worker(cmd: list[str], what: str, env: dict | None = None) -> dict | None:
    """Run a benchmark worker process (``env``: its environment, default this one's); its
    last stdout line is its JSON result. A failed worker is logged with the end of its
    stderr and gives None."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        logging.getLogger("bench").warning("%s worker failed (exit %d):\n%s", what, out.returncode,
                                           out.stderr[-3000:])
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def start(args, name: str) -> None:
    """What a benchmark's main does first: log lines with times, offload's own below
    warnings, and ``args.path`` made absolute (default :func:`scratch_dir` ``(name)``) and
    created."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("offload").setLevel(logging.WARNING)
    args.path = scratch_dir(name, args.path)


SCRATCH_HELP = ("$OFFLOAD_BENCH_DIR/{name}, else offload-bench/{name} in the temporary directory (/var/tmp "
                "where that is in RAM)")  # for --help: a benchmark's default scratch directory


def scratch_dir(name: str, given: str | None = None) -> str:
    """The directory a benchmark writes into, made absolute and created: ``given`` (its
    --path flag), or ``name`` under ``$OFFLOAD_BENCH_DIR``, by default under
    ``offload-bench`` in the temporary directory (``tempfile.gettempdir()``; ``/var/tmp``
    where that is a file system held in RAM): never the work tree. Warns when the directory
    is in RAM (tmpfs, ramfs), where disk figures would measure memory."""
    if given:
        path = given
    elif os.environ.get("OFFLOAD_BENCH_DIR"):
        path = os.path.join(os.environ["OFFLOAD_BENCH_DIR"], name)
    else:
        temp = tempfile.gettempdir()
        if ram_file_system(temp) is not None:
            temp = "/var/tmp"
        path = os.path.join(temp, "offload-bench", name)
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    in_ram = ram_file_system(path)
    if in_ram is not None:
        logging.getLogger("bench").warning("%s is on %s (files held in RAM, not on a disk): disk figures will "
                                           "measure memory; pass --path on a local disk or set OFFLOAD_BENCH_DIR",
                                           path, in_ram)
    return path


class Balloon:
    """Hold all available RAM but ``reserve`` bytes in another process, locked.

    What stays free is ``reserve`` beyond what the processes running already hold: room for
    a run's own memory, too little for the page cache to keep a model of several GB.
    """

    def __init__(self, reserve: int):
        self.reserve, self.proc = reserve, None

    def __enter__(self):
        import psutil

        size = psutil.virtual_memory().available - self.reserve
        if size <= 0:
            return self
        code = ("import mmap,ctypes,sys,time\n"
                f"m=mmap.mmap(-1,{size},flags=mmap.MAP_PRIVATE|mmap.MAP_ANONYMOUS|getattr(mmap,'MAP_POPULATE',0))\n"
                "a=ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
                f"locked=ctypes.CDLL(None,use_errno=True).mlock(ctypes.c_void_p(a),ctypes.c_size_t({size}))==0\n"
                "print('locked' if locked else 'populated',flush=True)\n"
                "time.sleep(3600)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        self.state = self.proc.stdout.readline().strip()
        logging.getLogger("bench").info("balloon: holding %.1f GiB of RAM (%s); %.2f GiB left free for this run and the page cache",
                 size / 2**30, self.state, self.reserve / 2**30)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
    except OSError:
        logging.getLogger("bench").warning("could not drop the page cache (not root); the balloon alone keeps it small")
