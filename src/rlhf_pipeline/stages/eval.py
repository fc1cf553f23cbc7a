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
- beside it, ``lc_win_rate`` and ``lc_stderr``: AlpacaEval 2's length-controlled win rate, the judge's preference
  modelled on the responses' length difference and read at none (``evalstats.length_controlled_win_rate`` says
  how, and how it compares with the ``alpaca-eval`` package's); ``length_controlled`` has the fit. A reward model's
  preferences are its Bradley-Terry probabilities ``sigmoid(r_ours - r_theirs)`` (their mean is
  ``length_controlled.raw_win_rate``), a function's are the outcomes;
- with ``--reference``, ``reference``: the same numbers against fixed reference answers, one per prompt (as
  AlpacaEval compares with GPT-4's), every response of the policy against its prompt's reference;
- for a reward function whose rewards are all 0 or 1 (a verifiable reward, ``rewards.verifiable``), ``pass_at_k``:
  ``{"1": {"mean", "stderr"}, "2": ..., "<n>": ...}`` for k = 1, 2, 4, ... and n, the unbiased estimator of Chen et
  al. 2021 per prompt (``evalstats.pass_at_k``), averaged over prompts; and ``maj_at_k`` the same way when the
  function has ``extract_answer`` (is the most frequent answer among the first k right). The ground truth comes
  from the prompts' column named by ``--reference-column``.

With ``--judge MODEL``, a chat model compares every such pair itself (``rlhf_pipeline.judge``: a documented prompt,
both orders, ties allowed; a baseline that is the evaluated model itself is not judged), sampled greedily by the
same engines; ``results.json``'s ``judge`` has, per comparison
("baseline", "reference"), the win rate (the mean preference, ± its standard error over prompts), its LC win rate,
the unreadable verdicts (counted, never guessed), how often the two orders agree, and how often the judge picked
the answer shown first. The samples get each response's preference and both verdicts.

Several reward models or functions (``--reward-model``/``--reward-fn`` take several, as in ``rlhf score``) are
each a scorer, keyed as ``rlhf score`` keys them (``stages.score.reward_sources``: ``reward_model`` and ``reward_fn``
for the only one of their kind, else ``reward_fn_<name>``). With two or more and ``--reward-weights``,
``results.json`` also has ``combined``: the same numbers for ``rlhf score``'s combination,
``sum_k w_k (r_k - mean_k) / (std_k + eps)`` (without weights each source is reported on its own: a gold function
evaluated beside a reward model, as the demo does, is not a combination anyone trains on). Its statistics are the
*baseline's* (the mean and standard deviation of each source over the baseline's responses), so the policy and the
baseline are put on one scale, the baseline's combined mean is 0, and evaluations against one baseline (every
iteration of ``rlhf iterate``) are comparable; without a baseline they are the evaluated samples' own, and the
combined mean is 0 by construction (its win rate and per-source numbers are
what to read then). The statistics used are in ``combined.statistics``.

``--baseline`` is a model (sampled here with the same settings and seed) or the output directory of an earlier
``rlhf eval`` on the same prompts, whose scored samples are reused instead of generated again (``rlhf iterate``
compares every iteration with ``RUN/iter_0/eval`` this way).

Output, filled in place and resumable (each part is a stage output that a rerun reuses)::

    OUTPUT/generate/               the policy's samples (rlhf generate)
    OUTPUT/score_reward_model/     ... scored by the reward model (rlhf score); score_reward_fn/ for the function
                                   (score_<key>/ for each of several)
    OUTPUT/baseline/...            the same for a baseline model
    OUTPUT/reference/...           the reference answers as generations (one per prompt), scored
    OUTPUT/judge_<baseline|reference>/prompts, generate/
                                   the judge's prompts (each comparison, both orders) and its answers
    OUTPUT/samples/                one dataset: prompt, responses, the rewards of every scorer (and the baseline's
                                   and the references'), the judge's preferences and verdicts
    OUTPUT/lm_eval/results.json    with --lm-eval: EleutherAI's harness on the model (rlhf_pipeline.harness), also
                                   under "lm_eval" in results.json and the manifest
    OUTPUT/results.json            the numbers above (``rlhf report`` plots them)
    OUTPUT/manifest.json           written last
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import (
    DATASET_REF, ChatTemplateOptions, ControlTokenOptions, OutputOptions, default_of, option, options_of, override,
    trust_remote_code_option,
)
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.evalstats import mean_and_stderr, pair_indices, preference_comparison, reward_comparison
from rlhf_pipeline.judge import TEMPLATE_VERSION, request_text
from rlhf_pipeline.layout import EVAL_RESULTS, EVAL_SAMPLES, LM_EVAL_DIR, MANIFEST
from rlhf_pipeline.sampling_options import SamplingOptions
from rlhf_pipeline.stages import score as score_stage  # its ScoreConfig by the module: one *Config here (cli)
from rlhf_pipeline.stages.score import RewardSource, check_reward_options, one_or_list, reward_sources

if TYPE_CHECKING:
    from rlhf_pipeline.datasets_io import HubTarget


# What must match for an earlier evaluation's samples to serve as the baseline, and for its scores.
SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "limit", "chat_template")
SCORING_KEYS = ("reference_column",)
MODEL_SCORING_KEYS = ("max_length", "chat_template", "dtype")  # a reward model's besides


