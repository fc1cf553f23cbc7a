"""Plots and a markdown report of a run directory written by ``rlhf iterate`` or ``rlhf demo`` (``rlhf report``).

    rlhf report runs/my-run
    rlhf report --run-dir runs/my-run --output reports/my-run

Reads (every part may be missing; a partial run gives a report of what exists, a directory holding none of it
is an error):

    RUN/iter_0/eval/results.json             evaluation of the starting policy
    RUN/iter_<t>/{generate,score,filter,train,eval}/manifest.json   wall times (t = 1..T)
    RUN/iter_<t>/generate/                   the sampled responses (response_token_ids, finish_reasons)
    RUN/iter_<t>/train/metrics.jsonl         training curves of iteration t (loss, logp drift, accuracy)
    RUN/iter_<t>/eval/results.json           held-out mean reward, win rate, response length of policy t
    RUN/sft/, RUN/reward_model/              optional training runs (manifest.json, metrics.jsonl)
    RUN/summary.json                         optional (rlhf demo), shown as is
    RUN/steps.jsonl                          each launched stage's start and end (the schedule plot)

Iteration t's train made policy t and its eval evaluated policy t; its generate sampled from the policy its manifest
names: policy t-1 in a sequential run, t-2 in an overlapped one (``overlap: 1``), policy 0 at first.

Writes (``--output``, default the run directory; each file replaced atomically):

    OUT/report.md                            per-iteration table, SFT / reward-model lines, links to the plots
    OUT/plots/reward_per_iteration.png       held-out mean reward +- stderr (and win rates, raw and LC) per iteration
    OUT/plots/loss.png                       train / eval loss on one global step axis (and SFT / RM curves)
    OUT/plots/logp_drift.png                 chosen / rejected log-ratio to the sampling policy
    OUT/plots/response_length.png            mean response tokens and fraction stopped, per policy
    OUT/plots/judge_and_pass_at_k.png        the LLM judge's win rates and pass@k per iteration (only with them)
    OUT/plots/lm_eval.png                    lm-eval metrics +- stderr per iteration (only with rlhf eval --lm-eval)
    OUT/plots/schedule.png                   each stage's start and end on one time axis, per side of an overlapped
                                             run (and --compare's run below it)

A plot whose data is absent is not drawn (an older copy is removed) and report.md says why; the two plots of options
a run may not use are left out of report.md without a word when it did not use them. The plots need
matplotlib: ``pip install 'rlhf-pipeline[report]'``.
"""

from __future__ import annotations

import sys
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rlhf_pipeline.config import option
from rlhf_pipeline.datasets_io import write_text_atomic
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import (EVAL_RESULTS, ITER_DIR, ITERATE_CONFIG, ITERATION_STAGES, MANIFEST, METRICS,
                                  PLOTS_DIR, REPORT, STEPS_LOG, SUMMARY)
from rlhf_pipeline.stages import run_stage

log = logging.getLogger(__name__)

TRAINING_RUNS = {"sft": "SFT", "reward_model": "Reward model"}
MISSING = "–"


@dataclass(kw_only=True)
class ReportConfig:
    """Plots (PNG) and report.md of a run directory written by rlhf iterate or rlhf demo."""

    run_dir: str = option(
        help="The run directory (holding iter_<t>/, sft/, reward_model/). May also be given as the first "
        "positional argument: rlhf report RUN_DIR."
    )
    output: Optional[str] = option(
        None, help="Directory for report.md and plots/ (default: the run directory itself).", semantic=False
    )
    compare: Optional[str] = option(
        None, help="Another run directory whose schedule (plots/schedule.png) is drawn below this run's, on the same "
        "time axis: an overlapped run against a sequential one, say.", semantic=False
    )


# ----------------------------------------------------------------------------------------------------------------
# Reading the run directory


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: not valid JSON ({e}); delete it or rerun the stage that wrote it") from None


def _read_jsonl(path: Path, step_type: type) -> list[dict[str, Any]]:
    """The records of a JSON-lines log whose every record has a ``step`` of ``step_type``; a cut-off last line (a
    run still writing) is skipped."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for k, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                log.warning("%s: skipping its last line, cut off (%s)", path, e)
                continue
            raise PipelineError(
                f"{path}: line {k + 1} is not valid JSON ({e}); delete the line or rerun the training"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), step_type):
            raise PipelineError(f"{path}: line {k + 1} is not an object with a \"step\" of type "
                                f"{step_type.__name__}; delete the line")
        records.append(record)
    return records


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (an integer ``step`` each)."""
    return _read_jsonl(path, int)


def _generate_stats(path: Path) -> Optional[dict[str, Any]]:
    """Mean response length (tokens) and fraction stopped of a generate dataset (None when there is none)."""
    if not path.is_dir() or not any((path / name).exists() for name in ("dataset_info.json", "state.json",
                                                                         "dataset_dict.json")):
        return None
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - any failure to read means the same to the user
        raise PipelineError(f"{path}: not a readable datasets directory ({e}); rerun rlhf generate") from None
    if isinstance(ds, DatasetDict):
        if len(ds) != 1:
            return None
        (ds,) = ds.values()
    stats: dict[str, Any] = {"num_prompts": ds.num_rows, "num_responses": None,
                             "response_tokens_mean": None, "stop_fraction": None}
    arrow = ds.with_format("arrow")

    def flat(column: str) -> pa.Array:
        values = arrow[column]
        if isinstance(values, pa.Table):
            values = values.column(0)
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        return pc.list_flatten(values)

    if "response_token_ids" in ds.column_names:
        lengths = pc.list_value_length(flat("response_token_ids"))
        stats["num_responses"] = len(lengths)
        if len(lengths):
            stats["response_tokens_mean"] = pc.mean(lengths).as_py()
    if "finish_reasons" in ds.column_names:
        reasons = flat("finish_reasons")
        stats["num_responses"] = stats["num_responses"] or len(reasons)
        if len(reasons):
            stats["stop_fraction"] = pc.sum(pc.equal(reasons, "stop")).as_py() / len(reasons)
    return stats


