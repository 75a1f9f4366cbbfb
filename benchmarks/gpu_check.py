"""One command for the day a GPU is at hand: the CUDA tests, the host-device copies of
offload's pinned pool against the link, and training with parameters and optimizer states
on NVMe, all in under 10 minutes.

    python3 benchmarks/gpu_check.py --json gpu.json

1. tests: ``pytest -m cuda`` (the tests that need a CUDA device), counted from its JUnit
   report;
2. links: copies of ``--copy-size`` bytes between a buffer of offload's host pool (page
   locked through ``offload.accel``) and device memory, each the best of 5 timed with
   CUDA events, against the pinned-copy figures ``offload-profile --device cuda`` measures
   in the same run (the link's own figure, with the PCIe link's theoretical rate where
   sysfs tells it);
3. training: GPT-2-shaped models of about 1B parameters and the largest of the ladder
   (up to 7B) whose files fit the free disk of ``--path`` and whose random weights fit
   RAM, built from configs and saved as safetensors first; wrapped from the checkpoint
   with parameters and AdamW states on NVMe, ``--steps`` timed steps after one warm-up:
   tokens/s, model FLOPs utilisation (6 x parameters x tokens per second against the
   GPU's fp32 peak, ``--peak-tflops`` where the GPU is not in the table), stall seconds
   per step and peak device memory. A size whose estimated time (from the previous
   size's time per parameter) would pass ``--time-limit`` is skipped and said so.

Without a GPU it says so, writes the JSON with null figures and exits 0. ``--device cpu``
runs steps 3 on the CPU at ``--sizes 100M`` (no MFU): a check of this script itself.

JSON: ``cuda_tests_passed``, ``cuda_tests_failed``, ``h2d_gbps``, ``d2h_gbps``,
``h2d_vs_link``, and for the first size trained ``train_params``, ``tokens_per_s``,
``mfu``, ``peak_device_bytes``; every size under ``runs``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, profile_cli, run_json_worker, saved_gpt2, start  # noqa: E402

log = logging.getLogger("bench.gpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (layers, hidden, heads): GPT-2 shapes, vocabulary 50257, 1024 positions
SHAPES = {"100M": (6, 1024, 16), "1B": (36, 1536, 16), "2B": (48, 1920, 16), "3B": (40, 2560, 20),
          "5B": (48, 3072, 24), "7B": (32, 4096, 32)}
DISK_BYTES_PER_PARAM = 28  # safetensors 4, swap: parameters 4, gradients 4, master and moments 12; slack 4
# fp32 peak of CUDA cores (torch leaves TF32 off for matmuls by default), TFLOPS, by name
PEAK_FP32_TFLOPS = {"H200": 67.0, "H100 SXM": 67.0, "H100 NVL": 60.0, "H100 PCIe": 51.0, "H100": 51.0,
                    "A100": 19.5, "L40S": 91.6, "L4": 30.3, "A10": 31.2, "RTX 4090": 82.6}


def params_of(shape: tuple[int, int, int]) -> int:
    layers, hidden, _ = shape
    return 12 * layers * hidden * hidden + (50257 + 1024) * hidden


def peak_tflops(name: str, given: float | None) -> float | None:
    if given:
        return given
    return next((v for k, v in PEAK_FP32_TFLOPS.items() if k in name), None)


# -- 1. the CUDA tests ---------------------------------------------------------------------------
def cuda_tests(timeout: float, output: str | None) -> dict:
    """``pytest -m cuda``: its counts; its whole output written to ``output`` when given, and
    the end of it logged when a test failed."""
    report = os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "--tb=short", "-m", "cuda", f"--junitxml={report}", "tests"]
    log.info("running the CUDA tests: %s", " ".join(cmd))
    try:
        out = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
        if output:
            with open(output, "w") as fh:
                fh.write(out.stdout + out.stderr)
        if out.returncode not in (0, 5):  # (5: none collected)
            log.warning("the CUDA tests failed (exit %d):\n%s", out.returncode, out.stdout[-6000:])
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except (subprocess.TimeoutExpired, OSError, ET.ParseError) as err:
        log.warning("the CUDA tests did not report: %s", err)
        return {"cuda_tests_passed": None, "cuda_tests_failed": None}
    failed = counts["failures"] + counts["errors"]
    return {"cuda_tests_passed": counts["tests"] - failed - counts["skipped"], "cuda_tests_failed": failed,
            "cuda_tests_skipped": counts["skipped"]}


# -- 2. the links --------------------------------------------------------------------------------
def pool_copies(device: torch.device, nbytes: int) -> dict:
    """Best of 5 copies each way between a buffer of offload's pinned host pool and the device."""
    from offload.accel import accelerator_for
    from offload.io import BufferPool

    pool = BufferPool(nbytes, pin=accelerator_for(device), name="gpu-check")
    buf = pool.acquire(nbytes)
    try:
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out = {"pinned": buf.pinned}
        for name, dst, src in (("h2d", gpu, buf.bytes), ("d2h", buf.bytes, gpu)):
            best = float("inf")
            dst.copy_(src, non_blocking=True)  # warm-up
            torch.cuda.synchronize(device)
            for _ in range(5):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                best = min(best, begin.elapsed_time(end) / 1e3)
            out[f"{name}_gbps"] = nbytes / best / 1e9
        return out
    finally:
        pool.release(buf)
        pool.close()


