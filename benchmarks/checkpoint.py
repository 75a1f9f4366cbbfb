"""Checkpoint save and load bandwidth: offload.save_checkpoint / load_checkpoint against the
disk (fio) and against torch.save / torch.load of the same training state, interleaved.

    python benchmarks/checkpoint.py --rounds 3 --json checkpoint.json

The training state is a GPT-2-style model built from a config (random weights, default 16
layers x 768 = 152M parameters) wrapped with offload, with offload.AdamW after one step:
fp32 weights (4 B/parameter) plus fp32 master weights and two moments (12 B/parameter),
about 2.4 GB. Two layouts:

  host   parameters and optimizer states in host memory (param_tier=optimizer_tier="host"):
         saving is memory -> checkpoint files, loading the reverse, so the disk is the limit
         and the ratios against fio are the figures of merit;
  nvme   both on NVMe (swap files on the same disk, host budget 1 GiB): saving reads the
         swap files and writes the checkpoint (loading the reverse). This disk serves reads
         and writes at once (the sum of the two times was beaten by 1.2-1.5x), so the bound
         is the slower direction alone: max(bytes / fio read, bytes / fio write).

Per round, for each layout: fio sequential write and read of the same number of bytes
(8 MiB blocks, queue depth 32, O_DIRECT, libaio) and offload-profile's quick sweep of
offload's file engine on a test file of that size (``offload.profile.run_profile``, its
sustained O_DIRECT write and read); the disk's bandwidth is the better of the two,
then offload's save (including fsyncs and the atomic swap) and load (checksums verified),
then torch.save of the same tensors (offload.state_dict + the optimizer's state_dict,
gathered in memory beforehand, not timed) to one file with fsync, and torch.load of it
(weights_only=True). Page cache: offload reads with O_DIRECT; torch's file is dropped from
the page cache with posix_fadvise(DONTNEED) after its fsync, so torch.load reads the disk
too. Peak RSS growth during each operation is sampled every 5 ms. Everything is written
under ``--path`` (outside the repository by default) in a directory removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import offload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRATCH_HELP, PeakRss, disk_bandwidth, scratch_dir  # noqa: E402

log = logging.getLogger("bench.checkpoint")


def fio(path: str, size: int, rw: str) -> float:
    filename = os.path.join(path, "fio.bin")
    if rw == "write" and os.path.exists(filename):
        os.unlink(filename)
    cmd = ["fio", "--name=bw", f"--filename={filename}", f"--rw={rw}", "--bs=8M", "--iodepth=32",
           "--ioengine=libaio", "--direct=1", f"--size={size}", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["jobs"][0][rw]["bw_bytes"] / 1e9


def drop_cache(path: str) -> None:
    files = [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def build(layout: str, work: str, args):
    import transformers

    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=12, vocab_size=50257,
                                  n_positions=256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ocfg = offload.OffloadConfig(device="cpu", param_tier=layout, optimizer_tier=layout,
                                 nvme_path=os.path.join(work, "swap") if layout == "nvme" else None,
                                 device_budget="1GiB", file_size="1GiB",
                                 host_budget=args.host_budget if layout == "host" else args.nvme_host_budget)
    if layout == "nvme":
        os.makedirs(os.path.join(work, "swap"), exist_ok=True)
    model = offload.wrap(model, ocfg)
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    return model, opt


def torch_state(model, opt) -> dict:
    return {"model": offload.state_dict(model), "optimizer": opt.state_dict()}


def round_of(layout: str, model, opt, state: dict, work: str, size: int, use_fio: bool) -> dict:
    row: dict = {}
    if use_fio:
        row["fio_write_gbps"] = fio(work, size, "write")
        row["fio_read_gbps"] = fio(work, size, "read")
        os.unlink(os.path.join(work, "fio.bin"))
    disk = disk_bandwidth(work, size)
    row["raw_write_gbps"], row["raw_read_gbps"] = disk["write_gbps"], disk["read_gbps"]
    ckpt = os.path.join(work, "ckpt")
    with PeakRss() as rss:
        t = time.perf_counter()
        offload.save_checkpoint(ckpt, model, opt, extra={"round": 1})
        row["ours_save_s"] = time.perf_counter() - t
    row["ours_save_rss_growth"] = rss.growth
    row["ours_bytes"] = dir_bytes(ckpt)
    drop_cache(ckpt)
    with PeakRss() as rss:
        t = time.perf_counter()
        offload.load_checkpoint(ckpt, model, opt)
        opt.synchronize()
        row["ours_load_s"] = time.perf_counter() - t
    row["ours_load_rss_growth"] = rss.growth
    file = os.path.join(work, "torch.pt")
    with PeakRss() as rss:
        t = time.perf_counter()
        with open(file, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        row["torch_save_s"] = time.perf_counter() - t
    row["torch_save_rss_growth"] = rss.growth
    row["torch_bytes"] = os.path.getsize(file)
    drop_cache(file)
    with PeakRss() as rss:
        t = time.perf_counter()
        loaded = torch.load(file, weights_only=True)
        row["torch_load_s"] = time.perf_counter() - t
    row["torch_load_rss_growth"] = rss.growth
    del loaded
    gc.collect()
    os.unlink(file)
    for key in ("ours", "torch"):
        row[f"{key}_save_gbps"] = row[f"{key}_bytes"] / row[f"{key}_save_s"] / 1e9
        row[f"{key}_load_gbps"] = row[f"{key}_bytes"] / row[f"{key}_load_s"] / 1e9
    return row


def summarize(layout: str, rows: list[dict], use_fio: bool) -> dict:
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    out = {k: med(k) for k in rows[0]}
    out["layout"] = layout
    out["rounds"] = rows
    # The disk per round: the better of fio and offload-profile's sustained figure (fio's read of the
    # file it just wrote ran well below the engine's in some rounds); ratios per round,
    # then the median, so a disk that drifts between rounds compares like with like.
    disk_w = lambda r: max(r["raw_write_gbps"], r.get("fio_write_gbps", 0.0))  # noqa: E731
    disk_r = lambda r: max(r["raw_read_gbps"], r.get("fio_read_gbps", 0.0))  # noqa: E731
    out["disk_write_gbps"] = statistics.median(disk_w(r) for r in rows)
    out["disk_read_gbps"] = statistics.median(disk_r(r) for r in rows)
    if layout == "host":
        out["ours_save_vs_disk"] = statistics.median(r["ours_save_gbps"] / disk_w(r) for r in rows)
        out["ours_load_vs_disk"] = statistics.median(r["ours_load_gbps"] / disk_r(r) for r in rows)
    else:  # the same disk reads the swap files and writes the checkpoint (and the reverse);
        # it serves both directions at once here, so the bound is the slower direction alone
        bound = lambda r: r["ours_bytes"] / (min(disk_r(r), disk_w(r)) * 1e9)  # noqa: E731
        out["ours_save_vs_disk"] = statistics.median(bound(r) / r["ours_save_s"] for r in rows)
        out["ours_load_vs_disk"] = statistics.median(bound(r) / r["ours_load_s"] for r in rows)
    out["torch_save_vs_disk"] = statistics.median(r["torch_save_gbps"] / disk_w(r) for r in rows)
    out["torch_load_vs_disk"] = statistics.median(r["torch_load_gbps"] / disk_r(r) for r in rows)
    out["ours_vs_torch_save"] = statistics.median(r["torch_save_s"] / r["ours_save_s"] for r in rows)
    out["ours_vs_torch_load"] = statistics.median(r["torch_load_s"] / r["ours_load_s"] for r in rows)
    return out


def print_report(rep: dict) -> None:
    gib = 1 << 30
    print(f"\ncheckpoint of a {rep['params'] / 1e6:.0f}M-parameter training state "
          f"({rep['state_bytes'] / gib:.2f} GiB), median of {rep['rounds']} rounds")
    for s in rep["layouts"]:
        print(f"\n[{s['layout']}]  ours {s['ours_bytes'] / gib:.2f} GiB on disk, torch.save {s['torch_bytes'] / gib:.2f} GiB")
        print(f"  disk          write {s['disk_write_gbps']:.2f} GB/s   read {s['disk_read_gbps']:.2f} GB/s   "
              f"(per round the better of fio {s.get('fio_write_gbps', float('nan')):.2f} / "
              f"{s.get('fio_read_gbps', float('nan')):.2f} and offload-profile's sustained "
              f"{s['raw_write_gbps']:.2f} / {s['raw_read_gbps']:.2f})")
        for op in ("save", "load"):
            line = (f"  {op:5s} ours  {s[f'ours_{op}_gbps']:.2f} GB/s ({s[f'ours_{op}_s']:.2f} s, RSS +"
                    f"{s[f'ours_{op}_rss_growth'] / 2**20:.0f} MiB)   torch  {s[f'torch_{op}_gbps']:.2f} GB/s "
                    f"({s[f'torch_{op}_s']:.2f} s, RSS +{s[f'torch_{op}_rss_growth'] / 2**20:.0f} MiB)   "
                    f"ours/torch {s[f'ours_vs_torch_{op}']:.2f}x")
            what = "of the disk" if s["layout"] == "host" else "of the slower-direction bound"
            line += f"   ours {s[f'ours_{op}_vs_disk']:.2f} {what}, torch {s[f'torch_{op}_vs_disk']:.2f} of the disk"
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--layers", type=int, default=16, help="transformer layers (default 16)")
    parser.add_argument("--embd", type=int, default=768, help="hidden size (default 768)")
    parser.add_argument("--layouts", default="host,nvme", help="comma list of host,nvme (default both)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per layout (default 3)")
    parser.add_argument("--host-budget", default="6GiB", help="OffloadConfig.host_budget (default 6GiB: "
                        "the host layout keeps the whole state there)")
    parser.add_argument("--nvme-host-budget", default="1GiB", help="host_budget of the nvme layout "
                        "(default 1GiB: states stream through it)")
    parser.add_argument("--path", default=None, help="directory on the disk to measure, where a working "
                        "directory is made and removed at the end "
                        f"(default: {SCRATCH_HELP.format(name='checkpoint')})")
    parser.add_argument("--no-fio", action="store_true", help="skip fio even if installed")
    parser.add_argument("--json", default=None, help="write the report as JSON to this path")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("offload").setLevel(logging.WARNING)
    use_fio = not args.no_fio and shutil.which("fio") is not None
    if not use_fio:
        log.info("fio: skipped (%s)", "--no-fio" if args.no_fio else "not installed: apt-get install fio")
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=scratch_dir("checkpoint", args.path))
    report = {"rounds": args.rounds, "layouts": [], "command": " ".join(sys.argv)}
    try:
        for layout in args.layouts.split(","):
            log.info("building the %s layout", layout)
            model, opt = build(layout, work, args)
            params = sum(p.numel() for p in model.parameters())
            report["params"] = params
            report["state_bytes"] = params * 16
            state = torch_state(model, opt)
            rows = []
            for r in range(args.rounds):
                row = round_of(layout, model, opt, state, work, params * 16, use_fio)
                log.info("[%s] round %d: ours save %.2f / load %.2f GB/s, torch save %.2f / load %.2f GB/s%s",
                         layout, r + 1, row["ours_save_gbps"], row["ours_load_gbps"], row["torch_save_gbps"],
                         row["torch_load_gbps"], f", fio write {row['fio_write_gbps']:.2f} / read "
                         f"{row['fio_read_gbps']:.2f}" if use_fio else "")
                rows.append(row)
            report["layouts"].append(summarize(layout, rows, use_fio))
            del state
            offload.unwrap(model)
            opt.close()
            del model, opt
            gc.collect()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
