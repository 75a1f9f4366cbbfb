"""io_backend="mmap": the page cache it keeps, what auto chooses and why, and a wrapped
model trained through it against the same model in memory. (Every store test in
test_roundtrip, test_host_access and test_nvme runs against both backends too.)"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import offload
from offload._resolve import choose_io_backend
from offload.profile import CACHE_NAME
from offload.profile._run import REPORT_VERSION
from offload.store import MmapTier, Tier, create_store

MiB = 1 << 20


def _store(path, backend, host_budget="8MiB"):
    return create_store(device="cpu", device_budget="32MiB", host_budget=host_budget, nvme_path=str(path),
                        file_size="64MiB", io_backend=backend)


def test_pages_kept_on_purpose_stay_within_the_host_budget(disk_dir, no_leaks):
    with _store(disk_dir, "mmap") as store:
        assert isinstance(store.tiers[Tier.NVME], MmapTier)
        data = [torch.full((MiB // 4,), float(i)) for i in range(24)]  # 24 MiB through an 8 MiB budget
        for i, t in enumerate(data):
            store.put(f"t{i}", t, Tier.NVME)
        for i, t in enumerate(data):
            assert torch.equal(store.wait(f"t{i}", Tier.DEVICE), t)
            store.evict(f"t{i}", Tier.DEVICE)
        cached = store.stats()["nvme"]["page_cache_bytes"]
        assert 0 < cached <= 8 * MiB + MiB, cached  # (one extent of slack: the newest one)
        assert store.tiers[Tier.NVME].dropped_bytes >= 15 * MiB


def test_repeated_reads_are_served_from_the_page_cache(disk_dir, no_leaks):
    with _store(disk_dir, "mmap", host_budget="64MiB") as store:
        t = torch.randn(4 * MiB // 4)
        store.put("w", t, Tier.NVME)
        store.wait("w", Tier.NVME)
        store.tiers[Tier.NVME].sync()
        assert torch.equal(store.wait("w", Tier.DEVICE), t)
        assert store.stats()["nvme"]["page_cache_bytes"] >= 4 * MiB  # stays cached for the next pass


def test_direct_io_leaves_the_page_cache_alone(disk_dir, no_leaks):
    with _store(disk_dir, "direct") as store:
        for i in range(8):
            store.put(f"t{i}", torch.ones(MiB // 4), Tier.NVME)
        for i in range(8):
            store.wait(f"t{i}", Tier.DEVICE)
        assert store.stats()["nvme"]["page_cache_bytes"] < MiB


def test_a_demand_read_overtakes_queued_prefetches(disk_dir, no_leaks, monkeypatch):
    """One worker, held inside a first read: prefetches (priority 1) queue behind it, then a
    demand read (priority 0) arrives last and still runs first once the worker is free."""
    import threading

    store = create_store(device="cpu", device_budget="32MiB", host_budget="8MiB", nvme_path=disk_dir,
                         file_size="1MiB", threads=1, io_backend="mmap")
    with store:
        tier = store.tiers[Tier.NVME]
        slots = {name: tier.allocate(4096) for name in ("held", "p1", "p2", "p3", "demand")}
        tier.read_into(slots["held"], torch.empty(4096, dtype=torch.uint8), 4096).wait()  # maps the file
        entered, release = threading.Event(), threading.Event()
        check = tier._check_size

        def held_first(slot, *args, **kw):
            if slot is slots["held"]:
                entered.set()
                release.wait(30)
            return check(slot, *args, **kw)

        monkeypatch.setattr(tier, "_check_size", held_first)
        order, handles = [], []
        for name, priority in (("held", 1), ("p1", 1), ("p2", 1), ("p3", 1), ("demand", 0)):
            handles.append(tier.read_into(slots[name], torch.empty(4096, dtype=torch.uint8), 4096,
                                          priority=priority))
            handles[-1].add_done_callback(lambda _, name=name: order.append(name))
            if name == "held":
                assert entered.wait(30), "the worker never started the first read"
        release.set()
        for handle in handles:
            handle.wait(30)
        assert order == ["held", "demand", "p1", "p2", "p3"]
        for slot in slots.values():
            tier.free(slot)


def _profile(directory, *, warm, direct=2.5):
    report = {"version": REPORT_VERSION, "fs_device": os.stat(directory).st_dev, "disk_read_gbps": direct,
              "engine_choice": {"block_size": 8 << 20, "queue_depth": 32, "threads": 32},
              "disk_mmap": {"cold_read_gbps": 0.6, "warm_read_gbps": warm, "write_gbps": 1.5}}
    (directory / CACHE_NAME).write_text(json.dumps(report))


def _cfg(tmp_path, **kw):
    args = dict(device="cpu", param_tier="nvme", optimizer_tier="host", nvme_path=str(tmp_path / "nvme"),
                host_budget="1GiB", device_budget="64MiB")
    args.update(kw)
    return offload.OffloadConfig(**args)


def test_auto_chooses_by_measurement_and_budgets(tmp_path):
    cfg = _cfg(tmp_path)
    backend, reason = choose_io_backend(cfg, 100 * MiB)
    assert backend == "direct" and "no offload-profile measurement of mmap" in reason
    _profile(tmp_path, warm=9.0)
    backend, reason = choose_io_backend(cfg, 100 * MiB)
    assert backend == "mmap" and "fits in host_budget and free RAM" in reason and "9.00 GB/s" in reason
    backend, reason = choose_io_backend(cfg, 2 << 30)
    assert backend == "direct" and "larger than host_budget" in reason
    big = _cfg(tmp_path, host_budget="100TiB")
    backend, reason = choose_io_backend(big, 50 << 40)
    assert backend == "direct" and "larger than the RAM left free" in reason
    _profile(tmp_path, warm=2.0)
    backend, reason = choose_io_backend(cfg, 100 * MiB)
    assert backend == "direct" and "not faster than O_DIRECT" in reason
    assert choose_io_backend(_cfg(tmp_path, io_backend="mmap"), 1 << 50)[0] == "mmap"  # given: kept
    assert choose_io_backend(_cfg(tmp_path, io="manual"), 100 * MiB)[0] == "direct"  # no profile read


def test_auto_takes_mmap_where_o_direct_is_refused(tmp_path, monkeypatch):
    """No file system here refuses O_DIRECT (tmpfs accepts it since Linux 6.6): the probe's
    answer is replaced; the probe itself is checked on the real disk."""
    import offload._os as os_helpers
    import offload._resolve as resolve

    assert os_helpers.direct_io_supported(str(tmp_path / "nvme"))  # a real file, written O_DIRECT
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".offload-direct-probe")]
    monkeypatch.setattr(resolve, "direct_io_supported", lambda path: False)
    backend, reason = choose_io_backend(_cfg(tmp_path), MiB)
    assert backend == "mmap" and "refuses O_DIRECT" in reason


def test_bad_io_backend_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"io_backend='fast' is not an I/O backend: use one of \['auto', "
                                         r"'direct', 'mmap'\]"):
        _cfg(tmp_path, io_backend="fast")


@pytest.mark.parametrize("backend", ["mmap", "auto"])
def test_wrapped_training_through_mmap_matches_memory(tmp_path, backend, caplog, no_leaks):
    transformers = pytest.importorskip("transformers")
    _profile(tmp_path, warm=9.0)  # auto: the data fits and warm mmap measured faster

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))

    ids = [torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="offload"):
        model = offload.wrap(build(), _cfg(tmp_path, optimizer_tier="nvme", device_budget="256KiB",
                                           resident_bytes="4KiB", cache_bytes=0, io_backend=backend))
    assert any("io_backend mmap" in r.getMessage() for r in caplog.records)
    # a CPU device computes on views of the mapped files: no device copies of streamed groups
    assert offload.params.manager_of(model).coordinator.zero_copy
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    try:
        for x in ids:
            for m, o in ((ref, ref_opt), (model, opt)):
                loss = m(input_ids=x, labels=x).loss
                loss.backward()
                o.step()
                o.zero_grad()
        got = offload.state_dict(model)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(got[name], value, msg=name)
        s = offload.stats(model)
        assert s["read_bytes"] > 0 and s["page_cache_bytes"] > 0
    finally:
        opt.close()
        offload.unwrap(model)
    nvme = tmp_path / "nvme"
    assert not [f for f in (os.listdir(nvme) if nvme.exists() else []) if f.startswith("offload-")]


def test_optimizer_states_that_outgrow_an_mmap_store_warn(tmp_path, caplog, no_leaks):
    model = offload.wrap(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)),
                         _cfg(tmp_path, optimizer_tier="nvme", host_budget="4MiB", device_budget="2MiB",
                              resident_bytes=0, io_backend="mmap"))
    try:
        with caplog.at_level(logging.WARNING, logger="offload"):
            opt = offload.AdamW(model.parameters(), lr=1e-3)
        opt.close()
    finally:
        offload.close(model)
    assert any("beyond its page-cache limit" in r.getMessage() and "io_backend='direct'" in r.getMessage()
               for r in caplog.records)
