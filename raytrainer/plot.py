"""``raytrainer plot OUTPUT_DIR``: PNGs of a run's training and evaluation curves, or of a search's trials.

A run: ``trainer_state.json`` from the latest committed ``checkpoint-<step>/`` (one with a ``manifest.json``),
from ``OUTPUT_DIR`` itself (``save_state()``) or the final one a run on Ray workers keeps in
``OUTPUT_DIR/.raytrainer/``, whichever has the higher ``global_step``; one PNG per metric family of
``log_history`` against ``step`` (``loss.png`` holds ``loss`` and ``eval_loss``), the loss first, then the
evaluation metrics (not an evaluation's speed), then the rest.

A hyperparameter search: the ``run-<trial id>/trial_summary.json`` files; ``search_objective.png``,
``search_best_so_far.png``, ``search_parallel_coordinates.png`` and ``search_trials.png``.

Only the standard library is imported here; matplotlib is imported when a plot is drawn, and draws with
its Agg renderer on ``Figure`` objects (no pyplot, so the process's matplotlib backend is left alone).
"""

from __future__ import annotations

import json
import math
import os
import re

STATE_NAME = "trainer_state.json"
FINAL_STATE = os.path.join(".raytrainer", STATE_NAME)  # driver/runner.keep_final_state
SUMMARY_NAME = "trial_summary.json"  # raytrainer.search.common.SUMMARY_NAME (not imported: it pulls torch)
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# The entry train() logs once at the end (throughput, FLOPs, mean loss): not a curve.
_SUMMARY_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}
_NOT_METRICS = {"step", "epoch"}
# how fast an evaluation ran, not what it measured: left out
_SPEED_SUFFIXES = ("_runtime", "_samples_per_second", "_steps_per_second")
DIRECTIONS = ("minimize", "maximize")


class PlotError(ValueError):
    """Nothing to plot where asked; the message names the folder and what was looked for."""


# -- finding the data ---------------------------------------------------------------------------------------
def find_trainer_state(output_dir: str) -> str | None:
    """The ``trainer_state.json`` to plot: the latest committed checkpoint's, ``output_dir``'s own
    (``save_state()``) or the one a run on Ray workers keeps at its end (``.raytrainer/``), whichever has the
    higher ``global_step`` (on a tie: ``save_state()``'s, then the final one, then the checkpoint's)."""
    candidates = []
    root, final = os.path.join(output_dir, STATE_NAME), os.path.join(output_dir, FINAL_STATE)
    for rank, path in ((2, root), (1, final)):
        if os.path.isfile(path):
            candidates.append((_global_step(path), rank, path))
    steps = [int(m.group(1)) for name in _listdir(output_dir) if (m := _CHECKPOINT_RE.match(name))]
    for step in sorted(steps, reverse=True):
        folder = os.path.join(output_dir, f"checkpoint-{step}")
        path = os.path.join(folder, STATE_NAME)
        if os.path.isfile(os.path.join(folder, "manifest.json")) and os.path.isfile(path):
            candidates.append((_global_step(path), 0, path))
            break
    return max(candidates)[2] if candidates else None


def find_trial_summaries(output_dir: str) -> list[dict]:
    """The search's trial summaries, in trial order (by the number in the trial id, else by name)."""
    summaries = []
    for name in _listdir(output_dir):
        path = os.path.join(output_dir, name, SUMMARY_NAME)
        if name.startswith("run-") and os.path.isfile(path):
            summary = _read_json(path)
            summary.setdefault("trial_id", name[len("run-"):])
            summaries.append(summary)
    return sorted(summaries, key=lambda s: trial_order_key(str(s["trial_id"])))


def trial_order_key(trial_id: str) -> tuple:
    return (0, int(trial_id), "") if trial_id.isdigit() else (1, 0, trial_id)


