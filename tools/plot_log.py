"""Plot an offload step log (``OffloadConfig(log_path=...)``, JSON lines) into a PNG.

    python3 tools/plot_log.py offload-steps.jsonl -o steps.png

Top: GB read and written per step (bars). Bottom: seconds per step: the whole step, the
time compute waited for parameters (stall), the optimizer, and the I/O workers' busy time.
The loss, when the log has one (``offload.note_step(model, loss=...)``), is drawn on the
top panel's right axis. Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys


def read_log(path: str) -> list[dict]:
    records = []
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise SystemExit(f"{path}:{number} is not a JSON line ({err.msg}): is this an offload step log?")
    if not records:
        raise SystemExit(f"{path} has no records: was OffloadConfig(log_path=...) set and a step run?")
    return records


def plot(records: list[dict], out: str, title: str | None = None) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("tools/plot_log.py needs matplotlib: pip install matplotlib") from None
    steps = [r.get("step", i) for i, r in enumerate(records)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    width = 0.4
    top.bar([s - width / 2 for s in steps], [r.get("read_bytes", 0) / 1e9 for r in records], width, label="read")
    top.bar([s + width / 2 for s in steps], [r.get("write_bytes", 0) / 1e9 for r in records], width,
            label="written")
    top.set_ylabel("GB per step")
    top.legend(loc="upper left")
    if any("loss" in r for r in records):
        loss_axis = top.twinx()
        loss_axis.plot([s for s, r in zip(steps, records) if "loss" in r],
                       [r["loss"] for r in records if "loss" in r], color="black", marker="o", label="loss")
        loss_axis.set_ylabel("loss")
        loss_axis.legend(loc="upper right")
    for key, label in (("step_seconds", "step"), ("stall_seconds", "stall (waiting for parameters)"),
                       ("optimizer_seconds", "optimizer"), ("io_busy_seconds", "I/O busy (summed over workers)")):
        if any(key in r for r in records):
            bottom.plot(steps, [r.get(key, 0.0) for r in records], marker=".", label=label)
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper right", fontsize="small")
    fig.suptitle(title or "offload: bytes moved and time per step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("log", help="the JSON-lines step log written by offload (OffloadConfig.log_path)")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: the log's name with .png)")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args(argv)
    out = args.output or (args.log.rsplit(".", 1)[0] + ".png")
    sys.stdout.write(plot(read_log(args.log), out, args.title) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