# -- 3. training -----------------------------------------------------------------------------------
def worker(path: str, args) -> dict:
    """One size in a fresh process: wrapped from its checkpoint, ``--steps`` timed steps."""
    import transformers

    import offload

    device = torch.device(args.device)
    config = transformers.AutoConfig.from_pretrained(path)
    with offload.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    swap = tempfile.mkdtemp(prefix="swap-", dir=args.path)
    budget = max(params * 4 // 3, 2 * config.vocab_size * config.n_embd * 4 + (256 << 20))
    cfg = offload.OffloadConfig(device=args.device, param_tier="nvme", optimizer_tier="nvme", nvme_path=swap,
                                device_budget=budget, host_budget=args.host_budget, file_size="4GiB")
    try:
        model = offload.wrap(model, cfg, checkpoint=path)
        model.train()
        opt = offload.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                            generator=torch.Generator().manual_seed(0)).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, stalls = [], []
        before, t0 = offload.stats(model), time.perf_counter()
        for i in range(args.steps + 1):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if i == args.steps:
                opt.synchronize()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now, t1 = offload.stats(model), time.perf_counter()
            log.info("step %d: %.2f s, loss %.4f", i + 1, t1 - t0, float(loss))
            if i >= 1:
                times.append(t1 - t0)
                stalls.append(now["stall_seconds"] - before["stall_seconds"])
            before, t0 = now, t1
        step = statistics.median(times)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        opt.close()
        offload.unwrap(model)
        return {"params": params, "step_s": step, "tokens_per_s": args.batch * args.seq / step,
                "stall_s_per_step": statistics.median(stalls), "peak_device_bytes": peak}
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def fits(shape: tuple[int, int, int], path: str) -> bool:
    n = params_of(shape)
    return n * DISK_BYTES_PER_PARAM < shutil.disk_usage(path).free and n * 8 < psutil.virtual_memory().available