def _listdir(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise PlotError(f"cannot read {path}: {exc}") from None


def _global_step(path: str) -> int:
    return int(_read_json(path).get("global_step") or 0)


def _number(value) -> float | None:
    """A finite float, or None for anything else (strings, bools, lists, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


# -- pure helpers ------------------------------------------------------------------------------------------
def metric_series(log_history: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """``{metric: (steps, values)}`` for every numeric metric of ``log_history``, except ``step``, ``epoch``,
    an evaluation's speed (``eval_runtime``, ``eval_samples_per_second``, ...) and the end-of-training
    summary entry."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        step = _number(entry.get("step"))
        if step is None or _SUMMARY_KEYS & entry.keys():
            continue
        for key, value in entry.items():
            value = _number(value)
            if key not in _NOT_METRICS and not key.endswith(_SPEED_SUFFIXES) and value is not None:
                steps, values = series.setdefault(key, ([], []))
                steps.append(int(step))
                values.append(value)
    return series


def metric_families(names) -> dict[str, list[str]]:
    """``{file stem: metrics}``: ``x`` and ``eval_x`` share axes, named ``x``; a lone ``eval_x`` keeps its
    name. The loss comes first, then the evaluation metrics, then the rest."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names, key=lambda n: n.startswith("eval_")):  # a training metric before its eval_
        groups.setdefault(name.removeprefix("eval_"), []).append(name)
    families = {base if base in group else group[0]: group for base, group in groups.items()}
    # the loss first, then what evaluations measured, then the rest (learning rate, gradient norm), by name
    order = lambda stem: (stem != "loss", not any(n.startswith("eval_") for n in families[stem]), stem)  # noqa: E731
    return {stem: families[stem] for stem in sorted(families, key=order)}


def first_objective(objective) -> float | None:
    """A trial's objective as one number: the first one of a multi-objective list."""
    if isinstance(objective, (list, tuple)):
        objective = objective[0] if objective else None
    return _number(objective)


def best_so_far(values: list[float | None], direction: str = "minimize") -> list[float | None]:
    """The best value among ``values[:i + 1]`` for each i; None values are skipped (None until a first)."""
    if direction not in DIRECTIONS:
        raise PlotError(f"direction {direction!r}: use 'minimize' or 'maximize'")
    better = min if direction == "minimize" else max
    out, best = [], None
    for value in values:
        if value is not None:
            best = value if best is None else better(best, value)
        out.append(best)
    return out


def normalise(values: list) -> tuple[list[float | None], list[tuple[float, str]]]:
    """One parallel-coordinates axis: values in [0, 1] (None stays None) and ``(position, label)`` ticks.
    Numbers are scaled linearly, or logarithmically when all positive and spanning two decades or more;
    anything else is categorical, mapped to its index among the sorted distinct values."""
    present = [v for v in values if v is not None]
    numbers = [_number(v) for v in present]
    if present and all(n is not None for n in numbers):
        lo, hi = min(numbers), max(numbers)
        log = lo > 0 and hi / lo > 99.99
        scale = math.log10 if log else float
        span = scale(hi) - scale(lo)
        pos = [None if v is None else (scale(float(v)) - scale(lo)) / span if span else 0.5 for v in values]
        ticks = [(0.0, f"{lo:.3g}"), (1.0, f"{hi:.3g}")] if span else [(0.5, f"{lo:.3g}")]
        return pos, ticks
    keys = [None if v is None else json.dumps(v, sort_keys=True, default=str) for v in values]
    categories = sorted({k for k in keys if k is not None})
    at = {c: i / (len(categories) - 1) if len(categories) > 1 else 0.5 for i, c in enumerate(categories)}
    return [None if k is None else at[k] for k in keys], [(at[c], c.strip('"')) for c in categories]


# -- drawing -----------------------------------------------------------------------------------------------
def _figure(title: str, xlabel: str, ylabel: str = ""):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, out_dir: str, stem: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, re.sub(r"[^A-Za-z0-9._-]+", "_", stem) + ".png")
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _marker(n: int) -> str:
    return "o" if n <= 50 else ""


def plot_run(output_dir: str, out_dir: str) -> list[str]:
    """One PNG per metric family of the run's ``trainer_state.json``; returns the paths written."""
    path = find_trainer_state(output_dir)
    if path is None:
        raise PlotError(f"{output_dir} holds no {STATE_NAME} (looked for {output_dir}/{STATE_NAME}, "
                        f"{output_dir}/{FINAL_STATE} and "
                        f"committed {output_dir}/checkpoint-<step>/{STATE_NAME})")
    state = _read_json(path)
    series = metric_series(state.get("log_history") or [])
    if not series:
        raise PlotError(f"{path} logs no numeric metric (its log_history is empty)")
    written = []
    for stem, members in metric_families(series).items():
        source = os.path.relpath(path, output_dir)
        fig, ax = _figure(f"{stem} ({source}, step {state.get('global_step', '?')})", "step", stem)
        for name in members:
            steps, values = series[name]
            ax.plot(steps, values, marker=_marker(len(steps)), markersize=3, label=name)
        if len(members) > 1:
            ax.legend()
        written.append(_save(fig, out_dir, stem))
    return written


