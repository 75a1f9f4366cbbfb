"""offload.plan: the memory plan, what wrap and the optimizers refuse before allocating."""

from __future__ import annotations

import logging
import os
import re
from collections import namedtuple

import psutil
import pytest
import torch

import offload
from offload import _plan
from offload._activation_estimate import ActivationEstimate
from offload.io import BudgetError

transformers = pytest.importorskip("transformers")

_VM = namedtuple("_VM", "total available")


# this file's model and config: the tiny GPT-2 with 32 positions and transformers' default
# dropout; swap files in "swap", 1 GiB each (OffloadConfig's default), a 4 MiB device
# budget, nothing kept resident
GPT2 = dict(n_positions=32, dropout=0.1)
PLAN = dict(swap="swap", device_budget="4MiB", resident_bytes=0, file_size="1GiB")


def rss() -> int:
    return psutil.Process().memory_info().rss


def unique_param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def test_plan_counts_what_wrap_and_the_optimizer_store(tmp_path, tiny_gpt2, offload_config, no_leaks):
    model = tiny_gpt2(**GPT2)
    cfg = offload_config(tmp_path, PLAN)
    plan = offload.plan(model, cfg, optimizer="adamw")
    assert plan.fits
    params = unique_param_bytes(model)
    rows = {r.item: r for r in plan.rows}
    assert rows["parameters, streamed"].nbytes == params  # tied wte/lm_head counted once
    assert rows["optimizer: exp_avg, exp_avg_sq"].nbytes == 2 * params
    text = str(plan)
    for item in ("parameters, streamed", "host RAM", "disk at"):
        assert item in text
    # fp32 parameters on NVMe are their own master weights; bf16 ones need an fp32 copy
    assert "optimizer: master weights" not in text
    bf16 = offload.plan(model, offload_config(tmp_path, PLAN, compute_dtype="bf16"), optimizer="adamw")
    assert {r.item: r for r in bf16.rows}["optimizer: master weights"].nbytes == params
    model = offload.wrap(model, cfg)
    try:
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 211, (2, 16))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.synchronize()
        # what rests on NVMe after a step: parameters and moments (gradients in host memory)
        on_disk = offload.stats(model)["nvme_bytes"]
        assert on_disk == pytest.approx(plan.bytes_on("nvme"), rel=0.05)
        opt.close()
    finally:
        offload.unwrap(model)


def test_plan_allocates_nothing_and_takes_meta_models(tmp_path, tiny_gpt2, offload_config):
    with offload.init_empty_weights():
        model = tiny_gpt2(**GPT2)
    before = rss()
    plan = offload.plan(model, offload_config(tmp_path, PLAN), optimizer=None)
    assert rss() - before < 8 << 20
    assert plan.ram_credit == 0  # meta parameters free nothing when they move
    assert not any(r.item.startswith("optimizer") for r in plan.rows)
    assert not os.path.exists(tmp_path / "swap")
    with pytest.raises(ValueError, match="optimizer='lion'"):
        offload.plan(model, offload_config(tmp_path, PLAN), optimizer="lion")


def test_plan_refuses_the_device_budget_wrap_refuses(tmp_path, tiny_gpt2, offload_config, no_leaks):
    # 8 KiB holds no group of the model: the plan must say so as wrap does, with the budget that runs
    model = tiny_gpt2(**GPT2)
    cfg = offload_config(tmp_path, PLAN, device_budget="8KiB")
    plan = offload.plan(model, cfg, optimizer=None)
    assert not plan.fits
    with pytest.raises(BudgetError) as refused:
        offload.wrap(model, cfg)
    with pytest.raises(offload.MemoryPlanError, match="set device_budget >= ") as planned:
        plan.check()
    assert str(refused.value) in str(planned.value)


def test_plan_refuses_a_host_budget_below_the_largest_group_at_once(tmp_path, tiny_gpt2, offload_config, no_leaks):
    """wrap refused it from its first put, naming the group it met first: raised to that,
    the next larger group was refused, and so on; the plan names the largest."""
    model = tiny_gpt2(**GPT2)
    cfg = offload_config(tmp_path, param_tier="nvme", host_budget="4KiB", resident_bytes=0)
    with pytest.raises(offload.MemoryPlanError, match=r"the largest group, .* host_budget is 4.00 KiB: raise "
                                                      r"host_budget above (\d+\.\d+ KiB)") as refused:
        offload.wrap(model, cfg)
    need = re.search(r"above (\d+\.\d+) KiB", str(refused.value)).group(1)
    wrapped = offload.wrap(model, cfg.replace(host_budget=f"{need}KiB"))  # (the budget it names runs)
    offload.unwrap(wrapped)


def test_a_ranks_plan_refuses_the_gathered_group_wrap_refuses(tmp_path, tiny_gpt2, offload_config):
    # two ranks: each holds its slice of a group beside the whole group gathered for use
    model = tiny_gpt2(**GPT2)
    groups = offload.params.device_layout(model, offload_config(tmp_path, PLAN), partitioned=True, check=False).groups
    cfg = offload_config(tmp_path, PLAN, world_size=2, device_budget=max(g.nbytes for g in groups))
    plan = offload.plan(model, cfg, optimizer=None)
    assert not plan.fits
    with pytest.raises(offload.MemoryPlanError, match="gathered .* next to its slice"):
        plan.check()


