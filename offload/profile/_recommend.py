"""From a profile report to an OffloadConfig, with one line of reasoning per choice."""

from __future__ import annotations

from typing import Any

from .._units import format_size, parse_size

__all__ = ["recommend", "config_size"]

_MiB, _GiB = 1 << 20, 1 << 30
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def config_size(nbytes: int) -> str | int:
    """``8 << 20`` -> ``"8MiB"``; sizes that are not whole MiB stay ints (exact either way)."""
    for unit, scale in (("GiB", _GiB), ("MiB", _MiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return int(nbytes)


def _fmt(gbps: float | None) -> str:
    return "-" if gbps is None else f"{gbps:.2f}"


def _count(n: int) -> str:
    """``268435456`` -> ``"268.4 million"``: a count in words (a bare "B" reads as bytes)."""
    for word, scale, digits in (("billion", 10**9, 2), ("million", 10**6, 1)):
        if round(n / scale, digits) >= 1:  # (999.95 million reads as 1.00 billion, not 1000.0 million)
            return f"{n / scale:.{digits}f} {word}"
    return f"{n:,}"


def _round_down(nbytes: float, grain: int) -> int:
    return max(grain, int(nbytes) // grain * grain)


def recommend(report: dict[str, Any], *, model_bytes: int | None = None, dtype: str | None = None,
              ) -> tuple[dict[str, Any], list[str]]:
    """An OffloadConfig mapping for the measured machine, and why each value was chosen.

    Args:
        report: what :func:`offload.profile.run_profile` returned.
        model_bytes: bytes of the model's parameters in their training dtype; decides the
            tiers. ``None`` puts both on NVMe, which fits any model.
        dtype: the parameters' dtype (``fp32``, ``bf16``, ``fp16``); default bf16 on CUDA,
            fp32 on the CPU. Sets how many parameters ``model_bytes`` holds, hence the
            optimizer states' size.
    """
    reasons: list[str] = []
    cfg: dict[str, Any] = {"device": report["device"], "nvme_path": report["path"]}
    cuda = report["device"].startswith("cuda")

    # -- I/O engine: the setting with the best read and write together --------------------
    engine = report["engine_choice"]
    cfg["block_size"] = config_size(engine["block_size"])
    cfg["queue_depth"] = engine["queue_depth"]
    cfg["io_threads"] = engine["threads"]
    reasons.append(
        f"block_size {format_size(engine['block_size'])}, queue_depth {engine['queue_depth']}, io_threads "
        f"{engine['threads']}: the measured setting with the best read and write together (geometric mean; "
        f"read {engine['read_gbps']:.2f}, write {engine['write_gbps']:.2f} GB/s in the sweep, against the sweep's "
        f"best read {report['disk_best_read']['gbps']:.2f} and best write {report['disk_best_write']['gbps']:.2f})")
    spread = {op: report[f"disk_{op}_spread"] for op in ("read", "write")}
    reasons.append(
        f"disk figures used below: read {report['disk_read_gbps']:.2f}, write {report['disk_write_gbps']:.2f} GB/s "
        f"(spread {spread['read']['min']:.2f}-{spread['read']['max']:.2f} and {spread['write']['min']:.2f}-"
        f"{spread['write']['max']:.2f}), as a training step moves bytes ({report['disk_figures_used']}); the "
        f"re-read and overwrite of just-moved data ({_fmt(report.get('disk_cached_read_gbps'))} / "
        f"{_fmt(report.get('disk_cached_write_gbps'))} GB/s) are what caches in front of the disk give")

    # -- budgets ---------------------------------------------------------------------------
    available = report["host"]["ram_available_bytes"]
    host_share = 0.5 if cuda else 0.35
    host_budget = _round_down(available * host_share, 256 * _MiB)
    cfg["host_budget"] = config_size(host_budget)
    reasons.append(
        f"host_budget {format_size(host_budget)}: {host_share:.0%} of the {format_size(available)} of RAM "
        f"free when profiled; the rest is left to activations, the Python process and other programs")
    if cuda and report.get("cuda_free_bytes"):
        device_free = report["cuda_free_bytes"]
        device_budget = _round_down(device_free * 0.5, 256 * _MiB)
        reasons.append(
            f"device_budget {format_size(device_budget)}: half of the {format_size(device_free)} free on "
            f"{report['device']}; the other half is for activations and the CUDA caching allocator")
    else:
        device_budget = _round_down(available * 0.25, 256 * _MiB)
        reasons.append(
            f"device_budget {format_size(device_budget)}: on the CPU the compute copies of parameters are "
            f"host memory too: 25% of the free RAM, beside the host budget")
    cfg["device_budget"] = config_size(device_budget)

    # -- prefetch: the smallest amount in flight that reached the disk's best read ---------
    prefetch, how = _prefetch_from_sweep(report)
    cap = max(32 * _MiB, device_budget // 4)
    if prefetch > cap:  # (the reason must say why the value is below what the sweep asked for)
        how += f"; capped at {format_size(cap)}, a quarter of the device budget"
    cfg["prefetch_bytes"] = config_size(_round_down(min(prefetch, cap), _MiB))
    reasons.append(f"prefetch_bytes {format_size(parse_size(cfg['prefetch_bytes']))}: {how}")

    # -- tiers -----------------------------------------------------------------------------
    if model_bytes is None:
        cfg["param_tier"], cfg["optimizer_tier"] = "nvme", "nvme"
        for name in ("param_tier", "optimizer_tier"):
            reasons.append(f"{name} nvme: no --model-bytes given, so the tier that fits any model; pass "
                           "--model-bytes to keep a smaller model in memory")
    else:
        dtype = dtype or ("bf16" if cuda else "fp32")
        per_param = _DTYPE_BYTES[dtype]
        nparams = model_bytes // per_param
        # fp32 moments (8 B) and fp32 gradient accumulator (4 B) per parameter, plus an fp32
        # master copy (4 B) unless the parameters are fp32 already.
        optim_bytes = nparams * (12 + (0 if per_param == 4 else 4))
        if model_bytes <= device_budget // 2:
            cfg["param_tier"] = "device"
            why = f"fit in half the device budget ({format_size(device_budget // 2)})"
        elif model_bytes <= host_budget // 2:
            cfg["param_tier"] = "host"
            why = (f"take more than half the device budget ({format_size(device_budget // 2)}) and fit in half "
                   f"the host budget ({format_size(host_budget // 2)})")
        else:
            cfg["param_tier"] = "nvme"
            why = f"take more than half the host budget ({format_size(host_budget // 2)})"
        reasons.append(f"param_tier {cfg['param_tier']}: the model's parameters ({format_size(model_bytes)}: "
                       f"{_count(nparams)} in {dtype}) {why}")
        left = host_budget - (model_bytes if cfg["param_tier"] == "host" else 0)
        if optim_bytes <= left * 0.75:
            cfg["optimizer_tier"] = "host"
            why = f"which fits in 75% of the {format_size(left)} of host budget the parameters leave"
        else:
            cfg["optimizer_tier"] = "nvme"
            why = f"more than 75% of the {format_size(left)} of host budget the parameters leave"
        step = optim_bytes * 2 / 1e9 / max(min(report["disk_read_gbps"], report["disk_write_gbps"]), 1e-9)
        reasons.append(
            f"optimizer_tier {cfg['optimizer_tier']}: AdamW states and gradients take about "
            f"{format_size(optim_bytes)}, {why}"
            + (f"; reading and writing them costs about {step:.1f} s per step on this disk"
               if cfg["optimizer_tier"] == "nvme" else ""))
    if "nvme" not in (cfg["param_tier"], cfg["optimizer_tier"]):
        cfg["nvme_path"] = None
    return cfg, reasons


def _prefetch_from_sweep(report: dict[str, Any]) -> tuple[int, str]:
    """Little's law, measured: the fewest bytes in flight (queue depth x block size) among the
    O_DIRECT settings whose read reached 90% of the best read."""
    reads = [r for r in report["disk_sweep"] if r["op"] == "read" and r["direct"]]
    if not reads:
        return 64 * _MiB, "no O_DIRECT read was measured: 64 MiB, the runtime's floor"
    best = max(r["gbps"] for r in reads)
    good = [r for r in reads if r["gbps"] >= 0.9 * best]
    pick = min(good, key=lambda r: (r["queue_depth"] * r["block_size"], -r["gbps"]))
    in_flight = pick["queue_depth"] * pick["block_size"]
    # twice the bytes in flight: one window being read while the previous one is consumed
    prefetch = max(32 * _MiB, 2 * in_flight)
    return prefetch, (f"twice the {format_size(in_flight)} in flight ({pick['queue_depth']} x "
                      f"{format_size(pick['block_size'])}) that reached {pick['gbps']:.2f} GB/s, "
                      f"{pick['gbps'] / best:.0%} of the best read: more in flight did not read faster")
