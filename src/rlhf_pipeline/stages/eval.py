"""Evaluate a policy on held-out prompts: generate, score, and report the mean reward and the win rate.

    rlhf eval --model runs/iter_3/train --prompts eval_prompts.jsonl --reward-model runs/rm \\
        --baseline runs/sft --output runs/eval_iter_3
    accelerate launch --multi_gpu --num_processes 8 -m rlhf_pipeline.stages.eval ...   # scoring data-parallel

The policy samples ``--n`` responses per prompt (``rlhf generate``, same engines and options), and every response
is scored by the reward model and/or the reward function (``rlhf score``; give one or both: each becomes a scorer
in the results). Per scorer:

- ``mean``: the mean over prompts of each prompt's mean reward, and ``stderr``, its standard error
  (standard deviation over prompts / sqrt(number of prompts));
- with ``--baseline``, ``win_rate``: response j of the policy against response j of the baseline on the same
  prompt, for every prompt and j < n, a win counting 1 and a tie 1/2;
- for a reward function whose rewards are all 0 or 1 (a verifiable reward, ``rewards.verifiable``), ``pass_at_k``:
  ``{"1": {"mean", "stderr"}, "2": ..., "<n>": ...}`` for k = 1, 2, 4, ... and n, the unbiased estimator of Chen et
  al. 2021 per prompt (``evalstats.pass_at_k``), averaged over prompts; and ``maj_at_k`` the same way when the
  function has ``extract_answer`` (is the most frequent answer among the first k right). The ground truth comes
  from the prompts' column named by ``--reference-column``.

Several reward models or functions (``--reward-model``/``--reward-fn`` take several, as in ``rlhf score``) are
each a scorer, keyed as ``rlhf score`` keys them (``stages.score.reward_sources``: ``reward_model`` and ``reward_fn``
for the only one of their kind, else ``reward_fn_<name>``). With two or more and ``--reward-weights``,
``results.json`` also has ``combined``: the same numbers for ``rlhf score``'s combination,
``sum_k w_k (r_k - mean_k) / (std_k + eps)`` (without weights each source is reported on its own: a gold function
evaluated beside a reward model, as the demo does, is not a combination anyone trains on). Its statistics are the *baseline's* (the mean and standard deviation of each source over
the baseline's responses), so the policy and the baseline are put on one scale, the baseline's combined mean is 0,
and evaluations against one baseline (every iteration of ``rlhf iterate``) are comparable; without a baseline they
are the evaluated samples' own, and the combined mean is 0 by construction (its win rate and per-source numbers are
what to read then). The statistics used are in ``combined.statistics``.

``--baseline`` is a model (sampled here with the same settings and seed) or the output directory of an earlier
``rlhf eval`` on the same prompts, whose scored samples are reused instead of generated again (``rlhf iterate``
compares every iteration with ``RUN/iter_0/eval`` this way).

Output, filled in place and resumable (each part is a stage output that a rerun reuses)::

    OUTPUT/generate/               the policy's samples (rlhf generate)
    OUTPUT/score_reward_model/     ... scored by the reward model (rlhf score); score_reward_fn/ for the function
                                   (score_<key>/ for each of several)
    OUTPUT/baseline/...            the same for a baseline model
    OUTPUT/samples/                one dataset: prompt, responses, the rewards of every scorer (and the baseline's)
    OUTPUT/results.json            the numbers above (``rlhf report`` plots them)
    OUTPUT/manifest.json           written last
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import OutputOptions, option, options_of, override
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.evalstats import mean_and_stderr, win_counts
from rlhf_pipeline.layout import EVAL_RESULTS, EVAL_SAMPLES
from rlhf_pipeline.sampling_options import SamplingOptions
from rlhf_pipeline.stages.score import RewardSource, check_reward_options, one_or_list, reward_sources

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
    # One scorer of a kind is kept as a plain string, as before several existed (see stages.score.ScoreConfig).
    reward_model: Optional[list[str]] = option(
        None, help="Score with this sequence-classification reward model (several: repeat the flag, or a YAML list)."
    )
    reward_fn: Optional[list[str]] = option(
        None, help="Score with this python function (module:function or file.py:function); several allowed."
    )
    reward_weights: Optional[list[float]] = option(
        None, help="With two or more scorers: report their combination as 'combined', with these weights, as "
        "rlhf score's --reward-weights (reward models first, then functions); without it, each scorer on its own."
    )
    baseline: Optional[str] = option(
        None, help="Compare with this model, or with the output directory of an earlier rlhf eval on the same prompts."
    )
    n: int = override(SamplingOptions, "n", 1)
    # Left out of eval's own reuse check; the generate step in OUTPUT/generate checks it against its manifest.
    batch_size: int = override(SamplingOptions, "batch_size", semantic=False)
    score_batch_size: int = option(16, help="Sequences per reward-model forward.", semantic=False)
    max_length: int = option(4096, help="Reward model: conversations longer than this keep their first tokens.")
    reference_column: Optional[str] = option(
        None, help="The prompts' column holding the ground truth, passed to reward functions as 'reference' (as rlhf "
        "score's --reference-column); default: a column named reference, answer, solution or ground_truth."
    )

    def __post_init__(self) -> None:
        self.reward_model = one_or_list(self.reward_model)
        self.reward_fn = one_or_list(self.reward_fn)
        if self.reward_weights is not None:
            self.reward_weights = [float(w) for w in self.reward_weights]
        if self.reward_model is None and self.reward_fn is None:
            raise ValueError("give --reward-model, --reward-fn, or both")
        check_reward_options(self.reward_model, self.reward_fn, self.reward_weights)
        super().__post_init__()  # the sampling options' checks, the same as rlhf generate's
        if self.score_batch_size < 1:
            raise ValueError("--score-batch-size must be at least 1")
        if self.max_length < 1:
            raise ValueError("--max-length must be at least 1")


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


def verifiable_summary(source: RewardSource, generated, ids: list[str], rewards: list[list[float]]) -> dict[str, Any]:
    """pass@k (and maj@k) of a reward function whose rewards are all 0 or 1 (a verifiable reward: right or wrong),
    ``rewards[i]`` those of prompt ``ids[i]``: ``{"pass_at_k": {"1": {"mean", "stderr"}, ...}}`` for k = 1, 2, 4, ...,
    n (evalstats.k_ladder), and ``maj_at_k`` the same way when the function carries ``extract_answer(response)``
    (the answer a response votes for, as rewards.verifiable's do); empty for anything else."""
    from rlhf_pipeline.evalstats import maj_at_k_summary, pass_at_k_summary

    if source.kind != "reward_fn" or not rewards or any(r not in (0.0, 1.0) for rs in rewards for r in rs):
        return {}
    from rlhf_pipeline.rewards import load_reward_fn

    result: dict[str, Any] = {"pass_at_k": pass_at_k_summary(rewards)}
    extract = getattr(load_reward_fn(source.spec), "extract_answer", None)
    if callable(extract):
        responses = dict(zip((str(x) for x in generated["prompt_id"]), generated["responses"]))
        answers = [[extract(r) for r in responses[i]] for i in ids]
        result["maj_at_k"] = maj_at_k_summary(answers, rewards)
    return result


def _scorers(config: EvalConfig) -> list[RewardSource]:
    return reward_sources(config.reward_model, config.reward_fn)


def combined_summary(sources: list[RewardSource], weights: Sequence[float], ours: dict[str, list[list[float]]],
                     theirs: dict[str, list[list[float]]] | None) -> dict[str, Any]:
    """The numbers of :func:`summarize` for the weighted combination of several scorers, every source standardised
    with the baseline's statistics (``theirs``: per source key, the baseline's rewards per prompt), or with the
    evaluated samples' own (``ours``) when there is no baseline."""
    from rlhf_pipeline.rewards import combine_rewards, source_stats

    reference = theirs if theirs is not None else ours
    stats = [source_stats([r for rs in reference[s.key] for r in rs]) for s in sources]

    def combine(by_key: dict[str, list[list[float]]]) -> list[list[float]]:
        flat, _ = combine_rewards([[r for rs in by_key[s.key] for r in rs] for s in sources], weights, stats)
        sizes, rows, at = [len(rs) for rs in by_key[sources[0].key]], [], 0
        for size in sizes:
            rows.append(flat[at : at + size])
            at += size
        return rows

    summary = summarize(combine(ours), combine(theirs) if theirs is not None else None)
    return {
        "weights": {s.key: w for s, w in zip(sources, weights)},
        "statistics_from": "baseline" if theirs is not None else "evaluated samples",
        "statistics": {s.key: st.as_dict() for s, st in zip(sources, stats)},
        **summary,
    }


def _sample_and_score(config: EvalConfig, model: str, directory: Path, accelerator=None) -> dict[str, Path]:
    """Generate with ``model`` into ``directory/generate`` and score it with every scorer. Under ``accelerate
    launch`` the main process samples (the other processes wait) and every process scores its share."""
    from rlhf_pipeline.stages import generate, score
    from rlhf_pipeline.distributed import on_main_process

    gen = generate.GenerateConfig(
        output=str(directory / "generate"), model=model, prompts=config.prompts, logprobs=False,
        **options_of(config, SamplingOptions),
    )
    on_main_process(accelerator, lambda: generate.main(gen))
    paths = {"generate": directory / "generate"}
    for source in _scorers(config):  # each scored alone (raw rewards): the combination is made in main
        paths[source.key] = score.score(score.ScoreConfig(
            output=str(directory / f"score_{source.key}"), input=str(paths["generate"]),
            batch_size=config.score_batch_size, max_length=config.max_length, dtype=config.dtype,
            trust_remote_code=config.trust_remote_code, reference_column=config.reference_column,
            **{source.kind: source.spec},
        ), accelerator)
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
    prompts and the baseline (and Ray, for --executor ray). Returns the earlier evaluation given as ``--baseline``
    (None for a model, or none)."""
    from rlhf_pipeline.executors import check_ray_installed
    from rlhf_pipeline.stages.generate import select_prompts
    from rlhf_pipeline.stages.score import check_reference_column
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.rewards import load_reward_fn

    if config.executor == "ray":
        check_ray_installed()
    check_model_ref("--model", config.model)
    for source in _scorers(config):
        if source.kind == "reward_model":
            check_model_ref(source.flag, source.spec)
        else:
            load_reward_fn(source.spec)
    prompts = select_prompts(ref, limit=config.limit)[0]
    check_reference_column(prompts, ref.name, config.reference_column, "rlhf eval carries")
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
    for source in _scorers(config):
        scored = earlier / f"score_{source.key}"
        previous = json.loads((scored / "manifest.json").read_text()) if (scored / "manifest.json").exists() else None
        if previous is None or previous["config"].get(source.kind) != source.spec:
            raise PipelineError(
                f"--baseline {config.baseline}: that evaluation was not scored with {source.flag} "
                f"{source.spec}; evaluate the baseline with the same scorers, or pass the baseline model instead"
            )
    return earlier


def _baseline_scores(config: EvalConfig, earlier: Path | None, out_dir: Path, accelerator=None
                     ) -> tuple[dict[str, Path] | None, str | None]:
    """The baseline's scored samples (None when the baseline is the evaluated model itself) and a description:
    those of the earlier evaluation ``earlier`` (checked by :func:`_check_inputs`), or sampled and scored now."""
    if config.baseline is None:
        return None, None
    if config.baseline == config.model:
        return None, "the evaluated model itself"
    if earlier is None:
        return _sample_and_score(config, config.baseline, out_dir / "baseline", accelerator), config.baseline
    previous_model = json.loads((earlier / "manifest.json").read_text())["config"]["model"]
    return ({s.key: earlier / f"score_{s.key}" for s in _scorers(config)},
            f"{previous_model} (samples of {earlier})")


def _rewards_by_prompt(path: Path) -> tuple[list[str], dict[str, list[float]]]:
    from datasets import load_from_disk

    ds = load_from_disk(str(path))
    ids = [str(x) for x in ds["prompt_id"]]
    return ids, dict(zip(ids, ds["rewards"]))


def main(config: EvalConfig) -> Path:
    from rlhf_pipeline.distributed import run_inference

    return run_inference("rlhf eval", lambda accelerator: _evaluate(config, accelerator))


def _evaluate(config: EvalConfig, accelerator) -> Path:
    """One process, or every process of ``accelerate launch`` (``accelerator``): the main process samples and writes,
    every process scores its share of the samples (``stages.score.score``)."""
    from rlhf_pipeline.datasets_io import StageOutput, parse_ref
    from rlhf_pipeline.distributed import guarded, on_main_process, world_and_rank

    def begin():
        ref = parse_ref(config.prompts)
        out = StageOutput("eval", config, inputs=[ref], pusher=push_samples)
        if out.done(resume=True):  # the parts are stage outputs of their own: an unfinished eval continues
            return None
        return out, _check_inputs(config, ref)  # before the output directory is made: a mistake leaves nothing

    begun = guarded(accelerator, begin)
    if begun is None:
        return Path(config.output).expanduser()
    out, earlier = begun

    def start() -> None:
        if out.replace:
            shutil.rmtree(out.path)
        out.record_start()

    on_main_process(accelerator, start)
    baseline, baseline_desc = _baseline_scores(config, earlier, out.path, accelerator)
    own = _sample_and_score(config, config.model, out.path, accelerator)
    if config.baseline == config.model:
        baseline = own
    processes = world_and_rank(accelerator)[0]
    on_main_process(accelerator, lambda: _report(config, out, own, baseline, baseline_desc, processes))
    return out.path


def _report(config: EvalConfig, out, own: dict[str, Path], baseline: dict[str, Path] | None,
            baseline_desc: str | None, processes: int) -> None:
    """The numbers, the samples and the manifest (the main process only)."""
    from datasets import load_from_disk

    generated = load_from_disk(str(own["generate"]))
    scores, columns, ours_by_key, theirs_by_key = {}, {}, {}, {}
    sources = _scorers(config)
    for source in sources:
        name = source.key
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
            theirs_by_key[name] = theirs
        scores[name] = {"scorer": source.spec, **summarize([ours[i] for i in ids], theirs)}
        scores[name].update(verifiable_summary(source, generated, ids, [ours[i] for i in ids]))
        columns[f"rewards_{name}"] = ours_by_key[name] = [ours[i] for i in ids]

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
    if len(sources) > 1 and config.reward_weights:  # beside "scores", the scorers (rlhf report plots each of them)
        weights = config.reward_weights or [1.0] * len(sources)
        results["combined"] = combined_summary(sources, weights, ours_by_key,
                                               theirs_by_key if baseline is not None else None)
    samples = generated.select_columns(
        [c for c in generated.column_names if c not in ("prompt_token_ids", "response_token_ids")]
    )
    for name, values in columns.items():
        samples = samples.add_column(name, values)
    from rlhf_pipeline.datasets_io import atomic_directory, write_text_atomic

    with atomic_directory(out.path / EVAL_SAMPLES) as tmp:
        samples.save_to_disk(str(tmp))
    write_text_atomic(out.path / EVAL_RESULTS, json.dumps(results, indent=2) + "\n")
    manifest = out.manifest(rows_in=generated.num_rows, rows_out=generated.num_rows,
                            extra={"eval": results, "processes": processes})
    out.write_manifest(manifest)
    if out.push_pending(manifest):  # a failed upload is one line; the evaluation stays finished, the push pending
        out.push(manifest)
    shown = dict(scores, **({"combined": results["combined"]} if "combined" in results else {}))
    for name, s in shown.items():
        line = f"[eval] {name}: mean reward {s['mean']:.4f}"
        line += f" ± {s['stderr']:.4f}" if s["stderr"] is not None else ""
        if s["win_rate"] is not None:
            line += f", win rate {s['win_rate']:.3f} against the baseline (mean {s['baseline_mean']:.4f})"
        if "pass_at_k" in s:
            at_k = s["pass_at_k"]
            line += f", pass@1 {at_k['1']['mean']:.3f}, pass@{config.n} {at_k[str(config.n)]['mean']:.3f}"
        print(line)


def push_samples(path: Path, repo_id: str, manifest: bytes) -> None:
    """``--push-to-hub``: the samples (prompts, responses, rewards), with the evaluation's manifest beside them."""
    from rlhf_pipeline.datasets_io import push_dataset_dir

    push_dataset_dir(path / EVAL_SAMPLES, repo_id, manifest)


push_samples.hub_kind = "datasets/"  # type: ignore[attr-defined]


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(EvalConfig, main, "rlhf eval", argv)


if __name__ == "__main__":
    sys.exit(cli())
