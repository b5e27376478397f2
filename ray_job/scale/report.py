"""A sweep's report: scaling.json (strict JSON), scaling.csv, scaling.md and scaling.png.

Everything here reads the sweep record as it is written to scaling.json, so a measured value may be
None (not measured, or a NaN made null by strict JSON): each output prints it as an empty cell or
leaves it out of the plot.
"""

from __future__ import annotations

import io
import math
from typing import Any, Optional

from .. import storage
from ..storage import write_json
from ..train.runlog import csv_text
from . import COLUMN_HELP, COLUMNS, OUTPUTS

HEAD = ["mode", "N", "global batch", "steps", "train s", "wall s", "1st step s", "img/s", "step ms",
        "data ms", "compute ms", "comm wait ms", "optim ms", "speedup", "efficiency"]
STEP_SPLIT = {"data_s_per_step": "data", "compute_s_per_step": "forward+backward",
              "comm_wait_s_per_step": "all-reduce wait", "optim_s_per_step": "optimizer"}


def write_outputs(sweep: dict) -> str:
    """Writes the four files into sweep["sweep_dir"] (a folder or object storage); returns the
    Markdown table."""
    csv_file, json_file, md_file, png_file = (storage.at(sweep["sweep_dir"]).join(n) for n in OUTPUTS)
    write_json(json_file, {**sweep, "columns": COLUMN_HELP})
    csv_file.write_text(csv_text([{k: None if _missing(r.get(k)) else r[k] for k in COLUMNS} for r in sweep["rows"]],
                                 list(COLUMNS)))
    table = markdown(sweep)
    md_file.write_text(table + "\n")
    png = io.BytesIO()
    plot(sweep, png)
    png_file.write_bytes(png.getvalue())
    return table


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "" if _missing(value) else format(value * scale, spec)


def markdown(sweep: dict) -> str:
    cl = sweep["cluster"]
    load = cl.get("driver_host_load_1min") or [None, None]
    lines = [f"# Scaling sweep `{sweep['sweep']}`", "",
             f"{sweep['date']} on {sweep['host']} ({cl['nodes']} node(s), {cl['cpus']:g} CPUs, {cl['gpus']:g} GPUs; "
             f"driver host load {_fmt(load[0], '.1f') or '?'} at start, {_fmt(load[1], '.1f') or '?'} at end)  ",
             f"`{sweep['command']}`", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in sweep["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['workers']} | {r['status']} |" + " |" * (len(HEAD) - 3))
            continue
        cells = [r["mode"], str(r["workers"]), str(r["global_batch"]), str(r["steps"]),
                 *(_fmt(r[k], ".1f") for k in ("train_s", "wall_s", "time_to_first_step_s")),
                 _fmt(r["steady_images_per_s"], ".0f"), *(_fmt(r[k], ".1f", 1e3) for k in ("step_s", *STEP_SPLIT)),
                 _fmt(r["speedup"], ".2f"), _fmt(r["efficiency"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\n{r['mode']} {r['workers']} worker(s) {r['status']}: {r['reason']}"
              for r in sweep["rows"] if r["status"] != "ok"]
    lines += ["", "Speedup = steady img/s / 1 worker's (same mode); efficiency = speedup / N. Step "
              "split: mean ms per step on rank 0; comm wait = DDP backward with minus without "
              "gradient sync. Empty cells: not measured."]
    return "\n".join(lines)


def _points(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(workers, values) of the rows that have `key`: a missing value is no point, not a zero."""
    pts = [(r["workers"], r[key]) for r in rows if not _missing(r.get(key))]
    return [n for n, _ in pts], [v for _, v in pts]


def plot(sweep: dict, path: Any) -> None:
    """The three panels, saved to `path` (a local file name or a binary file object)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in sweep["rows"] if r["status"] == "ok"]
    fig, (ax_t, ax_e, ax_s) = plt.subplots(1, 3, figsize=(16, 4.8))
    for mode, colour in {"strong": "tab:blue", "weak": "tab:orange"}.items():
        pts = [r for r in rows if r["mode"] == mode]
        if not pts:
            continue
        ax_t.plot(*_points(pts, "train_s"), "o-", color=colour, label=f"{mode}: training")
        ax_t.plot(*_points(pts, "wall_s"), "s--", color=colour, alpha=0.5,
                  label=f"{mode}: wall (Ray start, eval)")
        ax_e.plot(*_points(pts, "efficiency"), "o-", color=colour, label=mode)
    ax_e.axhline(1.0, color="grey", lw=0.8)
    ax_t.set(xlabel="workers", ylabel="seconds", title="time for the fixed work")
    ax_e.set(xlabel="workers", ylabel="speedup / workers", title="scaling efficiency", ylim=(0, 1.2))
    for ax in (ax_t, ax_e):
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    labels = [f"{r['mode'][0]}{r['workers']}" for r in rows]
    bottom = [0.0] * len(rows)
    for key, name in STEP_SPLIT.items():
        values = [0.0 if _missing(r.get(key)) else r[key] * 1e3 for r in rows]
        ax_s.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_s.set(ylabel="ms per step (mean, rank 0)", title="where a step goes (s=strong, w=weak; N)")
    if rows:
        ax_s.legend(fontsize=8)
    fig.suptitle(f"{sweep['sweep']} ({sweep['date']}, {sweep['host']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
