"""Evaluate a policy on held-out prompts: generate, score, and report the mean reward and the win rate.

    rlhf eval --model runs/iter_3/train --prompts eval_prompts.jsonl --reward-model runs/rm \\
        --baseline runs/sft --output runs/eval_iter_3

The policy samples ``--n`` responses per prompt (``rlhf generate``, same engines and options), and every response
is scored by the reward model and/or the reward function (``rlhf score``; give one or both: each becomes a scorer
in the results). Per scorer:

- ``mean``: the mean over prompts of each prompt's mean reward, and ``stderr``, its standard error
  (standard deviation over prompts / sqrt(number of prompts));
- with ``--baseline``, ``win_rate``: response j of the policy against response j of the baseline on the same
  prompt, for every prompt and j < n, a win counting 1 and a tie 1/2.

``--baseline`` is a model (sampled here with the same settings and seed) or the output directory of an earlier
``rlhf eval`` on the same prompts, whose scored samples are reused instead of generated again (``rlhf iterate``
compares every iteration with ``RUN/iter_0/eval`` this way).

Output, filled in place and resumable (each part is a stage output that a rerun reuses)::

    OUTPUT/generate/               the policy's samples (rlhf generate)
    OUTPUT/score_reward_model/     ... scored by the reward model (rlhf score); score_reward_fn/ for the function
    OUTPUT/baseline/...            the same for a baseline model
    OUTPUT/samples/                one dataset: prompt, responses, the rewards of every scorer (and the baseline's)
    OUTPUT/results.json            the numbers above (``rlhf report`` plots them)
    OUTPUT/manifest.json           written last
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.config import OutputOptions, option, options_of, override
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import EVAL_RESULTS, EVAL_SAMPLES
from rlhf_pipeline.sampling_options import SamplingOptions

SCORERS = ("reward_model", "reward_fn")
# What must match for an earlier evaluation's samples to serve as the baseline.
SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "limit")


@dataclass(kw_only=True)
class EvalConfig(SamplingOptions, OutputOptions):
    """Generate on held-out prompts, score, and report the mean reward and the win rate against a baseline.
    The sampling and engine options are rlhf generate's; --dtype and --trust-remote-code apply to the reward model
    too, and a baseline model is sampled with the same options and --seed."""

    model: str = option(help="Policy to evaluate: a local directory or a Hub model id.")
    prompts: str = option(help="Held-out prompt dataset (directory, .json/.jsonl/.parquet file, or Hub id).",
                          semantic=False)
    reward_model: Optional[str] = option(None, help="Score with this sequence-classification reward model.")
    reward_fn: Optional[str] = option(None, help="Score with this python function (module:function or file.py:function).")
    baseline: Optional[str] = option(
        None, help="Compare with this model, or with the output directory of an earlier rlhf eval on the same prompts."
    )
    n: int = override(SamplingOptions, "n", 1)
    # Left out of eval's own reuse check; the generate step in OUTPUT/generate checks it against its manifest.
    batch_size: int = override(SamplingOptions, "batch_size", semantic=False)
    score_batch_size: int = option(16, help="Sequences per reward-model forward.", semantic=False)
    max_length: int = option(4096, help="Reward model: conversations longer than this keep their first tokens.")

    def __post_init__(self) -> None:
        if self.reward_model is None and self.reward_fn is None:
            raise ValueError("give --reward-model, --reward-fn, or both")
        super().__post_init__()  # the sampling options' checks, the same as rlhf generate's
        if self.score_batch_size < 1:
            raise ValueError("--score-batch-size must be at least 1")
        if self.max_length < 1:
            raise ValueError("--max-length must be at least 1")


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample standard deviation / sqrt(count)); no error bar for one value."""
    count = len(values)
    mean = sum(values) / count
    if count < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (count - 1)
    return mean, math.sqrt(var / count)


def win_counts(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]]) -> tuple[int, int, int]:
    """(wins, ties, losses) of response j against response j of the same prompt, over prompts and j."""
    wins = ties = losses = 0
    for a, b in zip(ours, theirs):
        for x, y in zip(a, b):
            wins += x > y
            ties += x == y
            losses += x < y
    return wins, ties, losses