def train_ladder(args, deadline: float) -> list[dict]:
    sizes = args.sizes.split(",")
    if args.largest:
        fitting = [name for name, shape in SHAPES.items() if fits(shape, args.path)]
        if fitting and fitting[-1] not in sizes:
            sizes.append(fitting[-1])
    runs, per_param = [], None
    for name in sizes:
        shape = SHAPES[name]
        n = params_of(shape)
        if not fits(shape, args.path):
            log.info("%s: skipped, its files (%d B per parameter) do not fit the free disk of %s or RAM", name,
                     DISK_BYTES_PER_PARAM, args.path)
            continue
        if per_param is not None and time.monotonic() + per_param * n > deadline:
            log.info("%s: skipped, about %.0f s estimated and %.0f s left", name, per_param * n,
                     deadline - time.monotonic())
            continue
        began = time.monotonic()
        path = saved_gpt2(args.path, name, shape)
        cmd = [sys.executable, __file__, "--worker", "--model-path", path, "--device", args.device, "--steps",
               str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--host-budget",
               args.host_budget, "--path", args.path]
        result = run_json_worker(cmd, f"training {name}")
        if result is None:
            continue
        per_param = (time.monotonic() - began) / n
        result["size"] = name
        runs.append(result)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--json", default=None, help="write the report as JSON to this path")
    parser.add_argument("--device", default="cuda", help="'cuda' (default) or 'cuda:N'; 'cpu' runs the "
                        "training part on the CPU, to check this script where there is no GPU")
    parser.add_argument("--sizes", default=None, help=f"comma list of {', '.join(SHAPES)} trained first "
                        "(default 1B; 100M with --device cpu)")
    parser.add_argument("--no-largest", dest="largest", action="store_false",
                        help="do not add the largest size of the ladder that fits the disk and RAM")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--host-budget", default="16GiB", help="offload's host budget (default 16GiB)")
    parser.add_argument("--copy-size", default=256 << 20, type=int, help="bytes per timed copy (default 256 MiB)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's fp32 peak in TFLOPS, where "
                        f"its name is not among {', '.join(PEAK_FP32_TFLOPS)}")
    parser.add_argument("--time-limit", type=float, default=540, help="seconds for the whole check; sizes "
                        "estimated to pass it are skipped (default 540)")
    parser.add_argument("--path", default=None, help="directory on the NVMe disk for models, swap files and "
                        f"the profile (default: {SCRATCH_HELP.format(name='gpu-check')})")
    parser.add_argument("--tests-log", default=None, help="write the CUDA tests' whole output to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    start(args, "gpu-check")
    if args.worker:
        print(json.dumps(worker(args.model_path, args)))
        return
    deadline = time.monotonic() + args.time_limit
    keys = ("cuda_tests_passed", "cuda_tests_failed", "h2d_gbps", "d2h_gbps", "h2d_vs_link", "train_params",
            "tokens_per_s", "mfu", "peak_device_bytes")
    report: dict = {"command": " ".join(sys.argv), **dict.fromkeys(keys), "runs": []}
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        log.info("no CUDA device here (torch %s): nothing to check; run this where a GPU is at hand",
                 torch.__version__)
        report["cuda"] = False
    else:
        report["cuda"] = cuda
        args.sizes = args.sizes or ("1B" if cuda else "100M")
        if cuda:
            device = torch.device(args.device)
            name = torch.cuda.get_device_name(device)
            report["gpu"] = name
            report.update(cuda_tests(max(60.0, min(180.0, deadline - time.monotonic() - 300)), args.tests_log))
            report.update(pool_copies(device, args.copy_size))
            _, profile, _ = profile_cli(args.path, "1GiB", os.path.join(args.path, "profile.json"),
                                        "--device", args.device)
            link = profile.get("h2d_pinned_gbps")
            report["link"] = {"h2d_pinned_gbps": link, "d2h_pinned_gbps": profile.get("d2h_pinned_gbps"),
                              "pcie": profile.get("pcie")}
            report["h2d_vs_link"] = report["h2d_gbps"] / link if link else None
            peak = peak_tflops(name, args.peak_tflops)
            report["peak_fp32_tflops"] = peak
            log.info("links: host to device %.1f GB/s, device to host %.1f GB/s (pinned: %s); the profile's "
                     "pinned copies %s GB/s", report["h2d_gbps"], report["d2h_gbps"], report["pinned"], link)
            if args.json:  # (what is known before training, should training not finish)
                with open(args.json, "w") as fh:
                    json.dump(report, fh, indent=2)
        else:
            args.largest, peak = False, None
        report["runs"] = runs = train_ladder(args, deadline)
        for run in runs:
            run["mfu"] = 6 * run["params"] * run["tokens_per_s"] / (peak * 1e12) if peak else None
        if runs:
            first = runs[0]
            report.update(train_params=first["params"], tokens_per_s=first["tokens_per_s"], mfu=first["mfu"],
                          peak_device_bytes=first["peak_device_bytes"])
        for run in runs:
            log.info("%s (%.2fB parameters): %.2f s per step, %.0f tokens/s, MFU %s, stall %.2f s per step, "
                     "peak device %s", run["size"], run["params"] / 1e9, run["step_s"], run["tokens_per_s"],
                     f"{run['mfu']:.1%}" if run["mfu"] is not None else "n/a", run["stall_s_per_step"],
                     f"{run['peak_device_bytes'] / 2**30:.1f} GiB" if run["peak_device_bytes"] else "n/a")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()
