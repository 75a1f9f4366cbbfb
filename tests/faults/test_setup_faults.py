"""Faults found before or while a run starts: budgets too small, a bad ``nvme_path``, two
processes on one directory, invalid configs, and a model whose execution order changes at
every step (which must keep working). Refusals happen before anything is allocated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

import offload
from offload.io import BudgetError
from offload.store import DirectoryLockedError

pytestmark = pytest.mark.timeout(180)


def _rss() -> int:
    return psutil.Process().memory_info().rss


# -- budgets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, match", [
    (dict(device_budget="16KiB"),
     r"device_budget 16.00 KiB cannot hold .*parameter group '.*' \(.*\).*set device_budget >= "),
    (dict(param_tier="host", host_budget="64KiB"),
     r"param_tier='host' needs .* of host memory but host_budget is 64.00 KiB: raise host_budget or "
     r"set param_tier='nvme'"),
], ids=["device_budget", "host_budget"])
def test_budget_too_small_for_the_largest_group_is_refused_before_allocating(tmp_path, settings, match, tiny_gpt2,
                                                                             offload_config, batches, no_leaks):
    model = tiny_gpt2()
    before = _rss()
    with pytest.raises(BudgetError, match=match):
        offload.wrap(model, offload_config(tmp_path, **settings))
    assert _rss() - before < 8 << 20  # nothing of the model's size was allocated
    assert not os.path.exists(tmp_path / "nvme")  # no directory, no swap file
    # the model is untouched and not wrapped: it still runs as a plain module
    model(input_ids=batches(1)[0])


def test_host_budget_too_small_for_an_optimizer_shard_is_refused(tmp_path, tiny_gpt2, offload_config, assert_released,
                                                                 no_leaks):
    model = offload.wrap(tiny_gpt2(), offload_config(tmp_path, host_budget="256KiB"))
    try:
        with pytest.raises(BudgetError, match=r"optimizer states need .* host_budget is 256.00 KiB: raise "
                                              r"host_budget or pass a smaller shard_size"):
            offload.AdamW(model.parameters(), lr=1e-3, shard_size=1 << 20)
    finally:
        offload.close(model)
    assert_released(tmp_path / "nvme")


# -- nvme_path -------------------------------------------------------------------------------------
@pytest.mark.parametrize("problem", ["missing", "file", "unwritable"])
def test_bad_nvme_path_is_refused_naming_it_and_the_fix(tmp_path, problem, as_nobody, tiny_gpt2, offload_config,
                                                        batches, no_leaks):
    if problem == "missing":
        path, error, match = tmp_path / "no" / "such" / "dir", FileNotFoundError, "does not exist"
    elif problem == "file":
        path, error, match = tmp_path / "a_file", NotADirectoryError, "is a file, not a directory"
        path.write_text("")
    else:
        if os.geteuid() == 0:
            _unwritable_as_nobody(as_nobody)
            return
        path, error, match = tmp_path / "ro", PermissionError, "not writable"
        path.mkdir(mode=0o500)
    model = tiny_gpt2()
    with pytest.raises(error, match=rf"nvme_path '{path}' {match}.*point nvme_path at a writable directory"):
        offload.wrap(model, offload_config(tmp_path, nvme_path=str(path)))
    model(input_ids=batches(1)[0])  # untouched


def _unwritable_as_nobody(as_nobody) -> None:
    """As root everything is writable: check as an unprivileged user in a child process."""
    out = as_nobody("""
        cfg = offload.OffloadConfig(device="cpu", nvme_path=ro, io="manual")
        offload.wrap(torch.nn.Linear(512, 512), cfg)
    """)
    assert out.returncode != 0, out.stderr[-2000:]
    assert "PermissionError" in out.stderr and "not writable" in out.stderr, out.stderr[-2000:]


def test_second_process_on_the_same_nvme_path_is_refused_naming_the_holder(tmp_path, tiny_gpt2, offload_config,
                                                                           assert_released, no_leaks):
    """Another process runs on the directory; ours is refused before it touches the files,
    and the other process's run is not disturbed."""
    nvme = tmp_path / "nvme"
    code = textwrap.dedent(f"""
        import sys, time, torch, offload
        cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="nvme",
                                    nvme_path={str(nvme)!r}, device_budget="1MiB", host_budget="64MiB",
                                    resident_bytes=0, file_size="4MiB", io="manual")
        torch.manual_seed(0)
        model = offload.wrap(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)), cfg)
        print("ready", flush=True)
        sys.stdin.readline()  # hold the directory until told
        with torch.no_grad():
            print(float(model(torch.ones(1, 256)).sum()), flush=True)
        offload.close(model)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        swap = sorted(os.listdir(nvme))
        model = tiny_gpt2()
        with pytest.raises(DirectoryLockedError, match=rf"nvme_path '{nvme}' is in use by process {child.pid} "
                                                       r"on .*: give each process .* its own nvme_path"):
            offload.wrap(model, offload_config(tmp_path))
        assert sorted(os.listdir(nvme)) == swap  # the other run's files are untouched
        out, _ = child.communicate("go\n", timeout=120)
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        with torch.no_grad():
            expected = float(ref(torch.ones(1, 256)).sum())
        assert float(out.strip()) == pytest.approx(expected, rel=1e-6)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0
    assert_released(nvme)


# -- configs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, match", [
    (dict(host_budget=-1), r"host_budget=-1 must be > 0"),
    (dict(device_budget="-3GiB"), r"device_budget='-3GiB' is not a size"),
    (dict(host_budget="lots"), r"host_budget='lots' is not a size"),
    (dict(file_size="1.5.GiB"), r"file_size='1.5.GiB' is not a size"),
    (dict(param_tier="ssd"), r"param_tier='ssd' is not a tier: use one of \['device', 'host', 'nvme'\]"),
    (dict(optimizer_tier="device"), r"optimizer_tier='device' is not a tier: use one of \['host', 'nvme'\]"),
    (dict(device="tpu"), r"device='tpu' is not"),
    (dict(param_tier="nvme", nvme_path=None), r"nvme_path is required"),
    (dict(io="fast"), r"io='fast'"),
    (dict(queue_depth=0), r"queue_depth"),
], ids=["negative", "negative-string", "unparsable", "two-dots", "tier", "optimizer-tier", "device",
        "no-nvme-path", "io", "queue-depth"])
def test_invalid_settings_are_refused_naming_the_setting(tmp_path, settings, match, offload_config):
    with pytest.raises(ValueError, match=match):
        offload_config(tmp_path, **settings)


@pytest.mark.parametrize("text, match", [
    (json.dumps({"device": "cpu", "host_budgt": "1GiB"}), r"unknown keys \['host_budgt'\]: the known keys are"),
    ("{device: cpu", r"is not valid JSON: .* at line 1 column 2"),
    ("[1, 2]", r"must hold a mapping of settings, got list"),
    (json.dumps({"device": "cpu", "param_tier": "host", "optimizer_tier": "host", "host_budget": "x"}),
     r"host_budget='x' is not a size"),
], ids=["unknown-key", "not-json", "not-a-mapping", "bad-value"])
def test_invalid_config_files_are_refused_naming_the_file(tmp_path, text, match):
    path = tmp_path / "offload.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        offload.OffloadConfig.from_file(str(path))
    with pytest.raises(ValueError, match=r"cannot read config file .*missing.json"):
        offload.OffloadConfig.from_file(str(tmp_path / "missing.json"))


# -- a model whose execution order changes at every step ---------------------------------------------
class Shuffled(torch.nn.Module):
    """Blocks run in a different order, and a different subset, at every step: the
    recorded order is never right, so every pass fetches on demand."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        self.head = torch.nn.Linear(64, 4)
        self.order: list[int] = list(range(6))

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return self.head(x)


def _orders(steps: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randperm(6, generator=g)[: 3 + s % 4].tolist() for s in range(steps)]


def test_trace_that_changes_every_step_keeps_working(tmp_path, offload_config, assert_weights, close_all,
                                                     assert_released, no_leaks):
    steps = 6
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    ref = Shuffled()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    model = offload.wrap(Shuffled(), offload_config(tmp_path, device_budget="64KiB", resident_bytes=0))
    opt = offload.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    try:
        for order in _orders(steps):
            ref.order = model.order = order
            for m, o in ((ref, ref_opt), (model, opt)):
                loss = m(x).square().mean()
                loss.backward()
                o.step()
                o.zero_grad()
            with torch.no_grad():
                torch.testing.assert_close(model(x), ref(x))
        assert_weights(model, {k: v.detach() for k, v in ref.state_dict().items()})
        s = offload.stats(model)
        assert s["prefetch_misses"] > 0 and s["device_peak_bytes"] <= 64 << 10
    finally:
        close_all(model, opt)
    assert_released(tmp_path / "nvme")