def _has_data(entry: dict[str, Any]) -> bool:
    return bool(entry.get("metrics") or entry.get("eval") or entry.get("generate")
                or any(entry.get("manifests", {}).values()) or entry.get("manifest"))


def read_schedule(run_dir: Path) -> list[dict[str, Any]]:
    """The launched stages of ``RUN/steps.jsonl`` that record their start and end (each launch of a resumed stage
    is its own record), as ``{"step", "lane", "started", "ended", "rc"}``."""
    records = []
    for record in _read_jsonl(Path(run_dir) / STEPS_LOG, str):
        if isinstance(record.get("started"), (int, float)) and isinstance(record.get("ended"), (int, float)):
            records.append({key: record.get(key) for key in ("step", "lane", "started", "ended", "rc")})
    return records


def collect(run_dir: Path) -> dict[str, Any]:
    """Everything the report shows, read from ``run_dir``.

    Returns ``{"run_dir", "iterations", "sft", "reward_model", "summary"}``. ``iterations`` is sorted by t, one
    dict per ``iter_<t>/`` with: ``iteration``; ``eval`` (results.json or None); ``manifests`` (stage -> manifest
    or None); ``metrics`` (train/metrics.jsonl records); ``max_step`` (its largest step, 0 without metrics);
    ``step_offset`` (the sum of the earlier iterations' ``max_step``: global step = step_offset + step);
    ``generate`` (``num_prompts``, ``num_responses``, ``response_tokens_mean``, ``stop_fraction`` of the generate
    dataset, or None). ``sft`` / ``reward_model`` are ``{"manifest", "metrics"}`` or None.
    Raises PipelineError when ``run_dir`` is not a directory or holds none of these.
    """
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise PipelineError(
            f"{run_dir}: no such directory; pass the --output directory of rlhf iterate or rlhf demo"
        )
    found = []
    for child in run_dir.iterdir():
        match = ITER_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    iterations = []
    offset = 0
    start = (_read_json(run_dir / ITERATE_CONFIG) or {}).get("model")  # the starting policy, where iterate recorded it
    for t, path in sorted(found):
        metrics = _read_metrics(path / "train" / METRICS)
        max_step = max((r["step"] for r in metrics), default=0)
        iterations.append({
            "iteration": t,
            "sampler": sampler_index(t, _read_json(path / "generate" / MANIFEST),
                                     _read_json(path / "train" / MANIFEST), run_dir, start),
            "path": str(path),
            "eval": _read_json(path / "eval" / EVAL_RESULTS),
            "manifests": {stage: _read_json(path / stage / MANIFEST) for stage in ITERATION_STAGES},
            "metrics": metrics,
            "max_step": max_step,
            "step_offset": offset,
            "generate": _generate_stats(path / "generate"),
        })
        offset += max_step
    runs = {}
    for name in TRAINING_RUNS:
        entry = {"manifest": _read_json(run_dir / name / MANIFEST),
                 "metrics": _read_metrics(run_dir / name / METRICS)}
        runs[name] = entry if _has_data(entry) else None
    data = {"run_dir": str(run_dir), "iterations": iterations, **runs,
            "summary": _read_json(run_dir / SUMMARY), "schedule": read_schedule(run_dir)}
    if not any(_has_data(it) for it in iterations) and not any(runs.values()):
        raise PipelineError(
            f"{run_dir}: holds no run data (no iter_<t>/eval/results.json, iter_<t>/train/metrics.jsonl, "
            "iter_<t>/<stage>/manifest.json, sft/ or reward_model/); pass the --output directory of rlhf iterate "
            "or rlhf demo"
        )
    return data


def sampler_index(t: int, generate_manifest: Optional[dict[str, Any]], train_manifest: Optional[dict[str, Any]],
                  run_dir: Path, start_model: Optional[str] = None) -> int:
    """The policy iteration t's generate sampled from, as its manifest names it: 0 where that is ``start_model``
    (the run's starting policy, as iterate.json records it), ``k`` where it is this run's ``<run>/iter_<k>/train``
    (k < t; an overlapped run's is t - 2), else 0. The run is known by its directory's name; in a run renamed since,
    an ``iter_<k>/train`` of another name is taken as its own unless the train manifest's ``training.sampler`` says
    the sampler was the policy trained (then t - 1). Without a manifest that names it, t - 1, as a sequential run
    plans it."""
    named = ((generate_manifest or {}).get("config") or {}).get("model")
    if not named:
        return t - 1
    if start_model is not None and str(named) == str(start_model):  # another run's iter_k/train, say
        return 0
    model = Path(str(named))
    match = ITER_DIR.match(model.parent.name)
    if not (match and model.name == "train" and int(match.group(1)) < t):
        return 0
    if model.parent.parent.name == run_dir.resolve().name:
        return int(match.group(1))
    sampler = ((train_manifest or {}).get("training") or {}).get("sampler") or {}
    return t - 1 if sampler.get("is_trained_policy") else int(match.group(1))


# ----------------------------------------------------------------------------------------------------------------
# Small helpers


def fmt(x: Any) -> str:
    """A number with 4 significant digits (no exponent for large values); MISSING for None."""
    if x is None:
        return MISSING
    if isinstance(x, bool) or isinstance(x, int):
        return str(x)
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if abs(x) >= 1e4:
        return f"{x:.0f}"
    return f"{x:.4g}"


