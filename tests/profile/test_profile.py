"""offload-profile: a real run and its report, the recommendation, and OffloadConfig(io="auto")
reading the cached profile (the command line's refusals and cleanup: test_cli.py)."""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import offload
from offload._resolve import choose_io_backend, resolve_engine
from offload.profile import CACHE_NAME, find_profile, recommend
from offload.profile._run import REPORT_VERSION

KEYS = ("disk_read_gbps", "disk_write_gbps", "disk_best_read", "disk_best_write", "host_copy_gbps",
        "adam_params_per_s", "h2d_pinned_gbps", "d2h_pinned_gbps")


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload.profile", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)


def leftover_files(directory) -> list[str]:
    return glob.glob(os.path.join(str(directory), ".offload-profile-*"))


# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One real quick run on a small file: (directory, report, stdout, recommended config)."""
    base = tmp_path_factory.mktemp("profile")
    target = base / "disk"
    target.mkdir()
    report, rec = base / "r.json", base / "c.json"
    out = cli("--path", str(target), "--size", "64MiB", "--quick", "--json", str(report),
              "--recommend", str(rec), "--validate", "64MiB")
    assert out.returncode == 0, out.stderr
    return target, json.loads(report.read_text()), out.stdout, rec


def test_report_has_the_keys_and_sane_figures(profiled):
    target, report, _, _ = profiled
    for key in KEYS:
        assert key in report, key
    for key in ("disk_best_read", "disk_best_write"):
        best = report[key]
        assert {"block_size", "queue_depth", "threads", "direct"} <= set(best)
        assert best["block_size"] % 4096 == 0 and best["queue_depth"] >= 1 and best["threads"] >= 1
    if not torch.cuda.is_available():
        assert report["h2d_pinned_gbps"] is None and report["d2h_pinned_gbps"] is None
    assert report["disk_read_gbps"] > 0 and report["disk_write_gbps"] > 0
    assert report["host_copy_gbps"] > 0 and report["adam_params_per_s"] > 0
    # every swept setting was measured both ways, and the best is the max of the sweep
    sweep = report["disk_sweep"]
    reads = [r["gbps"] for r in sweep if r["op"] == "read" and r["direct"] == report["disk_best_read"]["direct"]]
    assert max(reads) == pytest.approx(report["disk_best_read"]["gbps"], rel=1e-3)
    assert {(r["block_size"], r["queue_depth"]) for r in sweep if r["op"] == "write"} == \
           {(r["block_size"], r["queue_depth"]) for r in sweep if r["op"] == "read"}
    assert report["path"] == str(target)
    assert not leftover_files(target), "the test file was left behind"
    # the runtime reads and writes with O_DIRECT: where the disk takes it, the best figures
    # and the engine's setting are O_DIRECT ones
    direct = report["disk_direct_supported"]
    assert report["disk_best_read"]["direct"] is direct and report["disk_best_write"]["direct"] is direct
    assert report["engine_choice"]["direct"] is direct
    _assert_engine_choice_is_the_best_of_both_ways(report["engine_choice"], sweep, direct)


def test_recommended_figures_are_the_sustained_passes_with_their_spread(profiled):
    """disk_read_gbps / disk_write_gbps are the medians of the sustained passes, not the
    sweep's best; the cached figures are there beside them, and the report says which the
    recommendation used."""
    _, report, stdout, _ = profiled
    for op in ("read", "write"):
        spread = report[f"disk_{op}_spread"]
        assert len(spread["runs"]) == 3 and spread["min"] <= spread["median"] <= spread["max"]
        assert report[f"disk_{op}_gbps"] == pytest.approx(spread["median"], abs=1e-4)
        assert report[f"disk_cached_{op}_gbps"] > 0
    assert report["disk_figures_used"].startswith("sustained figures: the median of 3 reads of ")
    assert f"disk figures used below: read {report['disk_read_gbps']:.2f}" in stdout
    assert "a cache's best case; not recommended on" in stdout and "recommended on:" in stdout


