"""A search's report, read from its trials' run folders (the record that survives any restart):
tune.csv and tune.md (one row per trial), tune.png, and the `train` command of the best trial.

A trial's status is trial.status_of's, the same the progress lines and counts say.
"""

from __future__ import annotations

import dataclasses
import io
import shlex
from typing import Any, Optional

import pyarrow.fs as pafs

from .. import storage
from ..config import TrainConfig
from ..config.run import RECIPES, UNREAD_BY_DATA
from ..core.flags import flag_name
from ..storage import StorageError
from ..train.runfiles import CONFIG_JSON, METRICS_JSONL
from ..train.runlog import csv_text, read_metrics
from ..config.families import is_user_model
from .options import Search, values_text
from .trial import STOPPED_EARLY, TRIAL_PREFIX, read_summary, status_of

OUTPUTS = ("tune.csv", "tune.md", "tune.png")
COLUMNS = ["trial", "status", "epochs", "best_test_acc", "last_test_acc", "best_metric", "wall_s",
           "train_s", "time_to_first_step_s", "stopped_early", "error"]
# Fields a `train` command never repeats: where it joins, how it prints; the run's place is added.
NOT_REPEATED = ("address", "progress", "storage_path", "name")


def trial_folders(search_dir: storage.Location) -> list[storage.Location]:
    """trial_NNN folders of the search, in order (folders set aside are not trials)."""
    try:
        infos = search_dir.fs.get_file_info(pafs.FileSelector(search_dir.path, allow_not_found=True))
    except OSError as e:
        raise StorageError(f"cannot list {search_dir.uri}: {e}") from None
    names = [i.base_name for i in infos if i.type == pafs.FileType.Directory]
    return [search_dir.join(n) for n in sorted(names) if n.startswith(TRIAL_PREFIX) and n[len(TRIAL_PREFIX):].isdigit()]


def trial_row(folder: storage.Location, names: list[str], metric: str, mode: str,
              errors: dict[str, str]) -> Optional[dict]:
    """One trial's row and its curve (seconds in epochs, test accuracy), from its folder."""
    cfg = read_summary(folder, CONFIG_JSON)
    if cfg is None:
        return None
    summary = read_summary(folder)
    try:
        epochs = read_metrics(folder.join(METRICS_JSONL))
    except (FileNotFoundError, StorageError, ValueError):
        epochs = []
    error = errors.get(folder.name) or (summary or {}).get("error")
    status = status_of(summary, error)
    times = [sum(e.epoch_s for e in epochs[:i + 1]) for i in range(len(epochs))]
    return dict(trial=folder.name, **{n: cfg.get(n) for n in names}, status=status, epochs=len(epochs),
                best_test_acc=max((e.test_acc for e in epochs), default=None),
                last_test_acc=epochs[-1].test_acc if epochs else None,
                best_metric=(max if mode == "max" else min)((getattr(e, metric) for e in epochs), default=None),
                wall_s=(summary or {}).get("wall_s"), train_s=times[-1] if times else None,
                time_to_first_step_s=(summary or {}).get("time_to_first_step_s"),
                stopped_early=status == STOPPED_EARLY, error=error or "",
                run_dir=folder.uri, config=cfg, curve=list(zip(times, (e.test_acc for e in epochs))))


def collect(search_dir: storage.Location, names: list[str], metric: str, mode: str,
            errors: Optional[dict[str, str]] = None) -> list[dict]:
    return [r for f in trial_folders(search_dir) if (r := trial_row(f, names, metric, mode, errors or {}))]


def train_command(cfg: dict, storage_path: str, name: str) -> str:
    """`python -m ray_job train ...` with every flag of this config that is not its recipe's
    default, writing into `storage_path`/`name` (the trial's own folder: it continues there)."""
    recipe = cfg.get("recipe", "default")
    defaults = dataclasses.replace(TrainConfig(), **RECIPES.get(recipe, {})).to_dict()
    args = ["python", "-m", "ray_job", "train"]
    unread = UNREAD_BY_DATA.get(cfg.get("data"), ())
    for key, value in cfg.items():
        if isinstance(value, (list, tuple)):  # a repeated flag (--model-arg): once per item
            value = tuple(value)
        if key in NOT_REPEATED or key in unread or key not in defaults or value == defaults[key] or value is None:
            continue
        if key == "code_dir" and not is_user_model(cfg.get("model", "")):  # where no code of the user's is
            continue
        flag = f"--{flag_name(key)}"
        if isinstance(value, tuple):
            args += [a for item in value for a in (flag, str(item))]
        elif isinstance(value, bool):
            args.append(flag if value else f"--no-{flag_name(key)}")
        else:
            args += [flag, str(value)]  # str(float) gives back the same float
    return shlex.join([*args, "--storage-path", storage_path, "--name", name])


