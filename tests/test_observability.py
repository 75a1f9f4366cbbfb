"""Step log (OffloadConfig.log_path), stats timings, and the Chrome trace of the timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import offload
from offload._trace import busy_seconds, overlap_seconds

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# this file's model and config: a 4-layer GPT-2, 256 wide, 1000 tokens, 128 positions,
# transformers' default dropout; swap files in "swap", 1 GiB each (OffloadConfig's default),
# an 8 MiB device budget, nothing kept resident
GPT2 = dict(n_layer=4, n_embd=256, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0, dropout=0.1)
TRACED = dict(swap="swap", device_budget="8MiB", resident_bytes=0, file_size="1GiB")


def train(model, steps=3):
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        offload.note_step(model, loss=loss.item())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    opt.close()
    return losses


def test_trace_of_a_three_step_run_shows_fetches_overlapping_compute(tmp_path, tiny_gpt2, offload_config, no_leaks):
    trace = tmp_path / "trace.json"
    started = time.perf_counter()  # the trace's clock starts inside wrap: within this run
    model = offload.wrap(tiny_gpt2(**GPT2), offload_config(tmp_path, TRACED, trace_path=str(trace)))
    train(model)
    offload.unwrap(model)  # writes the trace
    run_us = (time.perf_counter() - started) * 1e6
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    assert {"fetch", "transfer", "compute", "optimizer"} <= {e["cat"] for e in events}
    begins = {e["id"] for e in events if e["ph"] == "b"}
    assert begins == {e["id"] for e in events if e["ph"] == "e"}, "an async span was never closed"
    # every event lies inside the run as a clock around it measured it, in microseconds, and
    # every span takes some time
    assert all(0 <= e["ts"] <= run_us for e in events), max(e["ts"] for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] > 0 and e["ts"] + e["dur"] <= run_us for e in spans), max(e["dur"] for e in spans)
    _assert_no_group_computes_while_awaited(spans)
    # the point of prefetching: parameter fetches run while modules compute
    fetches = _spans(events, "fetch")
    compute = _spans(events, "compute")
    overlapping = [f for f in fetches if any(c0 < f[1] and f[0] < c1 for c0, c1 in compute)]
    assert len(overlapping) >= 3, f"{len(overlapping)} of {len(fetches)} fetches overlap compute"
    assert overlap_seconds(events, "fetch", "compute") > 0
    assert busy_seconds(events, "optimizer") > 0
    # where each shard's update ran: the update owed to the next forward (the default; the
    # last step's, run by synchronize(), is labelled the same)
    updates = [e for e in spans if e["cat"] == "optimizer" and e["name"].startswith("update shard")]
    assert updates and {e["args"]["during"] for e in updates} == {"next forward"}


def _assert_no_group_computes_while_awaited(spans):
    """A module computes once its group has arrived: no compute span of a group overlaps a
    wait (stall) for that group. (Timestamps are rounded to 1 ns.)"""
    by_group: dict[str, list] = {}
    for e in spans:
        if e["cat"] in ("compute", "stall"):
            by_group.setdefault(e["name"].split(" ", 1)[1], []).append(e)
    stalls = [(group, e) for group, es in by_group.items() for e in es if e["cat"] == "stall"]
    assert stalls, "no stall was recorded (the first pass reads every group from disk)"
    for group, stall in stalls:
        for span in (e for e in by_group[group] if e["cat"] == "compute"):
            assert (span["ts"] >= stall["ts"] + stall["dur"] - 1e-3
                    or span["ts"] + span["dur"] <= stall["ts"] + 1e-3), (stall, span)


def _spans(events, cat):
    opened, out = {}, []
    for e in events:
        if e["cat"] != cat:
            continue
        if e["ph"] == "X":
            out.append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] == "b":
            opened[e["id"]] = e["ts"]
        elif e["ph"] == "e":
            out.append((opened.pop(e["id"]), e["ts"]))
    return out


def test_step_log_has_a_line_per_step_that_adds_up(tmp_path, tiny_gpt2, offload_config, no_leaks):
    log_path = tmp_path / "steps.jsonl"
    model = offload.wrap(tiny_gpt2(**GPT2), offload_config(tmp_path, TRACED, log_path=str(log_path)))
    loading = offload.stats(model)["write_bytes"]  # wrap wrote the parameters to NVMe
    try:
        losses = train(model)
        totals = offload.stats(model)
    finally:
        offload.unwrap(model)
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    for key in ("step_seconds", "read_bytes", "write_bytes", "stall_seconds", "io_busy_seconds",
                "optimizer_seconds", "prefetch_hits", "prefetch_misses", "device_peak_bytes", "lr"):
        assert all(key in r for r in lines), key
    assert [r["loss"] for r in lines] == pytest.approx(losses)
    assert not any(r["skipped_step"] for r in lines)
    # deltas: the lines sum to what the model's stats say (the bytes of the last write-backs
    # land after the last line, hence <=)
    assert sum(r["read_bytes"] for r in lines) <= totals["read_bytes"]
    assert 0 < sum(r["write_bytes"] for r in lines) <= totals["write_bytes"] - loading  # steps only
    assert sum(r["read_bytes"] for r in lines) > 0 and all(r["optimizer_seconds"] > 0 for r in lines)
    # (the last step's update runs in synchronize(), after the last line: its time only in the totals)
    assert sum(r["optimizer_seconds"] for r in lines) <= totals["optimizer_seconds"] + 1e-5
    assert totals["io_busy_seconds"] > 0


def test_a_resumed_run_logs_its_steps_on_from_the_checkpoint(tmp_path, tiny_gpt2, offload_config, no_leaks):
    """The step log's count travels in the checkpoint: a run resumed from it goes on from
    the saved run's steps (its records began at 0 again, and plots drew them over the first)."""
    log_path = tmp_path / "steps.jsonl"
    for steps in (2, 1):
        model = offload.wrap(tiny_gpt2(**GPT2), offload_config(tmp_path, TRACED, log_path=str(log_path)))
        try:
            if steps == 1:
                offload.load_checkpoint(tmp_path / "ckpt", model)
            train(model, steps=steps)
            if steps == 2:
                offload.save_checkpoint(tmp_path / "ckpt", model)
        finally:
            offload.close(model)
    assert [json.loads(line)["step"] for line in log_path.read_text().splitlines()] == [0, 1, 2]


