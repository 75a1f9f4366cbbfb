"""Plot an offload step log (``OffloadConfig(log_path=...)``, JSON lines) into a PNG.

    python3 tools/plot_log.py offload-steps.jsonl -o steps.png

One record per optimizer step; the x axis is the step number on every panel.

Bytes: GB read and written per step (bars; lines on logs of many steps). The loss, when the log has one
(``offload.note_step(model, loss=...)``), is drawn on this panel's right axis.

Time: seconds per step on the left axis: the whole step, the time compute waited for
parameters (stall) and the optimizer. On the right axis, its own scale: how many I/O
workers were busy on average during the step (``io_busy_seconds / step_seconds``;
the busy time is summed over all the workers, so it can be many times the step time).

Memory, only when the records carry the ``mem_*`` / ``rss_*`` keys (older logs do not):
GiB per step. Stacked bars (areas on logs of many steps) show what the resident set is
made of at the end of the step (``offload._memory``; the parts add up to the RSS line): the
interpreter and libraries (baseline), the host pool, the device pool (CPU device only),
other pools (checkpoint save and load), torch's CPU tensors, the freed memory malloc keeps,
mapped file pages, and the rest (untracked; < 0 is drawn as 0). Lines: the resident set at
the end of the step, its peak so far, and torch's tensors at their peak within the step
(activations and gradients, gone by the end: what lifts the peak above the stack). Keys
missing from the log are left out.

Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

GB, GIB = 1e9, 2**30
# (key, label, colour) from the bottom of the stack up; the stack is what the RSS is made of
MEMORY_PARTS = (("mem_baseline_bytes", "baseline (interpreter, libraries)", "tab:gray"),
                ("mem_host_pool_bytes", "host pool", "tab:blue"),
                ("mem_device_pool_bytes", "device pool (CPU)", "tab:cyan"),
                ("mem_other_pools_bytes", "other pools (checkpoints)", "tab:red"),
                ("mem_heap_bytes", "torch tensors (end of step)", "tab:orange"),
                ("mem_heap_free_bytes", "freed, kept by malloc", "tab:brown"),
                ("mem_mapped_files_bytes", "mapped files", "tab:pink"),
                ("mem_untracked_bytes", "untracked", "tab:olive"))
MEMORY_LINES = (("rss_bytes", "RSS (end of step)", "-", "black"), ("rss_peak_bytes", "RSS peak so far", "--", "black"),
                ("mem_heap_peak_bytes", "torch tensors, their peak in the step", ":", "tab:orange"))
DENSE = 60  # more steps than this: lines and areas instead of bars, no markers (bars would alias into noise)


def read_log(path: str) -> list[dict]:
    records = []
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file (the step log OffloadConfig(log_path=...) writes)")
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
    if not any(isinstance(r, dict) and "step" in r for r in records):
        raise SystemExit(f"{path} holds JSON lines but no step records (no 'step' key): is this an offload step log?")
    return records


def has(records: list[dict], key: str) -> bool:
    return any(key in r for r in records)


def legend(axes: list, ncol: int = 4) -> None:
    """One legend for an axis and its twin."""
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:
        # above the panel, so it never hides a bar or a line
        axes[0].legend(handles, labels, fontsize="small", loc="lower left", bbox_to_anchor=(0, 1.01), borderaxespad=0,
                       frameon=False, ncol=ncol)


def bytes_panel(ax, steps: list, records: list[dict]) -> None:
    read, written = ([r.get(key, 0) / GB for r in records] for key in ("read_bytes", "write_bytes"))
    if len(steps) > DENSE:
        ax.plot(steps, read, label="read")
        ax.plot(steps, written, label="written")
    else:
        width = 0.4
        ax.bar([s - width / 2 for s in steps], read, width, label="read")
        ax.bar([s + width / 2 for s in steps], written, width, label="written")
    ax.set_ylabel("GB per step")
    ax.set_ylim(bottom=0)
    axes = [ax]
    if has(records, "loss"):
        loss = ax.twinx()
        loss.plot([s for s, r in zip(steps, records) if "loss" in r], [r["loss"] for r in records if "loss" in r],
                  color="black", marker="o", label="loss")
        loss.set_ylabel("loss")
        axes.append(loss)
    legend(axes)


def time_panel(ax, steps: list, records: list[dict]) -> None:
    for key, label in (("step_seconds", "step"), ("stall_seconds", "stall (waiting for parameters)"),
                       ("optimizer_seconds", "optimizer")):
        if has(records, key):
            ax.plot(steps, [r.get(key, 0.0) for r in records], marker=".", label=label)
    ax.set_ylabel("seconds per step")
    ax.set_ylim(bottom=0)
    axes = [ax]
    busy = [(s, r["io_busy_seconds"] / r["step_seconds"]) for s, r in zip(steps, records)
            if "io_busy_seconds" in r and r.get("step_seconds", 0) > 0]
    if busy:
        workers = ax.twinx()
        workers.plot([s for s, _ in busy], [b for _, b in busy], color="tab:purple", linestyle=":", marker="x",
                     label="I/O workers busy, average (right axis)")
        workers.set_ylabel("I/O workers busy, average\n(summed busy s / step s)", color="tab:purple")
        workers.tick_params(axis="y", colors="tab:purple")
        workers.set_ylim(bottom=0)
        axes.append(workers)
    legend(axes)


def memory_panel(ax, steps: list, records: list[dict]) -> None:
    below = [0.0] * len(records)
    for key, label, color in MEMORY_PARTS:
        if has(records, key):
            part = [max(0, r.get(key, 0)) / GIB for r in records]
            top = [b + p for b, p in zip(below, part)]
            if len(steps) > DENSE:
                ax.fill_between(steps, below, top, color=color, linewidth=0, label=label)
            else:
                ax.bar(steps, part, 0.8, bottom=below, color=color, label=label)
            below = top
    for key, label, style, color in MEMORY_LINES:
        if has(records, key):
            ax.plot([s for s, r in zip(steps, records) if key in r], [r[key] / GIB for r in records if key in r],
                    color=color, linestyle=style, marker=".", label=label)
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    legend([ax])


def plot(records: list[dict], out: str, title: str | None = None) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise SystemExit("tools/plot_log.py needs matplotlib: pip install matplotlib") from None
    steps = [r.get("step", i) for i, r in enumerate(records)]
    panels = [bytes_panel, time_panel]
    if any(has(records, key) for key, *_ in MEMORY_PARTS) or any(has(records, key) for key, *_ in MEMORY_LINES):
        panels.append(memory_panel)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), sharex=True, squeeze=False)
    for panel, ax in zip(panels, axes[:, 0]):
        panel(ax, steps, records)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.grid(axis="y", alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if len(records) > DENSE:  # markers would run together into a thick line
        for line in (line for ax in fig.axes for line in ax.get_lines()):
            line.set_marker("")
    what = "bytes moved, time and memory" if memory_panel in panels else "bytes moved and time"
    fig.suptitle(title or f"offload: {what} per step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("log", help="the JSON-lines step log written by offload (OffloadConfig.log_path)")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: the log's name with .png)")
    parser.add_argument("--title", default=None, help="figure title (default: a generic one)")
    args = parser.parse_args(argv)
    out = args.output or (args.log.rsplit(".", 1)[0] + ".png")
    sys.stdout.write(plot(read_log(args.log), out, args.title) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