def summarize(rewards: Sequence[Sequence[float]], baseline: Sequence[Sequence[float]] | None) -> dict[str, Any]:
    """One scorer's numbers: ``rewards[i]`` are prompt i's rewards (``baseline`` aligned with them, or None)."""
    mean, stderr = mean_and_stderr([sum(r) / len(r) for r in rewards])
    result: dict[str, Any] = {"mean": mean, "stderr": stderr, "baseline_mean": None, "baseline_stderr": None,
                              "win_rate": None, "wins": None, "ties": None, "losses": None}
    if baseline is not None:
        result["baseline_mean"], result["baseline_stderr"] = mean_and_stderr([sum(r) / len(r) for r in baseline])
        wins, ties, losses = win_counts(rewards, baseline)
        total = wins + ties + losses
        result.update(wins=wins, ties=ties, losses=losses, win_rate=(wins + 0.5 * ties) / total if total else None)
    return result


def _scorers(config: EvalConfig) -> dict[str, str]:
    return {name: getattr(config, name) for name in SCORERS if getattr(config, name) is not None}


def _sample_and_score(config: EvalConfig, model: str, directory: Path) -> dict[str, Path]:
    """Generate with ``model`` into ``directory/generate`` and score it with every scorer."""
    from rlhf_pipeline import generation, scoring

    gen = generation.GenerateConfig(
        output=str(directory / "generate"), model=model, prompts=config.prompts,
        **options_of(config, SamplingOptions),
    )
    paths = {"generate": generation.main(gen)}
    for name, spec in _scorers(config).items():
        paths[name] = scoring.main(scoring.ScoreConfig(
            output=str(directory / f"score_{name}"), input=str(paths["generate"]), batch_size=config.score_batch_size,
            max_length=config.max_length, dtype=config.dtype, trust_remote_code=config.trust_remote_code,
            **{name: spec},
        ))
    return paths


def _earlier_eval(path: str) -> Path | None:
    """The directory of a finished ``rlhf eval`` output, or None when ``path`` is not one (then it is a model)."""
    p = Path(path).expanduser()
    manifest = p / "manifest.json"
    if not manifest.is_file():
        return None
    stage = json.loads(manifest.read_text()).get("stage")
    if stage == "eval":
        return p
    if (p / "config.json").is_file():  # a model written by a training stage (sft, train, train-rm)
        return None
    raise PipelineError(f"--baseline {path}: holds a {stage} output, not a model or an rlhf eval output")


def _check_inputs(config: EvalConfig, ref) -> Path | None:
    """Everything eval reads, checked before it makes its output directory: the models, the reward function, the
    prompts and the baseline. Returns the earlier evaluation given as ``--baseline`` (None for a model, or none)."""
    from rlhf_pipeline.generation import select_prompts
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.rewards import load_reward_fn

    check_model_ref("--model", config.model)
    if config.reward_model is not None:
        check_model_ref("--reward-model", config.reward_model)
    if config.reward_fn is not None:
        load_reward_fn(config.reward_fn)
    select_prompts(ref, limit=config.limit)
    if config.baseline is None or config.baseline == config.model:
        return None
    earlier = _earlier_eval(config.baseline)
    if earlier is None:
        check_model_ref("--baseline", config.baseline, hint="a model, or the output directory of a finished rlhf eval")
        return None
    previous_config = json.loads((earlier / "manifest.json").read_text())["config"]  # _earlier_eval checked it
    differ = [k for k in SAMPLING_KEYS if previous_config.get(k) != getattr(config, k)]
    if differ:
        raise PipelineError(
            f"--baseline {config.baseline}: that evaluation sampled with other settings ("
            + ", ".join(f"--{k.replace('_', '-')} {previous_config.get(k)} vs {getattr(config, k)}" for k in differ)
            + "); a win rate compares like with like, so use the same settings or pass the baseline model"
        )
    for name, spec in _scorers(config).items():
        scored = earlier / f"score_{name}"
        previous = json.loads((scored / "manifest.json").read_text()) if (scored / "manifest.json").exists() else None
        if previous is None or previous["config"].get(name) != spec:
            raise PipelineError(
                f"--baseline {config.baseline}: that evaluation was not scored with --{name.replace('_', '-')} "
                f"{spec}; evaluate the baseline with the same scorers, or pass the baseline model instead"
            )
    return earlier