def _series(records: list[dict[str, Any]], key: str, offset: int = 0) -> tuple[list[int], list[float]]:
    points = [(offset + r["step"], float(r[key])) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _first_last(records: list[dict[str, Any]], key: str) -> tuple[Any, Any]:
    values = [r[key] for r in records if r.get(key) is not None]
    return (values[0], values[-1]) if values else (None, None)


def _scorers(iterations: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for it in iterations:
        for name in ((it["eval"] or {}).get("scores") or {}):
            if name not in names:
                names.append(name)
    return names


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PipelineError(
            "rlhf report draws its plots with matplotlib, which is not installed; "
            "pip install 'rlhf-pipeline[report]' (or pip install matplotlib)"
        ) from None


def _figure(nrows: int, ncols: int, width: float = 6.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global state
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _save(fig, path: Path) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# Plots: each returns None when drawn, or the reason it was not


def _plot_rewards(data: dict[str, Any], path: Path) -> Optional[str]:
    evals = [(it["iteration"], it["eval"]) for it in data["iterations"] if it["eval"]]
    scorers = _scorers(data["iterations"])
    if not scorers:
        return "no iter_<t>/eval/results.json with scores in the run"
    with_win = [s for s in scorers if any(_compared((e.get("scores") or {}).get(s, {})) for _, e in evals)]
    fig, axes = _figure(2 if with_win else 1, len(scorers))
    fig.suptitle("Held-out reward per iteration")
    for col, name in enumerate(scorers):
        points = [(t, e["scores"][name]) for t, e in evals if name in (e.get("scores") or {})]
        ax = axes[0][col]
        xs = [t for t, s in points if s.get("mean") is not None]
        ys = [s["mean"] for _, s in points if s.get("mean") is not None]
        errs = [s.get("stderr") or 0.0 for _, s in points if s.get("mean") is not None]
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=4, label="policy (mean ± stderr)")
        base = [(t, s["baseline_mean"], s.get("baseline_stderr") or 0.0) for t, s in points
                if s.get("baseline_mean") is not None]
        if base:
            ax.errorbar([b[0] for b in base], [b[1] for b in base], yerr=[b[2] for b in base], marker="s",
                        linestyle="--", color="gray", capsize=4, label="baseline")
        ax.set_title(f"mean reward: {name}")
        ax.set_xlabel("iteration (policy after t iterations; 0 = start)")
        ax.set_ylabel("mean reward")
        ax.set_xticks(sorted({t for t, _ in points}))
        ax.grid(alpha=0.3)
        ax.legend()
        if with_win:
            ax = axes[1][col]
            drawn = _plot_win_rates(ax, [(t, s, "baseline") for t, s in points]
                                    + [(t, s["reference"], "references") for t, s in points if s.get("reference")])
            if not drawn:
                ax.text(0.5, 0.5, "no baseline", ha="center", va="center", transform=ax.transAxes)
            ax.set_ylim(0, 1)
            ax.set_title(f"win rate, raw and length-controlled: {name}")
            ax.set_xlabel("iteration")
            ax.set_ylabel("win rate")
            ax.grid(alpha=0.3)
    _save(fig, path)
    return None


def _compared(s: dict[str, Any]) -> bool:
    """Whether a scorer's numbers compare the policy with anything (a baseline or reference answers)."""
    return s.get("win_rate") is not None or (s.get("reference") or {}).get("win_rate") is not None


def _plot_win_rates(ax, points: list[tuple[int, dict[str, Any], str]]) -> bool:
    """The raw win rate (solid) and the length-controlled one (dashed, ± its standard error) per iteration, for
    each side compared with ("baseline", "references", "judge vs ..."). A reward model's length-controlled rate is
    fitted on Bradley-Terry preferences, not on the counted wins: their mean, the fit's own raw figure, is drawn
    too (dotted), so that the gap between the solid and dashed lines is not read as length's alone. Returns whether
    anything was drawn."""
    sides = list(dict.fromkeys(side for _, _, side in points))
    drawn = False
    for color, side in zip(("tab:green", "tab:purple", "tab:orange", "tab:brown"), sides):
        mine = [(t, s) for t, s, other in points if other == side]
        raw = [(t, s["win_rate"]) for t, s in mine if s.get("win_rate") is not None]
        lc = [(t, s["lc_win_rate"], s.get("lc_stderr") or 0.0) for t, s in mine if s.get("lc_win_rate") is not None]
        preference = [(t, s["length_controlled"]["raw_win_rate"]) for t, s in mine
                      if (s.get("length_controlled") or {}).get("preferences") == "bradley-terry"]
        if raw:
            ax.plot([w[0] for w in raw], [w[1] for w in raw], marker="o", color=color, label=f"vs {side}")
        if preference:
            ax.plot([w[0] for w in preference], [w[1] for w in preference], marker=".", linestyle=":", color=color,
                    label=f"vs {side}, mean preference (what length is controlled on)")
        if lc:
            ax.errorbar([w[0] for w in lc], [w[1] for w in lc], yerr=[w[2] for w in lc], marker="^", capsize=4,
                        linestyle="--", color=color, label=f"vs {side}, length-controlled")
        drawn = drawn or bool(raw or lc)
    if drawn:
        ax.axhline(0.5, color="gray", linestyle=":", label="0.5 (even)")
        ax.set_xticks(sorted({t for t, _, _ in points}))
        ax.legend(fontsize="small")
    return drawn


def _plot_judge_and_pass(data: dict[str, Any], path: Path) -> Optional[str]:
    """The LLM judge's win rates (raw and length-controlled) and every verifiable scorer's pass@k, per iteration."""
    evals = [(it["iteration"], it["eval"]) for it in data["iterations"] if it["eval"]]
    judged = [(t, e["judge"][side], f"{side} (judge)") for t, e in evals for side in ("baseline", "reference")
              if (e.get("judge") or {}).get(side)]
    passing = [name for name in _scorers(data["iterations"])
               if any((e.get("scores") or {}).get(name, {}).get("pass_at_k") for _, e in evals)]
    if not judged and not passing:
        return "no LLM judge (rlhf eval --judge) and no pass@k (a 0/1 reward function with --n > 1) in the run"
    fig, axes = _figure(1, bool(judged) + len(passing))
    col = 0
    if judged:
        ax = axes[0][col]
        _plot_win_rates(ax, judged)
        ax.set_ylim(0, 1)
        models = [e["judge"]["model"] for _, e in evals if (e.get("judge") or {}).get("model")]
        ax.set_title(f"LLM judge: {models[-1] if models else ''}")
        ax.set_xlabel("iteration")
        ax.set_ylabel("win rate")
        ax.grid(alpha=0.3)
        col += 1
    for name in passing:
        ax = axes[0][col]
        ks = sorted({int(k) for _, e in evals for k in ((e.get("scores") or {}).get(name, {}).get("pass_at_k") or {})})
        for kind, marker in (("pass_at_k", "o"), ("maj_at_k", "s")):
            for k in ks:
                pts = [(t, v[str(k)]) for t, e in evals
                       if (v := ((e.get("scores") or {}).get(name, {}).get(kind) or {})) and str(k) in v]
                if pts:
                    ax.errorbar([p[0] for p in pts], [p[1]["mean"] for p in pts],
                                yerr=[p[1].get("stderr") or 0.0 for p in pts], marker=marker, capsize=4,
                                linestyle="-" if kind == "pass_at_k" else ":",
                                label=f"{kind.split('_')[0]}@{k}")
        ax.set_ylim(0, 1)
        ax.set_title(f"pass@k: {name}")
        ax.set_xlabel("iteration")
        ax.set_ylabel("fraction of prompts")
        ax.set_xticks(sorted({t for t, _ in evals}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        col += 1
    _save(fig, path)
    return None


def _iteration_boundaries(ax, iterations: list[dict[str, Any]]) -> None:
    """Dashed lines between iterations and an "iter t" label over each iteration's span of global steps."""
    trained = [it for it in iterations if it["metrics"]]
    lo = min(it["step_offset"] for it in trained)
    hi = max(it["step_offset"] + it["max_step"] for it in trained)
    if hi > lo:  # show every iteration's whole span, so its label sits over it
        ax.set_xlim(lo - 0.02 * (hi - lo), hi + 0.02 * (hi - lo))
    for k, it in enumerate(trained):
        start, end = it["step_offset"], it["step_offset"] + it["max_step"]
        if k > 0:
            ax.axvline(start, color="gray", linestyle="--", linewidth=1)
        ax.text((start + end) / 2, 0.98, f"iter {it['iteration']}", transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=8, color="gray", in_layout=False, clip_on=True)


def _visible(style: dict[str, Any], xs: list[int]) -> dict[str, Any]:
    """A single point draws nothing without a marker: give it one."""
    return style if len(xs) > 1 or "marker" in style else {**style, "marker": "o"}


def _plot_curves(ax, iterations: list[dict[str, Any]], lines: list[tuple[str, str, dict[str, Any]]]) -> bool:
    """Plot each (metric key, label, style) on the global step axis, one segment per iteration. True if any."""
    drawn = False
    for key, label, style in lines:
        first = True
        for it in iterations:
            xs, ys = _series(it["metrics"], key, it["step_offset"])
            if xs:
                ax.plot(xs, ys, label=label if first else None, **_visible(style, xs))
                first = False
                drawn = True
    return drawn


def _plot_training_run(ax, name: str, run: dict[str, Any]) -> bool:
    records = run["metrics"]
    drawn = False
    for key, label, style in (("loss/train", "train loss", {"color": "tab:blue"}),
                              ("loss/eval", "eval loss", {"color": "tab:orange", "marker": "o"})):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=label, **_visible(style, xs))
            drawn = True
    handles, labels = ax.get_legend_handles_labels()
    acc = [("reward/accuracy", "eval accuracy", {"color": "tab:green", "marker": "o"}),
           ("reward/train_accuracy", "train accuracy", {"color": "tab:green", "alpha": 0.5})]
    if any(_series(records, key)[0] for key, _, _ in acc):
        twin = ax.twinx()
        for key, label, style in acc:
            xs, ys = _series(records, key)
            if xs:
                twin.plot(xs, ys, label=label, linestyle="--", **_visible(style, xs))
        twin.set_ylabel("accuracy")
        twin.set_ylim(0, 1)
        h2, l2 = twin.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
        drawn = True
    ax.set_title(f"{TRAINING_RUNS[name]} training ({name}/)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if handles:  # below the axes: loc="best" would not see the twin axis' lines
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
    return drawn


def _plot_loss(data: dict[str, Any], path: Path) -> Optional[str]:
    iterations = data["iterations"]
    policy = any(r.get("loss/train") is not None or r.get("loss/eval") is not None
                 for it in iterations for r in it["metrics"])
    extra = [name for name in TRAINING_RUNS if data.get(name) and any(
        r.get(k) is not None for r in data[name]["metrics"] for k in ("loss/train", "loss/eval"))]
    if not policy and not extra:
        return "no loss/train or loss/eval in iter_<t>/train/metrics.jsonl, sft/ or reward_model/"
    panels = int(policy) + len(extra)
    fig, axes = _figure(1, panels, width=7.0 if policy else 6.0)
    fig.suptitle("Training loss")
    col = 0
    if policy:
        ax = axes[0][0]
        _plot_curves(ax, iterations, [
            ("loss/train", "train loss", {"color": "tab:blue"}),
            ("loss/eval", "eval loss", {"color": "tab:orange", "marker": "o"}),
        ])
        _iteration_boundaries(ax, iterations)
        ax.set_title("policy training, all iterations")
        ax.set_xlabel("global optimizer step (iterations concatenated)")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        col = 1
    for name in extra:
        _plot_training_run(axes[0][col], name, data[name])
        col += 1
    _save(fig, path)
    return None


LOGP_LINES = [
    ("logp/train_chosen_logratio", "chosen (train)", {"color": "tab:blue"}),
    ("logp/train_rejected_logratio", "rejected (train)", {"color": "tab:red"}),
    ("logp/chosen_logratio", "chosen (eval)", {"color": "tab:blue", "marker": "o", "linestyle": ":"}),
    ("logp/rejected_logratio", "rejected (eval)", {"color": "tab:red", "marker": "s", "linestyle": ":"}),
]


def _plot_logp(data: dict[str, Any], path: Path) -> Optional[str]:
    iterations = data["iterations"]
    keys = [key for key, _, _ in LOGP_LINES]
    if not any(r.get(k) is not None for it in iterations for r in it["metrics"] for k in keys):
        return "no logp/*_logratio in iter_<t>/train/metrics.jsonl"
    fig, axes = _figure(1, 1, width=8.0, height=4.5)
    ax = axes[0][0]
    _plot_curves(ax, iterations, LOGP_LINES)
    ax.axhline(0.0, color="black", linewidth=0.8)
    _iteration_boundaries(ax, iterations)
    ax.set_title("Drift from the sampling policy (chosen / rejected responses)")
    ax.set_xlabel("global optimizer step (iterations concatenated)")
    ax.set_ylabel("log π_θ(y|x) − log π_sampling(y|x)\n(nats, summed over response tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
    return None


def _length_points(iterations: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(policy index, value) per series: iteration t's generate sampled policy ``it["sampler"]``, its eval policy t."""
    out: dict[str, list[tuple[int, float]]] = {"gen_tokens": [], "gen_stop": [], "eval_tokens": [], "eval_stop": []}
    for it in iterations:
        t, gen, ev = it["iteration"], it["generate"] or {}, it["eval"] or {}
        for key, series in (("response_tokens_mean", "gen_tokens"), ("stop_fraction", "gen_stop")):
            if gen.get(key) is not None:
                out[series].append((it["sampler"], gen[key]))
        for key, series in (("response_tokens_mean", "eval_tokens"), ("stop_fraction", "eval_stop")):
            if ev.get(key) is not None:
                out[series].append((t, ev[key]))
    return out


def _plot_lengths(data: dict[str, Any], path: Path) -> Optional[str]:
    points = _length_points(data["iterations"])
    if not any(points.values()):
        return "no iter_<t>/generate dataset and no response_tokens_mean in iter_<t>/eval/results.json"
    fig, axes = _figure(1, 2)
    fig.suptitle("Response length per policy")
    styles = {"gen": ("generate (training prompts)", "tab:blue", "o"),
              "eval": ("eval (held-out prompts)", "tab:orange", "s")}
    for ax, suffix, ylabel, title in ((axes[0][0], "tokens", "mean response tokens", "mean response length"),
                                      (axes[0][1], "stop", "fraction stopped (not cut off)",
                                       "fraction that stopped before the token limit")):
        policies = set()
        for source, (label, color, marker) in styles.items():
            pts = points[f"{source}_{suffix}"]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=label)
                policies.update(p[0] for p in pts)
        if policies:
            ax.set_xticks(sorted(policies))
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        if suffix == "stop":
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title)
        ax.set_xlabel("policy (0 = start, t = after iteration t)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    _save(fig, path)
    return None


def _lm_eval_points(iterations: list[dict[str, Any]]) -> dict[tuple[str, str], list[tuple[int, float, float]]]:
    """(task, metric) -> (iteration, value, stderr or 0) from each eval's ``lm_eval`` (``rlhf eval --lm-eval``)."""
    points: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for it in iterations:
        for task, r in (((it["eval"] or {}).get("lm_eval") or {}).get("tasks") or {}).items():
            for metric, v in (r.get("metrics") or {}).items():
                if v.get("value") is not None:
                    points.setdefault((task, metric), []).append((it["iteration"], v["value"], v.get("stderr") or 0.0))
    return points


def _plot_lm_eval(data: dict[str, Any], path: Path) -> Optional[str]:
    points = _lm_eval_points(data["iterations"])
    if not points:
        return "no lm_eval in iter_<t>/eval/results.json (rlhf iterate --lm-eval)"
    tasks = list(dict.fromkeys(task for task, _ in points))
    fig, axes = _figure(1, len(tasks))
    fig.suptitle("lm-eval per iteration")
    for ax, task in zip(axes[0], tasks):
        for (name, metric), series in points.items():
            if name == task:
                ax.errorbar([p[0] for p in series], [p[1] for p in series], yerr=[p[2] for p in series],
                            marker="o", capsize=4, label=f"{metric} (± stderr)")
        ax.set_title(task)
        ax.set_xlabel("iteration (policy after t iterations; 0 = start)")
        ax.set_xticks(sorted({p[0] for (name, _), series in points.items() if name == task for p in series}))
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)
    return None


# The rows of the schedule plot, top to bottom; a stage not listed gets a row of its own below them
SCHEDULE_ROWS = ("sft", "reward_model", *ITERATION_STAGES)


def _plot_schedule(data: dict[str, Any], path: Path) -> Optional[str]:
    runs = [(data["run_dir"], data["schedule"])] + ([data["compare"]] if data.get("compare") else [])
    runs = [(name, records) for name, records in runs if records]
    if not runs:
        return "no RUN/steps.jsonl with each stage's start and end"
    span = max(max(r["ended"] for r in records) - min(r["started"] for r in records) for _, records in runs)
    fig, axes = _figure(len(runs), 1, width=10.0, height=3.0)
    colors = {}
    for (name, records), (ax,) in zip(runs, axes):
        start = min(r["started"] for r in records)
        kinds = [r["step"].rpartition("/")[2] for r in records]
        rows = [k for k in SCHEDULE_ROWS if k in kinds] + sorted(set(kinds) - set(SCHEDULE_ROWS))
        for record, kind in zip(records, kinds):
            color = colors.setdefault(kind, f"C{len(colors) % 10}")
            left, width = record["started"] - start, record["ended"] - record["started"]
            failed = record["rc"] != 0
            ax.barh(rows.index(kind), width, left=left, color=color, alpha=0.4 if failed else 0.85,
                    hatch="//" if failed else None, edgecolor="black", linewidth=0.5)
            label = record["step"].partition("/")[0].removeprefix("iter_") if "/" in record["step"] else ""
            if label:
                ax.text(left + width / 2, rows.index(kind), label, ha="center", va="center", fontsize=8)
        wall = max(r["ended"] for r in records) - start
        lanes = sorted({r["lane"] for r in records if r.get("lane") not in (None, "main")})
        ax.set_title(f"{Path(name).name}: {wall:.0f} s, "
                     + (f"overlapped ({' and '.join(lanes)} sides)" if lanes else "sequential"))
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlim(0, span * 1.02)
        ax.set_xlabel("seconds since the run's first stage started (numbers: the iteration; hatched: failed or "
                      "interrupted)")
        ax.grid(alpha=0.3, axis="x")
    _save(fig, path)
    return None


PLOTS: list[tuple[str, str, Callable[[dict[str, Any], Path], Optional[str]]]] = [
    ("reward_per_iteration.png", "Held-out reward per iteration", _plot_rewards),
    ("loss.png", "Training loss", _plot_loss),
    ("logp_drift.png", "Log-ratio drift from the sampling policy", _plot_logp),
    ("response_length.png", "Response length", _plot_lengths),
    ("judge_and_pass_at_k.png", "LLM judge and pass@k per iteration", _plot_judge_and_pass),
    ("lm_eval.png", "lm-eval per iteration", _plot_lm_eval),
    ("schedule.png", "Schedule: each stage's start and end", _plot_schedule),
]
# Plots of options a run may not use: left out of report.md, rather than listed as not drawn, when it did not (a run
# directory of stages launched by hand has no steps.jsonl).
OPTIONAL_PLOTS = {"judge_and_pass_at_k.png", "lm_eval.png", "schedule.png"}


# ----------------------------------------------------------------------------------------------------------------
# report.md


def _wall(manifest: Optional[dict[str, Any]]) -> str:
    """The stage's wall time; marked ``+`` for a resumed run (a training run or an evaluation that continued an
    unfinished one), whose manifest has its last attempt's."""
    manifest = manifest or {}
    resumed = manifest.get("resumed") or (manifest.get("training") or {}).get("resumed_from_step")
    return fmt(manifest.get("wall_time_s")) + ("+" if resumed else "")


def _sampled_from(iterations: list[dict[str, Any]]) -> str:
    """Which policy each iteration's generate sampled from, in words."""
    pairs = [(it["iteration"], it["sampler"]) for it in iterations if it["manifests"].get("generate")]
    if all(s == t - 1 for t, s in pairs):
        return "policy t−1"
    return "the policy its manifest names (" + ", ".join(f"iteration {t}: policy {s}" for t, s in pairs) + ")"


def _iteration_table(data: dict[str, Any]) -> list[str]:
    iterations = data["iterations"]
    scorers = _scorers(iterations)
    evals = [it["eval"] or {} for it in iterations]
    with_reference = [n for n in scorers if any((ev.get("scores") or {}).get(n, {}).get("reference") for ev in evals)]
    with_pass = [n for n in scorers if any((ev.get("scores") or {}).get(n, {}).get("pass_at_k") for ev in evals)]
    judged = [side for side in ("baseline", "reference") if any((ev.get("judge") or {}).get(side) for ev in evals)]
    gains = any(s.get("gain") is not None for ev in evals for s in (ev.get("scores") or {}).values())
    header = ["iter"]
    for name in scorers:
        header += [f"{name} reward (mean ± stderr" + ("; gain over the baseline ± paired stderr)" if gains else ")"),
                   f"{name} win rate ± stderr (W/T/L), LC"]
        if name in with_reference:
            header.append(f"{name} win rate vs references, LC")
        if name in with_pass:
            header.append(f"{name} pass@k, maj@k (1 and n) ± stderr")
    header += [f"judge vs {side}: win rate, LC (consistency)" for side in judged]
    header += ["train loss (first → last)", "eval loss (final)", "eval accuracy (final)",
               "gen. tokens", "gen. stopped", "eval tokens", "eval stopped",
               "wall time s (generate / score / filter / train / eval)"]
    rows = []
    for it in iterations:
        ev, gen, metrics = it["eval"] or {}, it["generate"] or {}, it["metrics"]
        row = [str(it["iteration"])]
        for name in scorers:
            s = (ev.get("scores") or {}).get(name)
            if not s or s.get("mean") is None:
                row += [MISSING, MISSING] + [MISSING] * ((name in with_reference) + (name in with_pass))
                continue
            gain = "" if s.get("gain") is None else f"; gain {s['gain']:+.4g} ± {fmt(s.get('gain_stderr'))}"
            row.append(f"{fmt(s['mean'])} ± {fmt(s.get('stderr'))}{gain}")
            row.append(_win_cell(s, counts=True))
            if name in with_reference:
                row.append(_win_cell(s.get("reference") or {}))
            if name in with_pass:
                row.append(_pass_cell(s))
        for side in judged:
            row.append(_judge_cell((ev.get("judge") or {}).get(side) or {}))
        first, last = _first_last(metrics, "loss/train")
        row.append(MISSING if first is None else f"{fmt(first)} → {fmt(last)}")
        row.append(fmt(_first_last(metrics, "loss/eval")[1]))
        row.append(fmt(_first_last(metrics, "reward/accuracy")[1]))
        row += [fmt(gen.get("response_tokens_mean")), fmt(gen.get("stop_fraction")),
                fmt(ev.get("response_tokens_mean")), fmt(ev.get("stop_fraction"))]
        row.append(" / ".join(_wall(it["manifests"].get(stage)) for stage in ITERATION_STAGES))
        rows.append(row)
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _judge_cell(j: dict[str, Any]) -> str:
    """The judge's win rate cell, with its consistency, and the verdicts it could not read and the comparisons left
    out for them, where there are any (a judge whose every verdict was unreadable has no win rate, and says so)."""
    if not j:
        return MISSING
    text = _win_cell(j) + (f" ({fmt(j['consistency'])})" if j.get("consistency") is not None else "")
    if j.get("unreadable"):
        lost = f"{j['unreadable']} of {j.get('verdicts', '?')} verdicts unreadable, {j.get('left_out', '?')} left out"
        text = f"no verdict read ({lost})" if j.get("win_rate") is None else f"{text}; {lost}"
    return text


def _pass_cell(s: dict[str, Any]) -> str:
    """``pass@1 0.25 ± 0.04, pass@8 0.6 ± 0.05, maj@1 0.25 ± 0.04, maj@8 0.4 ± 0.05``: pass@k and maj@k at the
    smallest and largest k."""
    parts = []
    for kind, label in (("pass_at_k", "pass"), ("maj_at_k", "maj")):
        by_k = s.get(kind) or {}
        ks = sorted(by_k, key=int)
        for k in dict.fromkeys(ks[:1] + ks[-1:]):
            v = by_k[k]
            parts.append(f"{label}@{k} {fmt(v.get('mean'))}" + (f" ± {fmt(v['stderr'])}" if v.get("stderr") is not None
                                                                else ""))
    return ", ".join(parts) or MISSING


def _lm_eval_table(iterations: list[dict[str, Any]]) -> list[str]:
    """One row per evaluated policy, one column per lm-eval task and metric (value ± stderr); empty without any."""
    points = _lm_eval_points(iterations)
    if not points:
        return []
    cells = {(key, t): f"{fmt(v)} ± {fmt(e)}" if e else fmt(v) for key, series in points.items() for t, v, e in series}
    ts = sorted({t for series in points.values() for t, _, _ in series})
    header = ["iter"] + [f"{task} {metric}" for task, metric in points]
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([str(t)] + [_cell(cells.get((key, t), MISSING)) for key in points]) + " |"
              for t in ts]
    return lines


def _win_cell(s: dict[str, Any], counts: bool = False) -> str:
    """``0.62 ± 0.04 (W/T/L), LC 0.58 ± 0.03``: a raw win rate with its standard error, its counts, and the
    length-controlled one (for a reward model with, before it, the mean of the Bradley-Terry preferences it was
    fitted on)."""
    if s.get("win_rate") is None:
        return MISSING
    wtl = [s.get(k) for k in ("wins", "ties", "losses")]
    text = fmt(s["win_rate"]) + (f" ± {fmt(s['win_rate_stderr'])}" if s.get("win_rate_stderr") is not None else "")
    text += f" ({'/'.join(map(str, wtl))})" if counts and None not in wtl else ""
    fit = s.get("length_controlled") or {}
    if fit.get("preferences") == "bradley-terry":  # the LC fit's own raw figure: the mean of its preferences
        text += f", mean pref. {fmt(fit['raw_win_rate'])}"
    if s.get("lc_win_rate") is not None:
        text += f", LC {fmt(s['lc_win_rate'])}" + (f" ± {fmt(s['lc_stderr'])}" if s.get("lc_stderr") is not None
                                                    else "")
    return text


def _eval_setup(iterations: list[dict[str, Any]]) -> list[str]:
    """The distinct eval sizes, then each baseline with the iterations that compared against it."""
    sizes: list[str] = []
    baselines: dict[str, list[int]] = {}
    for it in iterations:
        ev = it["eval"]
        if ev:
            size = f"{ev.get('num_prompts', '?')} prompts × {ev.get('n', '?')} samples"
            if size not in sizes:
                sizes.append(size)
            if ev.get("baseline"):
                baselines.setdefault(str(ev["baseline"]), []).append(it["iteration"])
    return sizes + [f"baseline `{name}` (iterations {', '.join(map(str, ts))})" for name, ts in baselines.items()]


def _training_run_line(name: str, run: dict[str, Any]) -> str:
    records, manifest = run["metrics"], run["manifest"] or {}
    parts = []
    steps = max((r["step"] for r in records), default=None)
    if steps is not None:
        parts.append(f"{steps} steps")
    first, last = _first_last(records, "loss/train")
    if first is not None:
        parts.append(f"train loss {fmt(first)} → {fmt(last)}")
    eval_loss = _first_last(records, "loss/eval")[1]
    if eval_loss is not None:
        parts.append(f"final eval loss {fmt(eval_loss)}")
    accuracy = _first_last(records, "reward/accuracy")[1]
    if accuracy is not None:
        parts.append(f"final eval accuracy {fmt(accuracy)}")
    train_accuracy = _first_last(records, "reward/train_accuracy")[1]
    if train_accuracy is not None:
        parts.append(f"last train accuracy {fmt(train_accuracy)}")
    if manifest.get("wall_time_s") is not None:
        parts.append(f"wall time {fmt(manifest['wall_time_s'])} s")
    if not manifest:
        parts.append("no manifest.json (unfinished?)")
    return f"- **{TRAINING_RUNS[name]}** (`{name}/`): " + (", ".join(parts) or "no metrics")


def _markdown(data: dict[str, Any], plots: list[tuple[str, str, Optional[str]]]) -> str:
    iterations = data["iterations"]
    lines = [f"# RLHF run report: `{data['run_dir']}`", ""]
    if iterations:
        ts = [it["iteration"] for it in iterations]
        sampled = _sampled_from(iterations)
        lines += [f"Iterations found: {', '.join(map(str, ts))}. Iteration t's generate sampled from {sampled}, "
                  "its train made policy t, its eval evaluated policy t (row 0: the starting policy).", ""]
        lines += ["## Per iteration", ""] + _iteration_table(data) + [""]
        setups = _eval_setup(iterations)
        specs = {name: spec for it in iterations for name, score in ((it["eval"] or {}).get("scores") or {}).items()
                 if (spec := (score or {}).get("scorer"))}
        notes = ["Reward, win rate and eval tokens/stopped: held-out `eval/results.json` of policy t"
                 + (f" ({'; '.join(setups)})" if setups else "") + ".",
                 *(["Scorers: " + "; ".join(f"{name} = `{spec}`" for name, spec in specs.items()) + "."]
                   if specs else []),
                 "LC: AlpacaEval 2's length-controlled win rate (the judge's preference read at equal response "
                 "lengths; a reward model's preferences are its Bradley-Terry probabilities), ± its standard error.",
                 "Train loss, eval loss and eval accuracy: `train/metrics.jsonl` of iteration t "
                 "(eval accuracy: reward/accuracy).",
                 "Gen. tokens/stopped: the `generate/` dataset of iteration t (sampled from "
                 + ("policy t−1" if sampled == "policy t−1" else "the policy named above") + "); "
                 "stopped = fraction of responses that ended before the token limit.",
                 "Wall time: each stage's manifest; `+` marks a stage that continued an unfinished run (a training "
                 "run resumed from a checkpoint; generate, score or eval from their finished chunks or parts), whose "
                 "time is its last attempt's (a training run's `training.seconds`: its loop over all attempts).",
                 f"{MISSING}: not in the run."]
        lines += [f"- {n}" for n in notes] + [""]
        lm_eval = _lm_eval_table(iterations)
        if lm_eval:
            lines += ["## lm-eval per iteration", "", *lm_eval, "",
                      "- EleutherAI's lm-evaluation-harness on policy t (`eval/results.json` under `lm_eval`; "
                      "`rlhf iterate --lm-eval`), value ± its standard error.", ""]
    else:
        lines += ["No iter_<t>/ directories in the run.", ""]
    runs = [name for name in TRAINING_RUNS if data.get(name)]
    if runs:
        lines += ["## SFT and reward model", ""]
        lines += [_training_run_line(name, data[name]) for name in runs] + [""]
    lines += ["## Plots", ""]
    for filename, title, reason in plots:
        if reason is not None and filename in OPTIONAL_PLOTS:
            continue  # of a feature the run did not use
        if reason is None:
            lines += [f"### {title}", "", f"![{title}]({PLOTS_DIR}/{filename})", ""]
        else:
            lines += [f"### {title}", "", f"*Not drawn (plots/{filename}): {reason}.*", ""]
    if data.get("summary") is not None:
        text = json.dumps(data["summary"], indent=2, default=str)
        if len(text) > 4000:
            text = text[:4000] + "\n... (truncated; see summary.json)"
        lines += ["## summary.json", "", "```json", text, "```", ""]
    return "\n".join(lines)


def write_report(run_dir: Path, output: Optional[Path] = None, compare: Optional[Path] = None) -> Path:
    """Write ``output/report.md`` and ``output/plots/*.png`` (``output`` defaults to ``run_dir``); return the
    path of report.md. ``compare``: a second run directory whose schedule is drawn below this one's. Raises
    PipelineError when matplotlib is missing or the run directory holds no data."""
    _require_matplotlib()
    data = collect(Path(run_dir))
    if compare is not None:
        schedule = read_schedule(Path(compare).expanduser())
        if not schedule:
            raise PipelineError(f"--compare {compare}: no steps.jsonl with each stage's start and end there; pass "
                                "the --output directory of rlhf iterate or rlhf demo")
        data["compare"] = (str(compare), schedule)
    output = Path(run_dir if output is None else output).expanduser()
    plots_dir = output / PLOTS_DIR
    plots_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for filename, title, draw in PLOTS:
        path = plots_dir / filename
        reason = draw(data, path)
        if reason is not None and path.exists():
            path.unlink()  # an older report's plot of data that is no longer there
        if reason is not None and filename in OPTIONAL_PLOTS:
            continue
        results.append((filename, title, reason))
    report = output / REPORT
    write_text_atomic(report, _markdown(data, results))
    return report


def main(config: ReportConfig) -> Path:
    report = write_report(Path(config.run_dir), Path(config.output) if config.output else None,
                          Path(config.compare) if config.compare else None)
    print(f"[report] wrote {report} and its plots in {report.parent / 'plots'}")
    return report


def cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--run-dir", argv[0], *argv[1:]]  # rlhf report RUN_DIR [options]
    return run_stage(ReportConfig, main, "rlhf report", argv)


if __name__ == "__main__":
    sys.exit(cli())