def test_log_step_for_inference_and_write_trace_errors(tmp_path, tiny_gpt2, offload_config, no_leaks):
    model = offload.wrap(tiny_gpt2(**GPT2).eval(), offload_config(tmp_path, TRACED, optimizer_tier="host"))
    try:
        ids = torch.randint(0, 1000, (1, 32))
        with torch.no_grad():
            model(ids)
        first = offload.log_step(model, tokens=32)
        with torch.no_grad():
            model(ids)
        second = offload.log_step(model)
        assert (first["step"], second["step"], first["tokens"]) == (0, 1, 32)
        assert first["read_bytes"] > 0 and second["prefetch_hits"] > 0
        with pytest.raises(ValueError, match="trace_path"):
            offload.write_trace(model)
    finally:
        offload.unwrap(model)


def test_bad_log_and_trace_paths_are_refused(tmp_path, offload_config, no_leaks):
    # a config is pure data: wrap, the first call that writes them, refuses them
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="log_path=.*does not exist"):
        offload.wrap(model, offload_config(tmp_path, TRACED, log_path=str(tmp_path / "missing" / "log.jsonl")))
    with pytest.raises(ValueError, match="trace_path=.*is a directory"):
        offload.wrap(model, offload_config(tmp_path, TRACED, trace_path=str(tmp_path)))
    assert not os.path.exists(tmp_path / "swap")  # refused before the store was built


def test_plot_log_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    log_path = tmp_path / "steps.jsonl"
    records = [{"step": i, "step_seconds": 1.0 + i, "read_bytes": 1e9, "write_bytes": 5e8, "stall_seconds": 0.1,
                "optimizer_seconds": 0.3, "io_busy_seconds": 2.0, "loss": 5.0 - i} for i in range(4)]
    memory = {"rss_bytes": 5 << 30, "rss_peak_bytes": 6 << 30, "mem_baseline_bytes": 1 << 29,
              "mem_host_pool_bytes": 2 << 30, "mem_device_pool_bytes": 1 << 30, "mem_other_pools_bytes": 1 << 26,
              "mem_heap_bytes": 1 << 26, "mem_heap_peak_bytes": 1 << 30, "mem_heap_free_bytes": 1 << 28, "mem_mapped_files_bytes": 1 << 20,
              "mem_untracked_bytes": 1 << 28}
    height = {}  # the PNG's height (IHDR): the memory panel is a third row, drawn only when the log has its keys
    for name, log in (("old", records), ("memory", [{**r, **memory} for r in records])):
        log_path.write_text("".join(json.dumps(r) + "\n" for r in log))
        png = tmp_path / f"{name}.png"
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_log.py"), str(log_path), "-o",
                              str(png)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height[name] = int.from_bytes(png.read_bytes()[20:24], "big")
    assert height["memory"] > height["old"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_log.py"), str(bad)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "is not a JSON line" in out.stderr
    for text, says in (("", "no such file"), ('{"a": 1}\n', "no step records")):
        if text:
            bad.write_text(text)
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_log.py"),
                              str(bad if text else tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.png")],
                             capture_output=True, text=True)
        assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "x.png").exists()


def test_a_model_holding_the_wrapped_one_is_found(tmp_path, tiny_gpt2, offload_config, no_leaks):
    """A PEFT model built after ``wrap`` (the README's order): its adapters are plain
    parameters, yet the optimizer's steps write the wrapped model's step log, and
    ``note_step``, ``stats`` and ``close`` take the PEFT model (close releases the files:
    ``no_leaks``). A module holding two wrapped models is refused where one is meant and
    closes both; neither it nor a module inside a wrapped model can be wrapped again."""
    peft = pytest.importorskip("peft")
    log_path = tmp_path / "steps.jsonl"
    base = offload.wrap(tiny_gpt2(**GPT2), offload_config(tmp_path, TRACED, log_path=str(log_path)))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0))
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        offload.note_step(model, loss=loss.item())
        opt.step()
        opt.zero_grad()
    assert offload.stats(model)["read_bytes"] == offload.stats(base)["read_bytes"] > 0
    opt.close()
    offload.close(model)
    with pytest.raises(ValueError, match="not wrapped"):
        offload.stats(base)
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and all("loss" in r and "lr" in r for r in lines)

    pair = torch.nn.ModuleList([offload.wrap(tiny_gpt2(**GPT2), offload_config(tmp_path / name, TRACED))
                                for name in ("a", "b")])
    with pytest.raises(ValueError, match="holds 2 wrapped models"):
        offload.stats(pair)
    with pytest.raises(ValueError, match="already wrapped"):
        offload.wrap(pair, offload_config(tmp_path / "c", TRACED))
    with pytest.raises(ValueError, match="inside a wrapped model"):
        offload.wrap(pair[0].transformer.h[0], offload_config(tmp_path / "c", TRACED))
    offload.close(pair)
    assert all(offload.params.find(m) is None for m in pair)