def _baseline_scores(config: EvalConfig, earlier: Path | None, out_dir: Path) -> tuple[dict[str, Path] | None,
                                                                                         str | None]:
    """The baseline's scored samples (None when the baseline is the evaluated model itself) and a description:
    those of the earlier evaluation ``earlier`` (checked by :func:`_check_inputs`), or sampled and scored now."""
    if config.baseline is None:
        return None, None
    if config.baseline == config.model:
        return None, "the evaluated model itself"
    if earlier is None:
        return _sample_and_score(config, config.baseline, out_dir / "baseline"), config.baseline
    previous_model = json.loads((earlier / "manifest.json").read_text())["config"]["model"]
    return {name: earlier / f"score_{name}" for name in _scorers(config)}, f"{previous_model} (samples of {earlier})"


def _rewards_by_prompt(path: Path) -> tuple[list[str], dict[str, list[float]]]:
    from datasets import load_from_disk

    ds = load_from_disk(str(path))
    ids = [str(x) for x in ds["prompt_id"]]
    return ids, dict(zip(ids, ds["rewards"]))


def main(config: EvalConfig) -> Path:
    from rlhf_pipeline.datasets_io import StageOutput, parse_ref

    ref = parse_ref(config.prompts)
    out = StageOutput("eval", config, inputs=[ref])
    if out.done(resume=True):  # the parts are stage outputs of their own: an unfinished eval continues
        return out.path
    earlier = _check_inputs(config, ref)  # before the output directory is made: a mistake leaves nothing
    if out.replace:
        shutil.rmtree(out.path)
    out.record_start()
    baseline, baseline_desc = _baseline_scores(config, earlier, out.path)
    own = _sample_and_score(config, config.model, out.path)
    if config.baseline == config.model:
        baseline = own

    from datasets import load_from_disk

    generated = load_from_disk(str(own["generate"]))
    scores, columns = {}, {}
    for name, spec in _scorers(config).items():
        ids, ours = _rewards_by_prompt(own[name])
        theirs = None
        if baseline is not None:
            _, base = _rewards_by_prompt(baseline[name])
            missing = [i for i in ids if i not in base]
            if missing:
                raise PipelineError(
                    f"--baseline {config.baseline}: has no samples for {len(missing)} of the {len(ids)} prompts "
                    f"(e.g. prompt_id {missing[0]}); evaluate both on the same --prompts and --limit"
                )
            theirs = [base[i] for i in ids]
            columns[f"baseline_rewards_{name}"] = theirs
        scores[name] = {"scorer": spec, **summarize([ours[i] for i in ids], theirs)}
        columns[f"rewards_{name}"] = [ours[i] for i in ids]

    lengths = [len(t) for row in generated["response_token_ids"] for t in row]
    reasons = [r for row in generated["finish_reasons"] for r in row]
    results = {
        "model": config.model,
        "baseline": baseline_desc,
        "num_prompts": generated.num_rows,
        "n": config.n,
        "response_tokens_mean": sum(lengths) / max(len(lengths), 1),
        "stop_fraction": reasons.count("stop") / max(len(reasons), 1),
        "scores": scores,
    }
    samples = generated.select_columns(
        [c for c in generated.column_names if c not in ("prompt_token_ids", "response_token_ids")]
    )
    for name, values in columns.items():
        samples = samples.add_column(name, values)
    from rlhf_pipeline.datasets_io import atomic_directory, push_to_hub, write_text_atomic

    with atomic_directory(out.path / EVAL_SAMPLES) as tmp:
        samples.save_to_disk(str(tmp))
    write_text_atomic(out.path / EVAL_RESULTS, json.dumps(results, indent=2) + "\n")
    manifest = out.manifest(rows_in=generated.num_rows, rows_out=generated.num_rows, extra={"eval": results})
    if config.push_to_hub:  # before the manifest: a failed upload leaves the evaluation unfinished, to be rerun
        out.write_manifest(dict(manifest), directory=out.path / EVAL_SAMPLES)
        push_to_hub(samples, out.path / EVAL_SAMPLES / "manifest.json", config.push_to_hub)
    out.write_manifest(manifest)
    for name, s in scores.items():
        line = f"[eval] {name}: mean reward {s['mean']:.4f}"
        line += f" ± {s['stderr']:.4f}" if s["stderr"] is not None else ""
        if s["win_rate"] is not None:
            line += f", win rate {s['win_rate']:.3f} against the baseline (mean {s['baseline_mean']:.4f})"
        print(line)
    return out.path


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(EvalConfig, main, "rlhf eval", argv)


if __name__ == "__main__":
    sys.exit(cli())