def plot_search(output_dir: str, out_dir: str, direction: str = "minimize") -> list[str]:
    """The search's plots from its ``run-<trial id>/trial_summary.json`` files; returns the paths written."""
    trials = find_trial_summaries(output_dir)
    if not trials:
        raise PlotError(f"{output_dir} holds no run-<trial id>/{SUMMARY_NAME}")
    best_so_far([], direction)  # checks the direction before drawing anything
    ids = [str(t["trial_id"]) for t in trials]
    objectives = [first_objective(t.get("objective")) for t in trials]
    pruned = [bool(t.get("pruned")) for t in trials]
    multi = max((len(t["objective"]) for t in trials if isinstance(t.get("objective"), list)), default=0)
    what = f"objective 1 of {multi}" if multi > 1 else "objective"
    written = []

    fig, ax = _figure(f"{what} per trial", "trial", what)
    _scatter_trials(ax, objectives, pruned, size=50)
    _trial_ticks(ax, ids)
    written.append(_save(fig, out_dir, "search_objective"))

    fig, ax = _figure(f"best {what} so far ({direction}; pruned trials excluded)", "trial", what)
    completed = [None if p else o for o, p in zip(objectives, pruned)]
    best = [math.nan if b is None else b for b in best_so_far(completed, direction)]
    ax.step(range(len(trials)), best, where="post", color="C2", label="best so far")
    _scatter_trials(ax, objectives, pruned, size=20)
    _trial_ticks(ax, ids)
    written.append(_save(fig, out_dir, "search_best_so_far"))

    names = sorted({k for t in trials for k in (t.get("hyperparameters") or {})})
    if names:
        written.append(_parallel_coordinates(trials, names, objectives, pruned, what, out_dir))

    if any(t.get("evaluations") for t in trials):
        fig, ax = _figure(f"{what} per evaluation", "step", what)
        for i, (trial, is_pruned) in enumerate(zip(trials, pruned)):
            evaluations = trial.get("evaluations") or []
            points = [(e.get("step"), first_objective(e.get("objective"))) for e in evaluations]
            points = [(s, o) for s, o in points if s is not None and o is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, linestyle="--" if is_pruned else "-",
                        color=f"C{i % 10}", label=f"trial {ids[i]}" + (" (pruned)" if is_pruned else ""))
        if ax.lines and len(trials) <= 20:
            ax.legend(fontsize="small")
        written.append(_save(fig, out_dir, "search_trials"))
    return written


def _scatter_trials(ax, objectives, pruned, size: int) -> None:
    """Each trial's objective at its position in trial order: completed trials as dots, pruned as crosses."""
    for is_pruned, style in ((False, {"marker": "o", "color": "C0", "label": "completed"}),
                             (True, {"marker": "x", "color": "C3", "label": "pruned"})):
        points = [(i, o) for i, o in enumerate(objectives) if pruned[i] == is_pruned and o is not None]
        if points:
            ax.scatter(*zip(*points), s=size, **style)
    if any(o is not None for o in objectives):
        ax.legend()


def _trial_ticks(ax, ids: list[str]) -> None:
    ax.set_xticks(range(len(ids)), ids, rotation=45 if len(ids) > 10 else 0, fontsize="small")


def _parallel_coordinates(trials, names, objectives, pruned, what, out_dir) -> str:
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    fig, ax = _figure(f"hyperparameters, coloured by {what} (dashed: pruned)", "", "normalised value")
    ax.grid(False)
    axes = [normalise([(t.get("hyperparameters") or {}).get(n) for t in trials]) for n in names]
    known = [o for o in objectives if o is not None]
    norm = Normalize(min(known, default=0), max(known, default=1))
    cmap = colormaps["viridis"]
    for i, (objective, is_pruned) in enumerate(zip(objectives, pruned)):
        ys = [math.nan if positions[i] is None else positions[i] for positions, _ in axes]
        ax.plot(range(len(names)), ys, marker="o", linestyle="--" if is_pruned else "-", alpha=0.8,
                color="grey" if objective is None else cmap(norm(objective)))
    for j, (_, ticks) in enumerate(axes):
        ax.axvline(j, color="black", linewidth=0.8)
        for y, label in ticks:
            ax.annotate(label, (j, y), xytext=(4, 0), textcoords="offset points", fontsize="small",
                        va="center")
    ax.set_xticks(range(len(names)), names, rotation=30 if len(names) > 5 else 0)
    ax.set_xlim(-0.2, len(names) - 0.5)
    ax.set_ylim(-0.05, 1.05)
    fig.colorbar(ScalarMappable(norm, cmap), ax=ax, label=what)
    return _save(fig, out_dir, "search_parallel_coordinates")


def plot(output_dir: str, out_dir: str | None = None, direction: str = "minimize") -> list[str]:
    """A search's plots when ``output_dir`` holds trial summaries, else the run's; returns the paths."""
    if not os.path.isdir(output_dir):
        raise PlotError(f"{output_dir} is not a folder")
    out_dir = out_dir or os.path.join(output_dir, "plots")
    if find_trial_summaries(output_dir):
        return plot_search(output_dir, out_dir, direction)
    if find_trainer_state(output_dir) is None:
        raise PlotError(f"nothing to plot in {output_dir}: it holds neither a {STATE_NAME} (looked for "
                        f"{STATE_NAME} there, in {FINAL_STATE} and in committed checkpoint-<step>/ folders) "
                        f"nor hyperparameter search trials (run-<trial id>/{SUMMARY_NAME})")
    return plot_run(output_dir, out_dir)