def test_plan_counts_what_an_inference_forward_holds(tmp_path, tiny_gpt2, offload_config):
    # a frozen model saves nothing for backward; its forward still holds the logits (4 x 32 x 211 fp32) at the end
    with offload.init_empty_weights():
        model = tiny_gpt2(**GPT2)
    model.requires_grad_(False)
    ids = torch.zeros(4, 32, dtype=torch.long, device="meta")
    plan = offload.plan(model, offload_config(tmp_path, PLAN), optimizer=None, batch={"input_ids": ids})
    assert plan.activation_bytes >= 4 * 32 * 211 * 4
    assert "the forward's peak (inference)" in str(plan)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rss_line_is_whole_when_torch_counts_nothing(tmp_path, offload_config, device):
    plan = _plan.MemoryPlan(config=offload_config(tmp_path, PLAN, device=device), activations=ActivationEstimate(0, 0))
    line = plan._rss_line()
    assert not line.rstrip().endswith((";", ",")), line


def test_a_cuda_plan_counts_the_host_memory_cuda_kernels_take(tmp_path, monkeypatch, tiny_gpt2, offload_config):
    # measured on an H200: torch's kernels loading at first use took 1.2 GiB of host RSS that
    # the plan left out; it is counted on CUDA (and against the RAM available), never on the CPU
    model = tiny_gpt2(**GPT2)
    on = {d: offload.plan(model, offload_config(tmp_path, PLAN, device=d), optimizer=None) for d in ("cpu", "cuda")}
    assert on["cpu"].cuda_kernels == 0 and on["cuda"].cuda_kernels == offload._memory.CUDA_KERNEL_HOST_BYTES
    assert on["cuda"].predicted_rss >= on["cuda"].baseline_rss + on["cuda"].ram_need + on["cuda"].cuda_kernels
    assert "CUDA kernels loaded at first use" in str(on["cuda"]) and "CUDA kernels" not in str(on["cpu"])
    need = on["cuda"].ram_need
    monkeypatch.setattr(_plan.psutil, "virtual_memory", lambda: _VM(1 << 34, need + (256 << 20)))
    assert offload.plan(model, offload_config(tmp_path, PLAN, device="cpu"), optimizer=None).fits
    short = offload.plan(model, offload_config(tmp_path, PLAN, device="cuda"), optimizer=None)
    assert not short.fits and any("host RAM" in problem for problem in short.problems), short.problems


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_plan_counts_the_staging_the_optimizer_reserves(tmp_path, tiny_gpt2, offload_config, device):
    # bf16 groups on NVMe: the step assembles each from master rows in a write-back buffer,
    # and on a device copies gradients out through host buffers: both are host rows
    cfg = offload_config(tmp_path, PLAN, device=device, compute_dtype="bf16", host_budget="1GiB")
    items = {r.item: r.nbytes for r in offload.plan(tiny_gpt2(**GPT2), cfg).rows if r.tier == "host"}
    assert items.get("optimizer: write-back staging", 0) > 0, items
    assert (items.get("optimizer: device staging", 0) > 0) == (device == "cuda"), items


def test_the_host_budget_a_refusal_suggests_would_fit(tmp_path, monkeypatch, tiny_gpt2, offload_config):
    # the suggested host_budget is counted from the rows the budget caps, not all host rows
    # (the states read ahead alone exceed the budget here): one byte short, it is the budget
    with offload.init_empty_weights():  # (nothing in RAM that wrap would free)
        model = tiny_gpt2(**GPT2, n_layer=4, n_embd=256)
    cfg = offload_config(tmp_path, PLAN, host_budget="8MiB", device_budget="2MiB")
    need = offload.plan(model, cfg).ram_need
    monkeypatch.setattr(_plan.psutil, "virtual_memory", lambda: _VM(1 << 34, need - 1))
    problem = " ".join(offload.plan(model, cfg).problems)
    suggested = re.search(r"host_budget<=([\d.]+) (\w+)", problem)
    assert suggested and float(suggested[1]) * {"KiB": 1 << 10, "MiB": 1 << 20}[suggested[2]] <= 8 << 20, problem


def test_wrap_refuses_before_allocating_when_ram_is_short(tmp_path, monkeypatch, tiny_gpt2, offload_config, no_leaks):
    model = tiny_gpt2(**GPT2, n_embd=128)
    cfg = offload_config(tmp_path, PLAN, param_tier="host", optimizer_tier="host", nvme_path=None,
                         host_budget="256MiB", device_budget="256MiB")
    monkeypatch.setattr(_plan.psutil, "virtual_memory", lambda: _VM(1 << 34, 1 << 20))
    before = rss()
    with pytest.raises(offload.MemoryPlanError) as err:
        offload.wrap(model, cfg)
    message = str(err.value)
    assert "host RAM" in message and "available" in message and "param_tier='nvme'" in message
    assert "parameters, streamed" in message  # the plan's table comes with the error
    assert rss() - before < 16 << 20
    assert all(p.device.type == "cpu" and not hasattr(p, "_offload") for p in model.parameters())
    monkeypatch.undo()
    offload.unwrap(offload.wrap(model, cfg))  # the same model wraps once memory is there