@dataclass(kw_only=True)
class EvalConfig(ChatTemplateOptions, ControlTokenOptions, SamplingOptions, OutputOptions):
    """Generate on held-out prompts, score, and report the mean reward and the win rate against a baseline.
    The sampling and engine options are rlhf generate's; --dtype, --trust-remote-code and --chat-template apply to
    the reward model too (not to a --judge, which renders with its own template and runs its own code only with
    --judge-trust-remote-code), and a baseline model is sampled with the same options and --seed."""

    model: str = option(help="Policy to evaluate: a local directory or a Hub model id.")
    prompts: str = option(help=f"Held-out prompt dataset: {DATASET_REF}.",
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
    reference: Optional[str] = option(
        None, help="Compare with fixed reference answers, one per prompt, as AlpacaEval does (a dataset directory, "
        ".json/.jsonl/.parquet file or Hub id with a prompt_id, prompt or instruction column to match the prompts "
        "by, and a response, output or reference column); instead of, or beside, --baseline."
    )
    judge: Optional[str] = option(
        None, help="A chat model that judges the evaluated responses against the baseline's and the references' "
        "(pairwise, both orders; rlhf_pipeline.judge has the prompt), sampled greedily with --engine."
    )
    judge_max_new_tokens: int = option(256, help="Tokens the judge may write for its reason and verdict.")
    judge_trust_remote_code: bool = trust_remote_code_option(
        "model code of the --judge", " (--trust-remote-code covers the policy, the baseline and the reward models, "
        "not the judge)")
    n: int = override(SamplingOptions, "n", 1)
    # Left out of eval's own reuse check; the generate step in OUTPUT/generate checks it against its manifest.
    batch_size: int = override(SamplingOptions, "batch_size", semantic=False)
    score_batch_size: int = option(default_of(score_stage.ScoreConfig, "batch_size"),
                                   help="Sequences per reward-model forward.", semantic=False)
    max_length: int = override(score_stage.ScoreConfig, "max_length")  # rlhf score's, for the same scorers
    reference_column: Optional[str] = option(
        None, help="The prompts' column holding the ground truth, passed to reward functions as 'reference' (as rlhf "
        "score's --reference-column); default: a column named reference, answer, solution or ground_truth."
    )
    lm_eval: Optional[list[str]] = option(
        None, help="Also run EleutherAI's lm-eval harness on the model (pip install 'rlhf-pipeline[lm-eval]'): task "
        "names (rlhf_arith, bundled; gsm8k, ... where the Hub is reachable), YAML task files or directories of them; "
        "comma-separated, repeated or a YAML list. Results in OUTPUT/lm_eval/results.json and results.json."
    )
    lm_eval_backend: Optional[Literal["hf", "vllm"]] = option(
        None, help="lm-eval's model backend (default: the --engine, auto meaning vllm when it imports and a GPU is "
        "present)."
    )
    lm_eval_limit: Optional[int] = option(None, help="lm-eval: evaluate only the first LIMIT rows of each task.")
    lm_eval_num_fewshot: Optional[int] = option(None, help="lm-eval: few-shot examples (default: each task's own).")

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
        if self.judge_max_new_tokens < 1:
            raise ValueError("--judge-max-new-tokens must be at least 1")
        if self.judge is not None and self.baseline is None and self.reference is None:
            raise ValueError("--judge compares two answers: give --baseline, --reference, or both")
        from rlhf_pipeline.harness import parse_tasks

        self.lm_eval = parse_tasks(self.lm_eval)
        if self.lm_eval_limit is not None and self.lm_eval_limit < 1:
            raise ValueError("--lm-eval-limit must be at least 1")
        if self.lm_eval_num_fewshot is not None and self.lm_eval_num_fewshot < 0:
            raise ValueError("--lm-eval-num-fewshot must be at least 0")


def summarize(rewards: Sequence[Sequence[float]], baseline: Sequence[Sequence[float]] | None,
              lengths: Sequence[Sequence[int]] | None = None, baseline_lengths: Sequence[Sequence[int]] | None = None,
              bradley_terry: bool = False) -> dict[str, Any]:
    """One scorer's numbers: ``rewards[i]`` are prompt i's rewards (``baseline`` aligned with them, or None; one
    reward per prompt for reference answers), ``lengths`` the responses' lengths in characters for the
    length-controlled win rate (without them it is fitted with no length term), ``bradley_terry`` for a reward
    model's scores (see :func:`evalstats.reward_comparison`). With a baseline, ``gain`` is the mean reward's gain over
    it, and ``gain_stderr`` its paired standard error: over the prompts, of each prompt's mean reward less the
    baseline's on the same prompt (the two evaluations share their prompts, so a prompt's difficulty cancels;
    the two standard errors combined as if independent would count it twice)."""
    means = [sum(r) / len(r) for r in rewards]
    mean, stderr = mean_and_stderr(means)
    result: dict[str, Any] = {"mean": mean, "stderr": stderr, "baseline_mean": None, "baseline_stderr": None,
                              "gain": None, "gain_stderr": None,
                              "win_rate": None, "win_rate_stderr": None, "wins": None, "ties": None, "losses": None,
                              "lc_win_rate": None, "lc_stderr": None, "length_controlled": None}
    if baseline is not None:
        theirs = [sum(b) / len(b) for b in baseline]
        result["baseline_mean"], result["baseline_stderr"] = mean_and_stderr(theirs)
        result["gain"], result["gain_stderr"] = mean_and_stderr([a - b for a, b in zip(means, theirs)])
        zeros = [[0] * len(r) for r in rewards], [[0] * len(r) for r in baseline]
        ours_len, theirs_len = (lengths, baseline_lengths) if lengths is not None else zeros
        result.update(reward_comparison(rewards, baseline, ours_len, theirs_len, bradley_terry))
    return result


def verifiable_summary(source: RewardSource, responses: list[list[str]], rewards: list[list[float]]
                       ) -> dict[str, Any]:
    """pass@k (and maj@k) of a reward function whose rewards are all 0 or 1 (a verifiable reward: right or wrong),
    ``rewards[i]`` those of prompt i's ``responses[i]``: ``{"pass_at_k": {"1": {"mean", "stderr"}, ...}}`` for
    k = 1, 2, 4, ..., n (evalstats.k_ladder), and ``maj_at_k`` the same way when the function carries
    ``extract_answer(response)`` (the answer a response votes for, as rewards.verifiable's do); empty for anything
    else."""
    from rlhf_pipeline.errors import UserCodeError, one_line
    from rlhf_pipeline.evalstats import maj_at_k_summary, pass_at_k_summary

    if source.kind != "reward_fn" or not rewards or any(r not in (0.0, 1.0) for rs in rewards for r in rs):
        return {}
    from rlhf_pipeline.rewards import load_reward_fn

    result: dict[str, Any] = {"pass_at_k": pass_at_k_summary(rewards)}
    extract = getattr(load_reward_fn(source.spec), "extract_answer", None)
    if callable(extract):
        answers = []
        for row, texts in enumerate(responses):
            try:
                answers.append([extract(r) for r in texts])
            except (Exception, SystemExit) as e:  # the user's code: its traceback, then one line
                raise UserCodeError(f"the reward function {source.spec}: its extract_answer raised on the responses "
                                    f"of prompt {row}: {one_line(e)}", e) from e
        result["maj_at_k"] = maj_at_k_summary(answers, rewards)
    return result


def _scorers(config: EvalConfig) -> list[RewardSource]:
    return reward_sources(config.reward_model, config.reward_fn)


def combined_summary(sources: list[RewardSource], weights: Sequence[float], ours: dict[str, list[list[float]]],
                     theirs: dict[str, list[list[float]]] | None, lengths: Sequence[Sequence[int]] | None = None,
                     baseline_lengths: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
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

    summary = summarize(combine(ours), combine(theirs) if theirs is not None else None, lengths, baseline_lengths)
    return {
        "weights": {s.key: w for s, w in zip(sources, weights)},
        "statistics_from": "baseline" if theirs is not None else "evaluated samples",
        "statistics": {s.key: st.as_dict() for s, st in zip(sources, stats)},
        **summary,
    }


def _sample_and_score(config: EvalConfig, model: str, directory: Path, accelerator=None) -> dict[str, Path]:
    """Generate with ``model`` into ``directory/generate`` and score it with every scorer. Under ``accelerate
    launch`` the main process samples (the other processes wait) and every process scores its share."""
    from rlhf_pipeline.stages import generate
    from rlhf_pipeline.distributed import on_main_process

    gen = generate.GenerateConfig(
        output=str(directory / "generate"), model=model, prompts=config.prompts, logprobs=False,
        overwrite=config.overwrite,  # a part another run left (an unfinished eval continued) is replaced too
        **options_of(config, SamplingOptions), **options_of(config, ControlTokenOptions),
        **options_of(config, ChatTemplateOptions),
    )
    on_main_process(accelerator, lambda: generate.main(gen))
    return _score_all(config, directory / "generate", directory, accelerator)


def _score_all(config: EvalConfig, generations: Path, directory: Path, accelerator=None) -> dict[str, Path]:
    """Score ``generations`` with every scorer into ``directory/score_<key>`` (each alone, raw rewards: the
    combination is made in _report)."""
    from rlhf_pipeline.stages import score

    paths = {"generate": generations}
    for source in _scorers(config):
        paths[source.key] = score.score(score.ScoreConfig(
            output=str(directory / f"score_{source.key}"), input=str(generations), overwrite=config.overwrite,
            batch_size=config.score_batch_size, max_length=config.max_length, dtype=config.dtype,
            attn_implementation=config.attn_implementation, trust_remote_code=config.trust_remote_code,
            reference_column=config.reference_column, **options_of(config, ControlTokenOptions),
            **options_of(config, ChatTemplateOptions), **{source.kind: source.spec},
        ), accelerator)
    return paths


# Columns of a --reference dataset, in the order they are looked for.
REFERENCE_IDS = ("prompt_id", "id")  # matched by id when the prompts have one of these too
REFERENCE_TEXTS = ("prompt", "instruction")  # else by the prompt's text
REFERENCE_KEYS = REFERENCE_IDS + REFERENCE_TEXTS
REFERENCE_ANSWERS = ("response", "output", "reference")


def _reference_answers(config: EvalConfig, prompts, column: str) -> dict[str, str]:
    """``--reference``: one answer per evaluated prompt, by prompt_id. A reference row is matched to a prompt by
    ``prompt_id`` (or ``id``) when both have one, else by the prompt's text (its last user turn) against the reference's
    ``prompt`` or ``instruction`` (AlpacaEval's files have ``instruction`` and ``output``). ``prompts`` are the
    evaluated prompts (``generate.select_prompts``), ``column`` their prompt column."""
    from rlhf_pipeline.chat import as_text
    from rlhf_pipeline.datasets_io import load_dataset_ref, parse_ref
    from rlhf_pipeline.stages.generate import ids_of_prompts

    name = f"--reference {config.reference}"
    refs = load_dataset_ref(parse_ref(config.reference))
    answer = next((c for c in REFERENCE_ANSWERS if c in refs.column_names), None)
    if answer is None:
        raise PipelineError(f"{name}: has no answer column ({', '.join(REFERENCE_ANSWERS)}); its columns are "
                            f"{', '.join(refs.column_names)}: rename the one with the reference answers")
    ids = ids_of_prompts(prompts, column)
    own_id = next((c for c in REFERENCE_IDS if c in prompts.column_names), None)
    ref_id = next((c for c in REFERENCE_IDS if c in refs.column_names), None)
    if own_id is not None and ref_id is not None:
        keys, key = ids, ref_id
        how = f"by id (the prompts' {own_id} against its {ref_id})"
    else:
        key = next((c for c in REFERENCE_TEXTS if c in refs.column_names), None)
        if key is None:
            raise PipelineError(f"{name}: has no column to match the prompts by ({', '.join(REFERENCE_KEYS)}); its "
                                f"columns are {', '.join(refs.column_names)}")
        keys = [as_text(p).strip() for p in prompts[column]]
        how = f"by text (the prompts' last user turn against its {key})"
    by_key: dict[str, tuple[int, str]] = {}
    for row, (k, text) in enumerate(zip(refs[key], refs[answer])):
        if k is None or not isinstance(text, str):
            bad, what = (key, k) if k is None else (answer, text)
            raise PipelineError(f"{name}: row {row}: the {bad} column holds {type(what).__name__}, not text; give "
                                "every row a prompt and an answer")
        k = str(k) if key == ref_id else as_text(k).strip()
        if k in by_key and by_key[k][1] != text:
            raise PipelineError(f"{name}: rows {by_key[k][0]} and {row} give different answers for the same prompt "
                                f"({k[:80]!r}); keep one answer per prompt")
        by_key.setdefault(k, (row, text))
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise PipelineError(f"{name}: has no answer for {len(missing)} of the {len(keys)} evaluated prompts, matched "
                            f"{how} (e.g. {missing[0][:80]!r}); give one answer per prompt of --prompts (and "
                            "--limit)")
    text_key = next((c for c in REFERENCE_TEXTS if c in refs.column_names), None)
    if key == ref_id and text_key is not None:  # matched by id, and the reference says its prompt too: they agree
        texts = refs[text_key]
        for k, prompt in zip(keys, prompts[column]):
            row = by_key[k][0]
            theirs, ours = as_text(texts[row] or "").strip(), as_text(prompt).strip()
            if theirs != ours:
                raise PipelineError(
                    f"{name}: row {row} ({ref_id} {k}) answers the prompt {theirs[:60]!r}, but the evaluated prompt of "
                    f"that id is {ours[:60]!r}; the ids of the two files do not match: fix them, or drop the "
                    f"{ref_id} column to match by text"
                )
    return {i: by_key[k][1] for i, k in zip(ids, keys)}


def _reference_scores(config: EvalConfig, prompts_ref, own: dict[str, Path], directory: Path, accelerator=None
                      ) -> dict[str, Path]:
    """The reference answers as generations (``directory/generate``: the evaluated prompts, one response each),
    scored by every scorer as the policy's samples are."""
    from datasets import load_from_disk

    from rlhf_pipeline.datasets_io import atomic_directory
    from rlhf_pipeline.distributed import on_main_process
    from rlhf_pipeline.stages.generate import select_prompts

    def write() -> None:
        if (directory / "generate").exists():
            return
        prompts, column, _, _ = select_prompts(prompts_ref, limit=config.limit, prompt_column=config.prompt_column)
        answers = _reference_answers(config, prompts, column)
        generated = load_from_disk(str(own["generate"]))
        keep = [c for c in generated.column_names if c not in ("prompt_token_ids", "response_token_ids",
                                                                "responses", "finish_reasons", "response_logprobs")]
        rows = generated.select_columns(keep)
        rows = rows.add_column("responses", [[answers[str(i)]] for i in rows["prompt_id"]])
        rows = rows.add_column("finish_reasons", [["stop"]] * rows.num_rows)
        with atomic_directory(directory / "generate") as tmp:
            rows.save_to_disk(str(tmp))

    on_main_process(accelerator, write)
    return _score_all(config, directory / "generate", directory, accelerator)


def _judge(config: EvalConfig, target: str, ours: Path, theirs: Path, directory: Path, accelerator=None) -> Path:
    """``--judge``: every comparison of the evaluated responses (``ours``, a generations dataset) with the other
    side's (``theirs``), in both orders, as a prompt dataset ``directory/prompts``; the judge's answers are
    ``directory/generate`` (rlhf generate, greedy). Returns that directory."""
    from datasets import Dataset

    from rlhf_pipeline.datasets_io import atomic_directory, fingerprint, parse_ref, write_text_atomic
    from rlhf_pipeline.distributed import on_main_process
    from rlhf_pipeline.judge import judge_prompts
    from rlhf_pipeline.stages import generate

    def run() -> None:
        # What the prompts were built from: a rerun of an unfinished eval whose other side changed since (an earlier
        # evaluation given as --baseline, run again) builds them, and the judge's answers, anew.
        compared = {side: fingerprint(parse_ref(str(path))) for side, path in (("ours", ours), ("theirs", theirs))}
        # and how its prompts' ids are made: those of a version that gave a prompt twice one id for both rows
        # (their judge prompts clash) are made again
        compared["ids"] = JUDGE_IDS
        compared["template"] = TEMPLATE_VERSION  # and what the judge is shown
        record = directory / "compared.json"
        if record.exists() and json.loads(record.read_text()) != compared:
            for part in ("prompts", "generate"):
                shutil.rmtree(directory / part, ignore_errors=True)
        if not (directory / "prompts").exists():
            directory.mkdir(parents=True, exist_ok=True)
            write_text_atomic(record, json.dumps(compared) + "\n")
            ids, prompts, our_texts, their_texts = _aligned_texts(ours, theirs, _flag(config, target))
            rows = {"prompt_id": [], "prompt": []}
            for i, j, k in pair_indices(our_texts, their_texts):
                for order, text in enumerate(judge_prompts(request_text(prompts[i]), our_texts[i][j],
                                                           their_texts[i][k])):
                    rows["prompt_id"].append(_judge_id(ids[i], j, k, order))
                    rows["prompt"].append(text)
            with atomic_directory(directory / "prompts") as tmp:
                Dataset.from_dict(rows).save_to_disk(str(tmp))
        options = {**options_of(config, SamplingOptions), **options_of(config, ControlTokenOptions), "n": 1,
                   "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": config.judge_max_new_tokens,
                   "limit": None, "prompt_column": None,  # the judge's prompts are made here, under 'prompt'
                   # its own context: a judge prompt holds two answers and the template, longer than the policy's
                   "max_model_len": None,
                   "trust_remote_code": config.judge_trust_remote_code}
        generate.main(generate.GenerateConfig(output=str(directory / "generate"), model=config.judge,
                                              prompts=str(directory / "prompts"), logprobs=False,
                                              overwrite=config.overwrite, **options))

    on_main_process(accelerator, run)
    return directory / "generate"


def _flag(config: EvalConfig, target: str) -> str:
    return f"--{target} {getattr(config, target)}"


JUDGE_IDS = "row_key|ours|theirs|order"  # _judge_id's scheme, recorded in compared.json


def _judge_id(prompt_id: str, ours: int, theirs: int, order: int) -> str:
    return f"{prompt_id}|{ours}|{theirs}|{order}"


def _row_keys(prompt_ids) -> list[str]:
    """Each row's key for matching it with the other side's row of the same prompt: its prompt_id, made unique. A
    prompt given twice (rlhf generate takes it, and samples each row from its own seed) keeps its id on its first
    row, and its k-th row is ``ID#k``: the k-th row of an id is matched with the other side's k-th row of that id,
    rather than every row with the last one of its id (whose rewards were then counted twice, and whose judge
    prompts clashed)."""
    ids = [str(x) for x in prompt_ids]
    taken, seen, keys = set(ids), {}, []
    for i in ids:
        seen[i] = seen.get(i, 0) + 1
        key = i if seen[i] == 1 else f"{i}#{seen[i]}"
        while key != i and key in taken:  # a prompt_id of the data that reads like one of these keys
            key += "#"
        taken.add(key)
        keys.append(key)
    return keys


def _aligned_texts(ours: Path, theirs: Path, label: str):
    """``(row keys, prompts, our responses, their responses)`` per row of ``ours``, theirs aligned by
    :func:`_row_keys`."""
    from datasets import load_from_disk

    mine = load_from_disk(str(ours))
    other = load_from_disk(str(theirs))
    column = next(c for c in ("prompt", "messages") if c in mine.column_names)
    by_id = dict(zip(_row_keys(other["prompt_id"]), other["responses"]))
    ids = _row_keys(mine["prompt_id"])
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise PipelineError(f"{label}: has no samples for {len(missing)} of the {len(ids)} prompts (e.g. prompt_id "
                            f"{missing[0]}); evaluate both on the same --prompts and --limit")
    return ids, mine[column], mine["responses"], [by_id[i] for i in ids]


def _earlier_eval(path: str) -> Path | None:
    """The directory of a finished ``rlhf eval`` output, or None when ``path`` is not one (then it is a model)."""
    p = Path(path).expanduser()
    manifest = p / MANIFEST
    if not manifest.is_file():
        if (p / "generate").is_dir() and not (p / "config.json").is_file():
            raise PipelineError(f"--baseline {path}: holds an unfinished rlhf eval (no {MANIFEST} yet); run its "
                                "command again to finish it, then pass it, or pass the baseline model")
        return None
    stage = json.loads(manifest.read_text()).get("stage")
    if stage == "eval":
        return p
    if (p / "config.json").is_file():  # a model written by a training stage (sft, train, train-rm)
        return None
    raise PipelineError(f"--baseline {path}: holds a {stage} output, not a model or an rlhf eval output")


def _check_inputs(config: EvalConfig, ref, prompts_record: dict[str, Any]) -> Path | None:
    """Everything eval reads, checked before it makes its output directory: the models, the reward function, the
    prompts and the baseline (and Ray, for --executor ray). Returns the earlier evaluation given as ``--baseline``
    (None for a model, or none). ``prompts_record`` is the prompts' input record (``datasets_io.input_record``)."""
    from rlhf_pipeline.attention import check_attn_implementation, check_engine
    from rlhf_pipeline.datasets_io import parse_ref, same_input
    from rlhf_pipeline.engines import resolve_engine_name
    from rlhf_pipeline.executors import check_ray_installed
    from rlhf_pipeline.stages.generate import select_prompts
    from rlhf_pipeline.stages.score import check_reference_column
    from rlhf_pipeline.modeling import check_causal_lm_code, check_model_ref, check_reward_model
    from rlhf_pipeline.rewards import load_reward_fn

    if config.executor == "ray":
        check_ray_installed()
    check_model_ref("--model", config.model)
    check_attn_implementation(config.attn_implementation)
    if config.executor == "local":  # --engine auto, now resolved (a Ray replica resolves its own)
        check_engine(config.attn_implementation, resolve_engine_name(config.engine))
    fns = []
    for source in _scorers(config):
        if source.kind == "reward_model":
            check_reward_model(source.flag, source.spec, config.trust_remote_code, judge=True)
        else:
            fns.append(load_reward_fn(source.spec))
    prompts, column, _, _ = select_prompts(ref, limit=config.limit, prompt_column=config.prompt_column)
    check_reference_column(prompts, ref.name, config.reference_column, "rlhf eval carries", fns)
    if config.reference is not None:
        _reference_answers(config, prompts, column)
    if config.judge is not None:
        check_model_ref("--judge", config.judge)
        check_causal_lm_code("--judge", config.judge, config.judge_trust_remote_code, "--judge-trust-remote-code")
    if config.lm_eval:
        from rlhf_pipeline.harness import check_tasks

        backend = config.lm_eval_backend or resolve_engine_name(config.engine)
        check_tasks(config.lm_eval, backend)
        check_engine(config.attn_implementation, backend, engine_flag="--lm-eval-backend")
    if config.baseline is None or config.baseline == config.model:
        return None
    earlier = _earlier_eval(config.baseline)
    if earlier is None:
        check_model_ref("--baseline", config.baseline, hint="a model, or the output directory of a finished rlhf eval")
        return None
    previous = json.loads((earlier / MANIFEST).read_text())  # _earlier_eval checked it
    previous_config = previous["config"]
    previous_prompts = (previous.get("inputs") or [{}])[0]
    earlier_ref = parse_ref(previous_prompts["ref"]) if "ref" in previous_prompts else None
    # a Hub dataset's fingerprint does not say which split or configuration: those are compared too
    other_part = earlier_ref is not None and (earlier_ref.config, earlier_ref.split) != (ref.config, ref.split)
    if other_part or ("fingerprint" in previous_prompts and not same_input(previous_prompts, prompts_record)):
        raise PipelineError(
            f"--baseline {config.baseline}: that evaluation was made on other prompts ({previous['inputs'][0]['ref']}, "
            f"not {ref}, or that file has changed since); a win rate compares responses to the same prompts, so "
            "evaluate the baseline on these prompts, or pass the baseline model"
        )
    differ = [k for k in SAMPLING_KEYS if previous_config.get(k) != getattr(config, k)]
    if differ:
        raise PipelineError(
            f"--baseline {config.baseline}: that evaluation sampled with other settings ("
            + ", ".join(f"--{k.replace('_', '-')} {previous_config.get(k)} vs {getattr(config, k)}" for k in differ)
            + "); a win rate compares like with like, so use the same settings or pass the baseline model"
        )
    for source in _scorers(config):
        scored = earlier / f"score_{source.key}"
        previous = json.loads((scored / MANIFEST).read_text()) if (scored / MANIFEST).exists() else None
        if previous is None or previous["config"].get(source.kind) != source.spec:
            raise PipelineError(
                f"--baseline {config.baseline}: that evaluation was not scored with {source.flag} {source.spec}; "
                "evaluate the baseline with the same scorers, or pass the baseline model instead"
            )
        keys = SCORING_KEYS + (MODEL_SCORING_KEYS if source.kind == "reward_model" else ())
        differ = [k for k in keys if previous["config"].get(k) != getattr(config, k)]
        if differ:
            raise PipelineError(
                f"--baseline {config.baseline}: that evaluation scored with {source.flag} {source.spec} under other "
                "settings (" + ", ".join(f"--{k.replace('_', '-')} {previous['config'].get(k)} vs {getattr(config, k)}"
                                         for k in differ)
                + "); evaluate the baseline with the same settings, or pass the baseline model instead"
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
    previous_model = json.loads((earlier / MANIFEST).read_text())["config"]["model"]
    changed = _changed_scorers(config, earlier)
    if changed:  # the samples stand; their rewards are another scorer's: scored again, beside this evaluation's
        print(f"[eval] {'; '.join(changed)} changed since {earlier} scored its samples: scoring them again")
        return (_score_all(config, earlier / "generate", out_dir / "baseline", accelerator),
                f"{previous_model} (samples of {earlier}, scored again)")
    return ({"generate": earlier / "generate", **{s.key: earlier / f"score_{s.key}" for s in _scorers(config)}},
            f"{previous_model} (samples of {earlier})")


def _changed_scorers(config: EvalConfig, earlier: Path) -> list[str]:
    """The scorers whose files (a reward model trained again, or rebuilt, at the same path) or code (a reward
    function's file edited) have changed since the earlier evaluation ``earlier`` scored its samples, as its score
    manifests record them (``scored_by``; one written before they did is taken as unchanged)."""
    from rlhf_pipeline.stages.score import scorer_identity

    changed = []
    for source in _scorers(config):
        manifest = json.loads((earlier / f"score_{source.key}" / MANIFEST).read_text())
        recorded = [r for r in manifest.get("scored_by") or [] if r.get("spec") == source.spec]
        if recorded and recorded[0] != scorer_identity(source):
            changed.append(f"{source.flag} {source.spec}")
    return changed


def _rewards_by_prompt(path: Path) -> tuple[list[str], dict[str, list[float]]]:
    from datasets import load_from_disk

    ds = load_from_disk(str(path))
    ids = _row_keys(ds["prompt_id"])
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
        inputs = [ref] + ([parse_ref(config.reference)] if config.reference is not None else [])
        out = StageOutput("eval", config, inputs=inputs, pusher=push_samples)
        if out.done(resume=True, parts_check_themselves=True):  # an unfinished eval continues
            return None
        # before the output directory is made: a mistake leaves nothing
        return out, _check_inputs(config, ref, out.input_records[0]), ref

    begun = guarded(accelerator, begin)
    if begun is None:
        return Path(config.output).expanduser()
    out, earlier, prompts_ref = begun

    def start() -> None:
        if out.replace:
            shutil.rmtree(out.path)
        out.record_start()

    on_main_process(accelerator, start)
    baseline, baseline_desc = _baseline_scores(config, earlier, out.path, accelerator)
    own = _sample_and_score(config, config.model, out.path, accelerator)
    if config.baseline == config.model:
        baseline = own
    others = {}  # what the evaluated samples are compared with: "baseline", "reference"
    if baseline is not None:
        others["baseline"] = baseline
    if config.reference is not None:
        others["reference"] = _reference_scores(config, prompts_ref, own, out.path / "reference", accelerator)
    judged = {}
    if config.judge is not None:
        for target, paths in others.items():
            if target == "baseline" and config.baseline == config.model:
                continue  # the model against itself (rlhf iterate's iteration 0): a tie by construction, not judged
            judged[target] = _judge(config, target, own["generate"], paths["generate"], out.path / f"judge_{target}",
                                    accelerator)
    if config.lm_eval:  # last, on the main process alone: the harness loads its own model and engine
        on_main_process(accelerator, lambda: _lm_eval(config, out.path))
    processes = world_and_rank(accelerator)[0]
    on_main_process(accelerator, lambda: _report(config, out, own, others, baseline_desc, judged, processes))
    return out.path


def _lm_eval(config: EvalConfig, out_path: Path) -> dict[str, Any]:
    """``--lm-eval``: EleutherAI's harness on the evaluated model (``harness.run_harness``), kept in
    ``OUTPUT/lm_eval/results.json``, which a rerun of an unfinished evaluation reuses when it asked the same."""
    from rlhf_pipeline.datasets_io import write_text_atomic
    from rlhf_pipeline.engines import resolve_engine_name
    from rlhf_pipeline.files import directory_signature
    from rlhf_pipeline.harness import run_harness

    path = out_path / LM_EVAL_DIR / EVAL_RESULTS
    backend = config.lm_eval_backend or resolve_engine_name(config.engine)
    # the model's files too (not its manifest, which a pending upload rewrites): a policy retrained into the same
    # directory since is another model (a Hub id: its id alone)
    asked = {"model": config.model, "model_files": directory_signature(config.model, skip=(MANIFEST,)),
             "requested": config.lm_eval, "backend": backend, "limit": config.lm_eval_limit,
             "num_fewshot": config.lm_eval_num_fewshot}
    if path.is_file():
        earlier = json.loads(path.read_text())
        if all(earlier.get(k) == v for k, v in asked.items()):
            return earlier
    results = run_harness(
        config.model, config.lm_eval, backend=backend, dtype=config.dtype, trust_remote_code=config.trust_remote_code,
        attn_implementation=config.attn_implementation, batch_size=config.batch_size, limit=config.lm_eval_limit,
        num_fewshot=config.lm_eval_num_fewshot, seed=config.seed,
        vllm_options={"tensor_parallel_size": config.tensor_parallel_size,
                      "gpu_memory_utilization": config.gpu_memory_utilization, "max_model_len": config.max_model_len},
    )
    results = {**results, "model_files": asked["model_files"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(results, indent=2) + "\n")
    return results


def _report(config: EvalConfig, out, own: dict[str, Path], others: dict[str, dict[str, Path]],
            baseline_desc: str | None, judged: dict[str, Path], processes: int) -> None:
    """The numbers, the samples and the manifest (the main process only). ``others`` are the scored samples the
    evaluated ones are compared with ("baseline", "reference"), ``judged`` the judge's answers for each."""
    from datasets import load_from_disk

    generated = load_from_disk(str(own["generate"]))
    ids = _row_keys(generated["prompt_id"])
    texts = {"ours": generated["responses"]}
    for target, paths in others.items():
        texts[target] = _aligned_texts(own["generate"], paths["generate"], _flag(config, target))[3]
    lengths = {side: [[len(t) for t in row] for row in rows] for side, rows in texts.items()}
    scores, columns, ours_by_key, theirs_by_key = {}, {}, {}, {}
    sources = _scorers(config)
    for source in sources:
        name = source.key
        bradley_terry = source.kind == "reward_model"
        ours_map = _rewards_by_prompt(own[name])[1]
        ours = ours_by_key[name] = [ours_map[i] for i in ids]
        theirs = {}
        for target, paths in others.items():
            by_id = _rewards_by_prompt(paths[name])[1]
            missing = [i for i in ids if i not in by_id]
            if missing:
                raise PipelineError(
                    f"{_flag(config, target)}: has no samples for {len(missing)} of the {len(ids)} prompts (e.g. "
                    f"prompt_id {missing[0]}); evaluate both on the same --prompts and --limit"
                )
            theirs[target] = [by_id[i] for i in ids]
            columns[f"{target}_rewards_{name}"] = theirs[target]
        if "baseline" in theirs:
            theirs_by_key[name] = theirs["baseline"]
        entry = {"scorer": source.spec, **summarize(ours, theirs.get("baseline"), lengths["ours"],
                                                    lengths.get("baseline"), bradley_terry)}
        if "reference" in theirs:
            ref = summarize(ours, theirs["reference"], lengths["ours"], lengths["reference"], bradley_terry)
            entry["reference"] = {"mean": ref["baseline_mean"], "stderr": ref["baseline_stderr"],
                                  **{k: v for k, v in ref.items() if k not in ("mean", "stderr", "baseline_mean",
                                                                               "baseline_stderr")}}
        entry.update(verifiable_summary(source, texts["ours"], ours))
        scores[name] = entry
        columns[f"rewards_{name}"] = ours

    reasons = [r for row in generated["finish_reasons"] for r in row]
    results = {
        "model": config.model,
        "baseline": baseline_desc,
        "reference": config.reference,
        "num_prompts": generated.num_rows,
        "n": config.n,
        "response_tokens_mean": _mean([len(t) for row in generated["response_token_ids"] for t in row]),
        "response_chars_mean": _mean([x for row in lengths["ours"] for x in row]),
        "stop_fraction": reasons.count("stop") / max(len(reasons), 1),
        "scores": scores,
    }
    if config.lm_eval:
        results["lm_eval"] = _lm_eval(config, out.path)  # written by now: read back
    if len(sources) > 1 and config.reward_weights:  # beside "scores", the scorers (rlhf report plots each of them)
        results["combined"] = combined_summary(sources, config.reward_weights, ours_by_key,
                                               theirs_by_key if "baseline" in others else None,
                                               lengths["ours"], lengths.get("baseline"))
    if judged:
        results["judge"] = {"model": config.judge, "template": TEMPLATE_VERSION}
        for target, path in judged.items():
            results["judge"][target], judge_columns = _judge_results(path, ids, texts["ours"], texts[target], target)
            columns.update(judge_columns)
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
    for line in summary_lines(results):
        print(line)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / max(len(values), 1)


def _judge_results(path: Path, ids: list[str], ours: list[list[str]], theirs: list[list[str]], target: str):
    """The judge's numbers against ``target`` (:func:`evalstats.preference_comparison` and
    :func:`judge.judge_summary`) and the samples' columns: per response, its preference and the verdicts of both
    orders (``"AB"``: A when shown first, B when shown second; ``?`` for a verdict that could not be read)."""
    from datasets import load_from_disk

    from rlhf_pipeline.judge import combine_orders, judge_summary, parse_verdict

    answers = load_from_disk(str(path))
    verdict = {str(i): parse_verdict(r[0]) for i, r in zip(answers["prompt_id"], answers["responses"])}
    preferences, differences, prompts, pairs = [], [], [], []
    per_row_pref: list[list] = [[] for _ in ids]
    per_row_verdicts: list[list[str]] = [[] for _ in ids]
    for i, j, k in pair_indices(ours, theirs):
        first, second = (verdict[_judge_id(ids[i], j, k, order)] for order in (0, 1))
        preference = combine_orders(first, second)
        preferences.append(preference)
        differences.append(len(ours[i][j]) - len(theirs[i][k]))
        prompts.append(i)
        pairs.append((first, second))
        per_row_pref[i].append(preference)
        per_row_verdicts[i].append((first or "?") + (second or "?"))
    numbers = {**preference_comparison(preferences, differences, prompts), **judge_summary(pairs)}
    return numbers, {f"judge_{target}_preference": per_row_pref, f"judge_{target}_verdicts": per_row_verdicts}


def summary_lines(results: dict[str, Any]) -> list[str]:
    """What ``rlhf eval`` prints: per scorer the mean reward and the win rates, raw and length-controlled."""

    def rate(s: dict[str, Any]) -> str:
        text = f"win rate {s['win_rate']:.3f}" + (f" ± {s['win_rate_stderr']:.3f}"
                                                  if s.get("win_rate_stderr") is not None else "")
        fit = s.get("length_controlled")
        if fit is not None:
            # a reward model's LC is fitted on its Bradley-Terry probabilities: their mean is the raw figure beside it
            soft = f"mean preference {fit['raw_win_rate']:.3f}, " if fit["preferences"] == "bradley-terry" else ""
            text += f" ({soft}LC {fit['win_rate']:.3f}" + (f" ± {fit['stderr']:.3f}" if fit["stderr"] is not None
                                                           else "") + ")"
        return text

    lines = []
    shown = dict(results["scores"], **({"combined": results["combined"]} if "combined" in results else {}))
    for name, s in shown.items():
        line = f"[eval] {name}: mean reward {s['mean']:.4f}"
        line += f" ± {s['stderr']:.4f}" if s["stderr"] is not None else ""
        if s["win_rate"] is not None:
            line += f", {rate(s)} against the baseline (mean {s['baseline_mean']:.4f})"
        if "pass_at_k" in s:
            at_k, n = s["pass_at_k"], results["n"]
            line += f", pass@1 {at_k['1']['mean']:.3f}, pass@{n} {at_k[str(n)]['mean']:.3f}"
        reference = s.get("reference")
        if reference and reference["win_rate"] is not None:
            line += f", {rate(reference)} against the references (mean {reference['mean']:.4f})"
        lines.append(line)
    for task, r in (results.get("lm_eval") or {}).get("tasks", {}).items():
        lines.append(f"[eval] lm-eval {task}: " + ", ".join(
            f"{m} {v['value']:.4f}" + (f" ± {v['stderr']:.4f}" if v["stderr"] is not None else "")
            for m, v in r["metrics"].items() if v["value"] is not None))
    judge = results.get("judge") or {}
    for target in ("baseline", "reference"):
        j = judge.get(target)
        if j is None:
            continue
        line = f"[eval] judge {judge['model']} against the {target}: "
        line += rate(j) if j["win_rate"] is not None else "no comparison had both verdicts read"
        line += (f"; {j['unreadable']} of {j['verdicts']} verdicts unreadable, the two orders agree on "
                 + (f"{j['consistency']:.0%}" if j["consistency"] is not None else "none") + " of the comparisons")
        if j.get("left_out"):
            line += f" ({j['left_out']} of {j['comparisons']} without both verdicts, left out)"
        lines.append(line)
    return lines


def push_samples(path: Path, hub: HubTarget, manifest: bytes) -> None:
    """``--push-to-hub``: the samples (prompts, responses, rewards), with the evaluation's manifest beside them."""
    from rlhf_pipeline.datasets_io import push_dataset_dir

    push_dataset_dir(path / EVAL_SAMPLES, hub, manifest)


push_samples.hub_kind = "datasets/"  # type: ignore[attr-defined]


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(EvalConfig, main, "rlhf eval", argv)


if __name__ == "__main__":
    sys.exit(cli())