def test_validate_reports_the_store_against_the_profile(profiled):
    target, report, stdout, _ = profiled
    v = report["validation"]
    assert v["bytes"] == 64 << 20 and v["tensor_bytes"] == 32 << 20
    for phase in ("first_write", "write", "read"):
        assert v[f"{phase}_gbps"] > 0
        assert v[f"{phase}_predicted_gbps"] == pytest.approx(report[f"disk_{phase}_gbps"], abs=1e-4)
        assert v[f"{phase}_ratio"] == pytest.approx(v[f"{phase}_predicted_gbps"] / v[f"{phase}_gbps"], rel=1e-3)
    assert "predicted/achieved" in stdout
    assert not leftover_files(target)


def test_no_measurement_moves_bytes_moved_recently(tmp_path, monkeypatch):
    """Through run_profile's whole sequence (sweep, retries, deadlines, sustained passes,
    cached pairs, buffered and mmap rows): reads stay in the first half of the test file,
    writes in the second, every stretch is whole 32 MiB, and a stretch is read again only
    after half the file of other reads; the one exception, on purpose, is the timed half
    of a cached pair (and the warm mmap read)."""
    from offload.profile import _links
    from offload.profile._disk import DiskProbe, DiskResult

    size, grain, moves = 512 << 20, 32 << 20, []

    def fake_measure(self, op, setting, nbytes, start, *, record=True, deadline=None):
        if deadline is not None and len(moves) % 5 == 0:  # some sweep measurements stop early
            nbytes = grain
        moves.append((op, start, nbytes))
        marks = ((0.5, nbytes // 2), (1.0, nbytes)) if nbytes else ()
        result = DiskResult(op, setting, nbytes, 1.0 + len(moves) % 7 / 10, start=start, marks=marks)
        if record:
            self.results.append(result)
        return result

    def fake_copy(view, mm, buf, stretches, op, *rest):
        moves.append((f"mmap_{op}", stretches[0][0], sum(n for _, n in stretches)))

    monkeypatch.setattr(DiskProbe, "_measure", fake_measure)
    monkeypatch.setattr(DiskProbe, "_copy_mapped", staticmethod(fake_copy))
    monkeypatch.setattr(_links, "host_copy", lambda n: {"host_copy_gbps": 1.0, "bytes": n, "threads": 1})
    monkeypatch.setattr(_links, "adam_throughput", lambda n: {"adam_params_per_s": 1.0, "threads": 1, "params": n})
    offload.profile.run_profile(str(tmp_path), size, cache=False)
    half, last_read = size // 2, {}
    read_bytes = 0  # bytes read so far, cached pairs and warm mmap reads aside
    for i, (op, start, nbytes) in enumerate(moves):
        assert start % grain == 0 and nbytes % grain == 0 and nbytes > 0, (op, start, nbytes)
        if op == "first_write":
            assert (start, nbytes) == (0, size)
            continue
        reading = "read" in op
        region = (0, half) if reading else (half, size)
        chunks = [region[0] + (start - region[0] + k) % half for k in range(0, nbytes, grain)]
        assert all(region[0] <= c < region[1] for c in chunks), (op, start, nbytes)
        if op == "read" and moves[i + 1][:2] == ("cached_read", start):
            continue  # the untimed first half of a cached pair
        if reading and op not in ("cached_read", "mmap_read") or (op == "mmap_read" and
                                                                  moves[i + 1][:2] != ("mmap_read", start)):
            for c in chunks:
                assert read_bytes - last_read.get(c, -half) >= half - nbytes, (op, start, nbytes)
                last_read[c] = read_bytes
            read_bytes += nbytes


def test_a_slow_sweep_setting_stops_at_its_deadline(tmp_path):
    """A sweep measurement submits nothing more after three times its share of time and
    counts what it moved; the next measurement starts right after it."""
    from offload.profile._disk import DiskProbe, DiskSetting

    setting = DiskSetting(1 << 20, 1, 1)  # 32 MiB requests (the buffer), one 1 MiB block at a time
    with DiskProbe(str(tmp_path), 512 << 20, time_per_measurement=1e-4, buffer_bytes=32 << 20) as probe:
        probe.measure_bytes = probe.size
        first = probe.measure("read", setting)
        second = probe.measure("read", setting)
    assert first.nbytes == 64 << 20  # the two requests in flight when the deadline passed
    assert second.start == first.nbytes


def test_burst_and_sustained_split_at_the_first_second():
    from offload.profile._disk import DiskResult, DiskSetting

    gb = 10**9
    # 5 GB/s for the first second, then 2 GB/s for two more
    fast_then_slow = DiskResult("write", DiskSetting(1 << 20, 1, 1), 9 * gb, 3.0,
                                marks=((0.5, int(2.5 * gb)), (1.0, 5 * gb), (2.0, 7 * gb), (3.0, 9 * gb)))
    assert fast_then_slow.burst_gbps() == pytest.approx(5.0)
    assert fast_then_slow.sustained_gbps() == pytest.approx(2.0)
    assert fast_then_slow.gbps == pytest.approx(3.0)
    short = DiskResult("read", DiskSetting(1 << 20, 1, 1), gb, 0.5, marks=((0.5, gb),))
    assert short.burst_gbps() is None and short.sustained_gbps() == pytest.approx(2.0)


def _assert_engine_choice_is_the_best_of_both_ways(choice: dict, sweep: list[dict], direct: bool) -> None:
    """The engine's setting is the one with the best read and write together (the largest
    product of the two, each a setting's fastest measurement in the sweep), and carries
    that setting's own figures. (The sweep's figures are rounded to 0.1 MB/s.)"""
    fastest: dict[str, dict[tuple, float]] = {"read": {}, "write": {}}
    for row in sweep:
        if row["op"] in fastest and row["direct"] is direct:
            setting = (row["block_size"], row["queue_depth"], row["threads"])
            fastest[row["op"]][setting] = max(fastest[row["op"]].get(setting, 0.0), row["gbps"])
    both = fastest["read"].keys() & fastest["write"].keys()
    best = max(fastest["read"][s] * fastest["write"][s] for s in both)
    rounding = 1e-4 * (max(fastest["read"].values()) + max(fastest["write"].values()))
    chosen = (choice["block_size"], choice["queue_depth"], choice["threads"])
    assert chosen in both, chosen
    assert fastest["read"][chosen] * fastest["write"][chosen] == pytest.approx(best, rel=1e-3, abs=rounding), \
        (chosen, fastest)
    assert choice["read_gbps"] == pytest.approx(fastest["read"][chosen], abs=1e-4)
    assert choice["write_gbps"] == pytest.approx(fastest["write"][chosen], abs=1e-4)


def test_table_has_a_row_per_link(profiled):
    _, _, stdout, _ = profiled
    for row in ("disk read", "disk write", "disk first write", "host memory copy", "CPU AdamW step"):
        assert row in stdout, row
    assert "GB/s" in stdout and "G params/s" in stdout
    assert "recommended configuration" in stdout
    for field in ("block_size", "host_budget", "device_budget", "prefetch_bytes", "param_tier",
                  "optimizer_tier"):
        assert f"  - {field}" in stdout, field


def test_recommendation_loads_and_io_auto_reads_the_cache(profiled):
    target, report, _, rec = profiled
    # what the command writes: the engine's settings, budgets, prefetch and tiers (both on
    # NVMe without --model-bytes), nothing left to a default
    assert json.loads(rec.read_text()).keys() == {
        "device", "nvme_path", "block_size", "queue_depth", "io_threads", "host_budget", "device_budget",
        "prefetch_bytes", "param_tier", "optimizer_tier"}
    cfg = offload.OffloadConfig.from_file(str(rec))
    choice = report["engine_choice"]
    assert (cfg.block_size, cfg.queue_depth, cfg.io_threads) == (
        choice["block_size"], choice["queue_depth"], choice["threads"])
    assert cfg.nvme_path == str(target)
    # the cache written next to the data is what io="auto" reads, for the path and below it
    assert os.path.isfile(target / CACHE_NAME)
    auto = resolve_engine(offload.OffloadConfig(device="cpu", nvme_path=str(target / "run1" / "x")))
    assert auto.source == str(target / CACHE_NAME)
    assert (auto.block_size, auto.queue_depth, auto.threads) == (
        choice["block_size"], choice["queue_depth"], choice["threads"])


# ---------------------------------------------------------------------------------------
def fake_report(path, **over) -> dict:
    """A synthetic report (fake figures) for recommend() and io='auto' tests."""
    sweep = []
    for bs, qd, gbps in ((1 << 20, 4, 1.0), (4 << 20, 8, 2.4), (8 << 20, 32, 2.5), (16 << 20, 32, 2.45)):
        for op in ("read", "write"):
            sweep.append({"op": op, "block_size": bs, "queue_depth": qd, "threads": qd, "direct": True,
                          "bytes": 1 << 30, "seconds": 0.4, "gbps": gbps})
    report = {
        "version": REPORT_VERSION, "path": str(path), "fs_device": os.stat(path).st_dev, "device": "cpu",
        "disk_read_gbps": 1.9, "disk_write_gbps": 2.1, "disk_sweep": sweep,
        "disk_read_spread": {"min": 1.8, "median": 1.9, "max": 2.0, "runs": [1.8, 1.9, 2.0], "split": True,
                              "pass_bytes": 2 << 30},
        "disk_write_spread": {"min": 2.0, "median": 2.1, "max": 2.3, "runs": [2.0, 2.1, 2.3], "split": False,
                              "pass_bytes": 2 << 30},
        "disk_cached_read_gbps": 3.7, "disk_cached_write_gbps": 8.0, "disk_burst_seconds": 1.0,
        "disk_read_burst_gbps": None, "disk_write_burst_gbps": 4.9, "disk_figures_used": "the sustained passes",
        "disk_best_read": {"block_size": 8 << 20, "queue_depth": 32, "threads": 32, "direct": True, "gbps": 2.5},
        "disk_best_write": {"block_size": 8 << 20, "queue_depth": 32, "threads": 32, "direct": True, "gbps": 2.5},
        "engine_choice": {"block_size": 4 << 20, "queue_depth": 8, "threads": 12, "direct": True,
                          "read_gbps": 2.4, "write_gbps": 2.4},
        "host": {"ram_available_bytes": 16 << 30}, "cuda_free_bytes": None,
    }
    report.update(over)
    return report


def write_cache(directory, report) -> str:
    path = os.path.join(str(directory), CACHE_NAME)
    with open(path, "w") as fh:
        json.dump(report, fh)
    return path


def test_recommend_tiers_follow_the_model_size(tmp_path):
    report = fake_report(tmp_path)
    small, reasons = recommend(report, model_bytes=256 << 20)  # fits half the device budget
    assert small["param_tier"] == "device" and small["optimizer_tier"] == "host"
    assert small["nvme_path"] is None  # no tier on disk: no path needed
    assert len(reasons) == 7 and all(isinstance(r, str) and r for r in reasons)
    assert any(r.startswith("disk figures used below: read 1.90, write 2.10 GB/s (spread 1.80-2.00 and 2.00-2.30)")
               and "the sustained passes" in r for r in reasons)
    middle, _ = recommend(report, model_bytes=5 << 29)  # 2.5 GiB: above half the 4 GiB device budget,
    # below half the 5.5 GiB host budget (CPU: 25% and 35% of the 16 GiB free)
    assert middle["param_tier"] == "host" and middle["optimizer_tier"] == "nvme"
    big, reasons = recommend(report, model_bytes=14 << 30, dtype="bf16")
    assert big["param_tier"] == "nvme" and big["optimizer_tier"] == "nvme"
    assert any("per step on this disk" in r for r in reasons)
    default, _ = recommend(report)
    assert default["param_tier"] == default["optimizer_tier"] == "nvme"
    for cfg in (small, middle, big, default):
        path = tmp_path / "c.json"
        path.write_text(json.dumps(cfg))
        loaded = offload.OffloadConfig.from_file(str(path))
        assert loaded.block_size == 4 << 20 and loaded.queue_depth == 8 and loaded.io_threads == 12
        assert loaded.host_budget <= report["host"]["ram_available_bytes"]


def test_recommend_reasons_read_as_sentences(tmp_path):
    # a parameter count in words ("0.27 B" read as bytes) and a predicate for each tier
    expected = {1 << 30: "param_tier device: the model's parameters (1.00 GiB: 268.4 million in fp32) fit in half "
                         "the device budget (2.00 GiB)",
                5 << 29: "param_tier host: the model's parameters (2.50 GiB: 671.1 million in fp32) take more than "
                         "half the device budget (2.00 GiB) and fit in half the host budget (2.75 GiB)",
                14 << 30: "param_tier nvme: the model's parameters (14.00 GiB: 3.76 billion in fp32) take more than "
                          "half the host budget (2.75 GiB)"}
    for model_bytes, reason in expected.items():
        _, reasons = recommend(fake_report(tmp_path), model_bytes=model_bytes)
        assert reason in reasons
        assert not any("the the " in r for r in reasons)


def test_recommend_prefetch_is_the_smallest_window_that_reads_at_speed(tmp_path):
    cfg, reasons = recommend(fake_report(tmp_path))
    # 4 MiB x 8 reached 2.4 of the best 2.5 GB/s (>= 90%): twice its 32 MiB in flight
    assert offload.parse_size(cfg["prefetch_bytes"]) == 64 << 20
    assert any(r.startswith("prefetch_bytes 64.00 MiB") for r in reasons)


def test_io_auto_uses_a_cached_profile_and_keeps_given_values(tmp_path, caplog):
    cache = write_cache(tmp_path, fake_report(tmp_path))
    auto = resolve_engine(offload.OffloadConfig(device="cpu", nvme_path=str(tmp_path / "sub")))
    assert (auto.block_size, auto.queue_depth, auto.threads, auto.source) == (4 << 20, 8, 12, cache)
    mixed_config = offload.OffloadConfig(device="cpu", nvme_path=str(tmp_path), block_size="1MiB")
    mixed = resolve_engine(mixed_config)
    assert (mixed.block_size, mixed.queue_depth, mixed.threads) == (1 << 20, 8, 12)
    manual = resolve_engine(offload.OffloadConfig(device="cpu", nvme_path=str(tmp_path), io="manual"))
    assert (manual.block_size, manual.queue_depth, manual.threads, manual.source) == (
        8 << 20, 32, 32, "built-in")
    given = resolve_engine(offload.OffloadConfig(device="cpu", nvme_path=str(tmp_path), block_size=4096,
                                                 io_threads=2, queue_depth=2))
    assert given.source == "given"
    # a config that needs no disk reads no profile
    host_only = resolve_engine(offload.OffloadConfig(device="cpu", param_tier="host", optimizer_tier="host"))
    assert host_only.source == "built-in"
    # replace() resolves again for a new path; values given stay given
    elsewhere = tmp_path.parent / f"{tmp_path.name}-other"
    elsewhere.mkdir()
    moved = resolve_engine(mixed_config.replace(nvme_path=str(elsewhere)))
    assert (moved.block_size, moved.queue_depth, moved.source) == (1 << 20, 32, "built-in")
    with pytest.raises(ValueError, match="io='sometimes' is not an I/O mode"):
        offload.OffloadConfig(device="cpu", nvme_path=str(tmp_path), io="sometimes")


BAD_VALUES = {"zero block": ("engine_choice", "block_size", 0), "many threads": ("engine_choice", "threads", 100000),
              "depth as text": ("engine_choice", "queue_depth", "32"), "no read figure": (None, "disk_read_gbps", None),
              "mmap a list": (None, "disk_mmap", [1]), "warm read as text": ("disk_mmap", "warm_read_gbps", "fast")}


@pytest.mark.parametrize("damage", ["not json", "old version", "other disk", "no choice", "a list", *BAD_VALUES])
def test_io_auto_skips_a_bad_cache_with_a_warning(tmp_path, caplog, damage):
    """(Values the library cannot use were taken: a zero block size failed wrap with a message
    not naming the file, 100000 threads leaked the ones started, a missing figure raised.)"""
    report = fake_report(tmp_path)
    path = os.path.join(str(tmp_path), CACHE_NAME)
    if damage == "not json":
        with open(path, "w") as fh:
            fh.write("{ half a file")
    elif damage == "a list":
        write_cache(tmp_path, [report])
    elif damage in BAD_VALUES:
        where, key, value = BAD_VALUES[damage]
        target = report if where is None else report.setdefault(where, {})
        if value is None:
            del target[key]
        else:
            target[key] = value
        write_cache(tmp_path, report)
        with caplog.at_level(logging.WARNING, logger="offload"):
            choice = choose_io_backend(offload.OffloadConfig(device="cpu", nvme_path=str(tmp_path)), 1 << 20)
        assert choice.backend == "direct"
    else:
        if damage == "old version":
            report["version"] = 0
        elif damage == "other disk":
            report["fs_device"] = report["fs_device"] + 1
        else:
            del report["engine_choice"]
        write_cache(tmp_path, report)
    with caplog.at_level(logging.WARNING, logger="offload"):
        cfg = resolve_engine(offload.OffloadConfig(device="cpu", nvme_path=str(tmp_path)))
    assert cfg.source == "built-in" and cfg.block_size == 8 << 20
    assert f"ignoring the cached profile {path}" in caplog.text
    assert "re-run offload-profile" in caplog.text


def test_find_profile_walks_up_to_the_nearest_cache(tmp_path):
    before = find_profile(str(tmp_path / "a" / "b"))  # None, unless someone profiled a parent of /tmp
    assert before is None or not before[0].startswith(str(tmp_path))
    write_cache(tmp_path, fake_report(tmp_path))
    (tmp_path / "a").mkdir()
    found = find_profile(str(tmp_path / "a" / "b"))  # b does not exist yet: its parents are searched
    assert found is not None and found[0] == os.path.join(str(tmp_path), CACHE_NAME)
    nearer = fake_report(tmp_path / "a", engine_choice={"block_size": 1 << 20, "queue_depth": 2,
                                                        "threads": 2, "direct": True})
    write_cache(tmp_path / "a", nearer)
    assert find_profile(str(tmp_path / "a" / "b"))[1]["engine_choice"]["block_size"] == 1 << 20


def test_wrapped_model_runs_with_the_engine_settings_of_the_profile(tmp_path, no_leaks):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=32)).eval()
    ref = copy.deepcopy(model)
    report = fake_report(tmp_path, engine_choice={"block_size": 64 << 10, "queue_depth": 3, "threads": 5,
                                                  "direct": True, "read_gbps": 1.0, "write_gbps": 1.0})
    write_cache(tmp_path, report)
    cfg = offload.OffloadConfig(device="cpu", param_tier="nvme", optimizer_tier="host",
                                nvme_path=str(tmp_path / "swap"), device_budget="1MiB", host_budget="16MiB",
                                resident_bytes=0)
    model = offload.wrap(model, cfg)
    try:
        from offload.params import manager_of
        from offload.store import Tier

        engine = manager_of(model).store.tiers[Tier.NVME].engine
        assert (engine.block_size, engine.queue_depth, engine.threads) == (64 << 10, 3, 5)
        ids = torch.randint(0, 101, (2, 16))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits)
        assert offload.stats(model)["read_bytes"] > 0
    finally:
        offload.unwrap(model)


def test_a_smaller_run_does_not_replace_a_larger_cached_profile(tmp_path, caplog, monkeypatch):
    """(A quick check at --size 64MiB silently replaced a 2 GiB profile, and io="auto" took
    its settings, which the small file had capped.)"""
    from offload.profile import _run

    path = write_cache(tmp_path, fake_report(tmp_path, disk_bytes_per_measurement=1 << 30))
    small = fake_report(tmp_path, disk_bytes_per_measurement=32 << 20)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert _run._cache(small, path) is False
    assert "kept the cached profile" in caplog.text
    assert find_profile(str(tmp_path)).report["disk_bytes_per_measurement"] == 1 << 30
    assert _run._cache(fake_report(tmp_path, disk_bytes_per_measurement=2 << 30), path) is True
    assert find_profile(str(tmp_path)).report["disk_bytes_per_measurement"] == 2 << 30