def test_plan_fixes_name_only_settings_that_would_help(tmp_path, monkeypatch, tiny_gpt2, offload_config):
    model = tiny_gpt2(**GPT2)
    monkeypatch.setattr(_plan.psutil, "virtual_memory", lambda: _VM(1 << 34, 1 << 20))
    on_disk = offload.plan(model, offload_config(tmp_path, PLAN, host_budget="256MiB"), optimizer="adamw")
    assert not on_disk.fits
    problem = on_disk.problems[0]
    assert "host_budget<=" in problem and "optimizer_tier='nvme'" not in problem  # it is nvme already
    in_ram = offload.plan(model, offload_config(tmp_path, PLAN, optimizer_tier="host", host_budget="256MiB"),
                          optimizer="adamw")
    assert "optimizer_tier='nvme'" in in_ram.problems[0]


def test_wrap_refuses_before_creating_files_when_the_disk_is_short(tmp_path, monkeypatch, tiny_gpt2, offload_config,
                                                                   no_leaks):
    model = tiny_gpt2(**GPT2)
    cfg = offload_config(tmp_path, PLAN)
    monkeypatch.setattr(_plan, "free_disk_bytes", lambda path: 4096)
    with pytest.raises(offload.MemoryPlanError, match=r"disk at .*swap.*needed.*free: free space there"):
        offload.wrap(model, cfg)
    assert not os.path.exists(tmp_path / "swap"), "wrap created the swap directory before refusing"


def test_wrap_refuses_a_file_size_larger_than_the_free_disk(tmp_path, monkeypatch, tiny_gpt2, offload_config,
                                                             no_leaks):
    """The model's bytes fit, but swap space is claimed a file_size at a time: the plan said
    it fits and the first claim failed naming only the disk."""
    model = tiny_gpt2(**GPT2)
    cfg = offload_config(tmp_path, PLAN, file_size="1GiB")
    monkeypatch.setattr(_plan, "free_disk_bytes", lambda path: 64 << 20)
    with pytest.raises(offload.MemoryPlanError, match=r"claimed in files of file_size=1.00 GiB.*set a smaller file_size"):
        offload.wrap(model, cfg)
    # more than one file's worth: the second file is what would not fit
    need = offload.plan(model, cfg, optimizer=None).disk_need
    small = offload_config(tmp_path, PLAN, file_size=need // 2 + 4096)
    plan = offload.plan(model, small, optimizer=None)
    assert plan.disk_claim == 2 * small.file_size and "claims" in str(plan)
    monkeypatch.setattr(_plan, "free_disk_bytes", lambda path: need + 4096)
    with pytest.raises(offload.MemoryPlanError, match=r"claimed in files of file_size=.*set a smaller file_size"):
        offload.wrap(model, small)


def test_optimizer_refuses_states_that_do_not_fit(tmp_path, monkeypatch, offload_config, no_leaks):
    params = [torch.nn.Parameter(torch.randn(1 << 20))]
    monkeypatch.setattr(_plan.psutil, "virtual_memory", lambda: _VM(1 << 34, 1 << 20))
    with pytest.raises(offload.MemoryPlanError, match="optimizer states in host memory.*optimizer_tier='nvme'"):
        offload.AdamW(params, lr=1e-3).step()
    monkeypatch.undo()
    monkeypatch.setattr(_plan, "free_disk_bytes", lambda path: 4096)
    cfg = offload_config(tmp_path, PLAN, param_tier="host", optimizer_tier="nvme")
    opt = None
    with pytest.raises(offload.MemoryPlanError, match="optimizer states on NVMe.*optimizer_tier='host'"):
        opt = offload.AdamW(params, lr=1e-3, config=cfg)
        params[0].grad = torch.ones_like(params[0])
        opt.step()
    if opt is not None:
        opt.close()


def test_wrap_logs_the_plan(tmp_path, caplog, tiny_gpt2, offload_config, no_leaks):
    model = tiny_gpt2(**GPT2)
    with caplog.at_level(logging.INFO, logger="offload"):
        model = offload.wrap(model, offload_config(tmp_path, PLAN))
    offload.unwrap(model)
    assert "offload memory plan: device cpu, param_tier nvme" in caplog.text


@pytest.mark.cuda
def test_cuda_plan_checks_device_memory(tmp_path, tiny_gpt2, offload_config):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    free, _ = torch.cuda.mem_get_info()
    with offload.init_empty_weights():
        model = tiny_gpt2(**GPT2)
    cfg = offload_config(tmp_path, PLAN, device="cuda", param_tier="device", device_budget=4 * free)
    plan = offload.plan(model, cfg, optimizer=None)
    assert plan.device_free is not None and plan.device_need <= plan.device_free  # a small model fits