def _cell(value: Any, seconds: bool = False) -> str:
    if value is None or value == "":
        return ""
    if seconds:
        return f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


def markdown(meta: dict, rows: list[dict], names: list[str]) -> str:
    other = [f"best {meta['metric']}"] if meta["metric"] != "test_acc" else []
    head = ["trial", *names, "status", "epochs", "best test acc", "last test acc", *other, "wall s",
            "train s", "1st step s"]
    keys = ["trial", *names, "status", "epochs", "best_test_acc", "last_test_acc",
            *(["best_metric"] if other else []), "wall_s", "train_s", "time_to_first_step_s"]
    lines = [f"# Search `{meta['name']}`", "", f"{meta['date']} on {meta['host']}  ", f"`{meta['command']}`", "",
             meta["how"], "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(r[k], k.endswith("_s")) for k in keys) + " |" for r in rows]
    lines += ["", meta["budget"]]
    lines += [f"\n{r['trial']} failed: {r['error']}" for r in rows if r["error"]]
    if meta.get("best"):
        lines += ["", meta["best"]]
    lines += ["", "wall s: the trial's last start (a resumed trial counts from its resume); train s: "
              "seconds in its epochs (training and evaluation); 1st step s: from the trial's start to its "
              "first training step (Ray Train start-up)."]
    return "\n".join(lines)


def write_report(search: Search, search_dir: storage.Location, meta: dict, errors: dict[str, str]) -> list[dict]:
    """tune.csv, tune.md and tune.png in the search folder, from its trials' run folders; the rows."""
    names = [d.name for d in search.space]
    o = search.opts
    rows = collect(search_dir, names, o.metric, o.direction, errors)
    epochs_run = sum(r["epochs"] for r in rows)
    full = o.num_samples * search.base.epochs
    meta["budget"] = (f"Trial-epochs run: {epochs_run} of {o.num_samples} x {search.base.epochs} = {full} "
                      f"without early stopping; {sum(r['stopped_early'] for r in rows)} trial(s) stopped early, "
                      f"{len(rows)} of {o.num_samples} started.")
    best = (max if o.direction == "max" else min)((r for r in rows if r["best_metric"] is not None),
                                                  key=lambda r: r["best_metric"], default=None)
    if best is not None:
        command = train_command(best["config"], search_dir.uri, best["trial"])
        meta["best"] = (f"Best: {best['trial']} ({values_text({n: best[n] for n in names})}), {o.metric} "
                        f"{best['best_metric']:.4f}. Continue it (more --epochs extend it):\n\n    {command}")
    csv_file, md_file, png_file = (search_dir.join(n) for n in OUTPUTS)
    csv_file.write_text(csv_text(rows, ["trial", *names, *COLUMNS[1:], "run_dir"]))
    table = markdown(meta, rows, names)
    md_file.write_text(table + "\n")
    png = io.BytesIO()
    plot(meta, rows, names, png)
    png_file.write_bytes(png.getvalue())
    print(table, flush=True)
    print(f"search results: {search_dir.uri}/{{{','.join(OUTPUTS)}}}", flush=True)
    return rows


def plot(meta: dict, rows: list[dict], names: list[str], out: Any) -> None:
    """Left: test accuracy against seconds in epochs, a line per trial (x: stopped early). Then one
    panel per searched flag: each trial's best test accuracy against its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(names), figsize=(5.5 * (1 + len(names)), 4.5), squeeze=False)
    ax = axes[0][0]
    for r in rows:
        if r["curve"]:
            xs, ys = zip(*r["curve"])
            line, = ax.plot(xs, ys, "o-", ms=3, label=r["trial"])
            if r["stopped_early"]:
                ax.plot(xs[-1], ys[-1], "x", color=line.get_color(), ms=9, mew=2)
    ax.set(xlabel="seconds in epochs (training + evaluation)", ylabel="test accuracy",
           title="trials (x: stopped early)")
    if rows and len(rows) <= 12:
        ax.legend(fontsize=7)
    colours = {"finished": "tab:green", "stopped early": "tab:red", "interrupted": "tab:orange"}
    for ax, name in zip(axes[0][1:], names):
        for status, colour in colours.items():
            pts = [(r[name], r["best_test_acc"]) for r in rows if r["status"] == status
                   and r["best_test_acc"] is not None and r[name] is not None]
            if pts:
                ax.scatter(*zip(*pts), color=colour, label=status)
        if meta["log_scale"].get(name):
            ax.set_xscale("log")
        ax.set(xlabel=name, ylabel="best test accuracy", title=f"best test accuracy against {name}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{meta['name']} ({meta['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100, format="png")
    plt.close(fig)
