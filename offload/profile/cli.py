"""``offload-profile``: measure every link offload uses and recommend a configuration.

Measures, on this machine:
  * the disk at --path through offload's own file engine (the code the runtime uses),
    swept over block size, queue depth and worker threads, O_DIRECT and buffered;
  * host memory copy bandwidth;
  * the CPU AdamW step (offload.AdamW, torch's fused kernel), in parameters per second;
  * with --device cuda: host-to-device and device-to-host copies, pinned and pageable,
    and whether disk reads and host-to-device copies overlap.

Prints one row per link (GB/s, the setting that reached it, and its share of the
PCIe link or of fio when known; for the disk, first the sustained figures the
recommendation uses, then the burst, cached and best-of-sweep figures, labelled), saves
the report as DIR/offload-profile.json, where OffloadConfig(io="auto") picks up the
engine settings for DIR and the directories under it, and with --recommend writes an
OffloadConfig JSON with one line of reasoning per choice. --validate then checks the
disk figures against offload's store.

Example:
  offload-profile --path /mnt/nvme/offload --quick --json r.json --recommend c.json --validate
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any, Sequence

from .._units import format_size, parse_size

log = logging.getLogger("offload.profile")

EXIT_REFUSED, EXIT_INTERRUPTED = 2, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload-profile", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--path", required=True, help="an existing, writable directory on the disk to "
                        "measure: the nvme_path the runtime will use (or a parent of it)")
    parser.add_argument("--size", default="12GiB", type=_size_arg, help="bytes of the test file (default "
                        "12GiB; at least 64MiB). Each measurement moves the next stretch of it, so that no "
                        "read is of bytes just read or written: a larger file gets past larger caches in "
                        "front of the disk. Each measurement moves a fixed time's worth of bytes, so the "
                        "run's length hardly depends on it")
    parser.add_argument("--device", default="cpu", help="compute device: 'cpu' (default), 'cuda' or "
                        "'cuda:N'; CUDA adds the host-device rows")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="a small sweep, "
                      "12 disk settings (default; about 50 s at 12GiB on a 2 GB/s disk)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="the whole grid: "
                      "block sizes 256KiB-32MiB x queue depths 1-64 x threads 1x and 2x the depth "
                      "(98 settings; several minutes)")
    parser.set_defaults(mode="quick")
    parser.add_argument("--json", metavar="PATH", help="write every measurement to this JSON file")
    parser.add_argument("--recommend", metavar="PATH", help="write an OffloadConfig JSON for this machine "
                        "(loadable with OffloadConfig.from_file) and print why each value was chosen")
    parser.add_argument("--model-bytes", type=_size_arg, default=None, help="bytes of the model's "
                        "parameters (e.g. 14GiB for 7B in bf16): lets --recommend pick the tiers; "
                        "without it both tiers are nvme")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="the parameters' "
                        "dtype for --model-bytes (default bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--fio", action="store_true", help="also run fio (if installed) with the best "
                        "read and write settings, and show our share of its figures")
    parser.add_argument("--validate", nargs="?", const=6 << 30, default=None, type=_size_arg, metavar="SIZE",
                        help="after the profile, move SIZE bytes (default 6GiB) of distinct 32 MiB tensors "
                        "through offload's store with the chosen setting (first write, overwrite, read) and "
                        "print the profile's figures over what the store achieved")
    parser.add_argument("--no-cache", action="store_true", help="do not save the report as "
                        "PATH/offload-profile.json (io='auto' then finds nothing new)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each measurement")
    return parser


def _size_arg(text: str) -> int:
    try:
        return parse_size(text, name="size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _check_output(flag: str, target: str | None) -> None:
    """Refuse an output path that cannot be written, before the run."""
    if target is None:
        return
    folder = os.path.dirname(os.path.abspath(target))
    if os.path.isdir(target):
        raise ValueError(f"{flag} {target!r} is a directory: give a file path")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {target!r}: the directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {target!r}: the directory {folder!r} is not writable")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from ._run import check_target, run_profile

    try:
        check_target(args.path, args.size, args.device, validate=args.validate)
        for flag, target in (("--json", args.json), ("--recommend", args.recommend)):
            _check_output(flag, target)  # (found only after the whole run, the figures were lost)
    except (OSError, ValueError, RuntimeError) as err:
        parser.exit(EXIT_REFUSED, f"offload-profile: error: {err}\n")
    # SIGTERM (kill, a job scheduler) ends the run like Ctrl-C: the test files are removed
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    bar = _progress_bar(args)
    try:
        report = run_profile(args.path, args.size, device=args.device, mode=args.mode,
                             progress=bar.step if bar else None, cache=not args.no_cache, fio=args.fio,
                             validate=args.validate)
    except KeyboardInterrupt:
        if bar:
            bar.close()
        sys.stderr.write("offload-profile: interrupted; test files removed\n")
        return EXIT_INTERRUPTED
    except (OSError, ValueError, RuntimeError) as err:
        if bar:
            bar.close()
        parser.exit(EXIT_REFUSED, f"offload-profile: error: {err}\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
    if bar:
        bar.close()
    sys.stdout.write(format_table(report) + "\n")
    if args.json:
        from ._run import save_report

        save_report(report, args.json)
        sys.stdout.write(f"\nreport: {args.json}\n")
    if report.get("saved_as_cache"):
        sys.stdout.write(f"cached for io='auto': {os.path.join(report['path'], 'offload-profile.json')}\n")
    if args.recommend:
        write_recommendation(report, args.recommend, args.model_bytes, args.dtype)
    return 0


def _raise_interrupt(signum: int, frame: Any) -> None:
    # as a SIGINT, so that the runtime's bookkeeping holds it back like a Ctrl-C (offload._signals)
    signal.raise_signal(signal.SIGINT)


class _Bar:
    def __init__(self, total: int):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="offload-profile", unit="step", leave=False, dynamic_ncols=True)

    def step(self, label: str) -> None:
        self._bar.set_postfix_str(label, refresh=False)
        self._bar.update(1)
        log.info("%s", label)

    def close(self) -> None:
        self._bar.close()


def _progress_bar(args: argparse.Namespace) -> _Bar | None:
    if args.no_progress:
        return None
    from ._run import planned_steps

    return _Bar(planned_steps(args.mode, args.device.startswith("cuda"), args.fio, bool(args.validate)))


# ---------------------------------------------------------------------------------------
def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} GB/s"


def _spread(d: dict[str, Any]) -> str:
    return f"{d['min']:.2f}-{d['max']:.2f}"


def _setting(d: dict[str, Any]) -> str:
    return (f"{format_size(d['block_size']).replace('.00', '')} blocks, depth {d['queue_depth']}, "
            f"{d['threads']} threads")


def format_table(report: dict[str, Any]) -> str:
    """One row per link: its rate, the setting that reached it, and notes: for the disk,
    which figures the recommendation uses and which are a cache's; elsewhere the share of a
    known limit (fio, the PCIe link) where one is known."""
    fio = report.get("fio") or {}
    direct = "O_DIRECT" if report.get("disk_direct_supported") else "buffered: no O_DIRECT here"
    if report.get("disk_in_ram"):
        direct += f"; on {report['disk_in_ram']}: memory, not a disk"
    best_read = report["disk_best_read"]
    choice = report["engine_choice"]
    burst = report["disk_burst_seconds"]
    def passes(op: str) -> str:
        spread = report[f"disk_{op}_spread"]
        return (f"recommended on: median of {len(spread['runs'])} passes of {format_size(spread['pass_bytes'])}"
                + ("" if spread.get("split") else f" (whole: too short to leave out {burst:g} s)")
                + f", spread {_spread(spread)}")

    rows: list[tuple[str, str, str, str]] = [
        (f"disk read, sustained ({direct})", _gbps(report["disk_read_gbps"]), _setting(choice), passes("read")),
        (f"disk write, sustained ({direct})", _gbps(report["disk_write_gbps"]), _setting(choice), passes("write")),
        ("disk first write (new extents)", _gbps(report["disk_first_write_gbps"]), "8 MiB blocks, depth 32, "
         "32 threads", f"{report['disk_first_write_gbps'] / report['disk_write_gbps']:.2f} of overwrite"),
    ]
    for key, name in (("disk_read_burst_gbps", "disk read"), ("disk_write_burst_gbps", "disk write"),
                      ("disk_first_write_burst_gbps", "disk first write")):
        if report.get(key) is not None:
            rows.append((f"{name}, first {burst:g} s (burst)", _gbps(report[key]),
                         _setting(choice) if "first" not in name else "8 MiB blocks, depth 32, 32 threads",
                         "a cache absorbing the start; not recommended on"))
    for op, what in (("read", "re-read of data just read"), ("write", "overwrite of data just written")):
        if report.get(f"disk_cached_{op}_gbps") is not None:
            rows.append((f"disk {op}, cached ({what})", _gbps(report[f"disk_cached_{op}_gbps"]), _setting(choice),
                         "a cache's best case; not recommended on"))
    for op in ("read", "write"):
        best = report[f"disk_best_{op}"]
        rows.append((f"disk {op}, best of the sweep", _gbps(best["gbps"]), _setting(best),
                     (f"{fio[f'{op}_share']:.2f} of fio {fio[f'{op}_gbps']:.2f}; " if fio.get(f"{op}_gbps") else "")
                     + "ranks settings only"))
    # these rows are measurements as long as the sweep's: compared with the sweep's best
    best = {op: report[f"disk_best_{op}"]["gbps"] for op in ("read", "write")}
    if report.get("disk_buffered_read_gbps") is not None:
        rows.append(("disk read (buffered, cold cache)", _gbps(report["disk_buffered_read_gbps"]),
                     _setting(best_read), f"{report['disk_buffered_read_gbps'] / best['read']:.2f}"
                     " of the sweep's best O_DIRECT read"))
        rows.append(("disk write (buffered, + fsync)", _gbps(report["disk_buffered_write_gbps"]),
                     _setting(best_read), f"{report['disk_buffered_write_gbps'] / best['write']:.2f}"
                     " of the sweep's best O_DIRECT write"))
    mm = report.get("disk_mmap") or {}
    for key, name, ref in (("cold_read_gbps", "disk read (mmap, cold cache)", "read"),
                           ("warm_read_gbps", "disk read (mmap, warm cache)", "read"),
                           ("write_gbps", "disk write (mmap tier, + fsync)", "write")):
        if mm.get(key) is not None:
            rows.append((name, _gbps(mm[key]), "8 MiB copies, 4 threads",
                         f"{mm[key] / best[ref]:.2f} of the sweep's best O_DIRECT {ref}"))
    copy = report["host_copy"]
    rows.append(("host memory copy", _gbps(report["host_copy_gbps"]),
                 f"{format_size(copy['bytes'])}, {copy['threads']} threads", ""))
    adam = report["adam"]
    rows.append(("CPU AdamW step", f"{report['adam_params_per_s'] / 1e9:.2f} G params/s",
                 f"fused, {adam['threads']} threads, {adam['params'] >> 20} M params", ""))
    pcie = report.get("pcie")
    limit = (f"of PCIe {pcie['gt_per_s']:g} GT/s x{pcie['lanes']} ({pcie['gbps']:.1f})" if pcie else "")
    for key, name in (("h2d_pinned", "host to device, pinned"), ("h2d_pageable", "host to device, pageable"),
                      ("d2h_pinned", "device to host, pinned"), ("d2h_pageable", "device to host, pageable")):
        value = report.get(f"{key}_gbps")
        if value is not None:
            rows.append((name, _gbps(value), "256 MiB copies",
                         f"{value / pcie['gbps']:.2f} {limit}" if pcie else ""))
    overlap = report.get("disk_h2d_overlap")
    if overlap:
        rows.append(("disk read + H2D at once", f"{overlap['disk_read_with_h2d_gbps']:.2f} + "
                     f"{overlap['h2d_with_disk_gbps']:.1f} GB/s", "alone: "
                     f"{overlap['disk_read_alone_gbps']:.2f} + {overlap['h2d_alone_gbps']:.1f} GB/s",
                     f"{overlap['overlap_efficiency']:.2f} of both alone"
                     + ("" if overlap["overlaps"] else ": they do not overlap")))
    header = ("link", "rate", "setting", "notes")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"\n{report['path']}: {report['mode']} sweep of {len(report['disk_sweep'])} disk "
                 f"measurements of up to {format_size(report['disk_bytes_per_measurement'])}; "
                 f"{report['elapsed_s']:.1f} s in all")
    lines.append(f"disk figures recommended on: {report['disk_figures_used']}")
    if report.get("validation"):
        from ._validate import format_validation

        lines.append(format_validation(report["validation"]))
    return "\n".join(lines)


def write_recommendation(report: dict[str, Any], target: str, model_bytes: int | None,
                         dtype: str | None) -> None:
    from ..config import OffloadConfig
    from ._recommend import recommend

    cfg, reasons = recommend(report, model_bytes=model_bytes, dtype=dtype)
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(cfg, fh, indent=2)
            fh.write("\n")
        OffloadConfig.from_file(tmp)  # never hand out a config the runtime would refuse
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    sys.stdout.write(f"\nrecommended configuration: {target}\n")
    for line in reasons:
        sys.stdout.write(f"  - {line}\n")


if __name__ == "__main__":
    sys.exit(main())
