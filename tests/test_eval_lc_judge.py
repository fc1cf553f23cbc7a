"""The numbers papers report from an evaluation: the length-controlled win rate (against cases worked by hand and
against the alpaca-eval package's own fit), fixed reference answers, and a pairwise LLM judge (both orders)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from datasets import load_from_disk

from conftest import run, write_jsonl
from rlhf_pipeline.demo.task import gold_reward, write_task_data
from rlhf_pipeline.evalstats import (
    length_controlled_win_rate,
    mean_and_stderr,
    pair_indices,
    preference_comparison,
    reward_comparison,
)
from rlhf_pipeline.judge import combine_orders, judge_prompts, judge_summary, parse_verdict, request_text

GOLD = "rlhf_pipeline.demo.task:gold_reward"


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def synthetic(seed: int, prompts: int = 60, n: int = 4, theta: float = 0.3, phi: float = 1.5, psi: float = 0.0,
              noise: float = 0.0):
    """Comparisons whose preferences follow the LC model exactly (plus ``noise``), the evaluated responses longer
    on average: ``(preferences, length differences, prompt of each, difficulty of each, per-prompt difficulty)``."""
    rng = np.random.default_rng(seed)
    difficulty = rng.normal(0.0, 1.0, prompts)
    ours = rng.integers(100, 500, prompts * n)
    theirs = rng.integers(50, 300, prompts * n)
    delta = (ours - theirs).astype(float)
    cluster = np.repeat(np.arange(prompts), n)
    z = theta + phi * np.tanh(delta / delta.std(ddof=1)) + psi * difficulty[cluster]
    prefs = np.clip(sigmoid(z) + rng.normal(0.0, noise, len(z)), 0.0, 1.0)
    return list(prefs), list(delta), list(cluster), list(difficulty[cluster]), difficulty


# ---------------------------------------------------------------------------------------------------------------
# The length-controlled win rate


def test_lc_recovers_the_preference_at_equal_length_where_the_raw_rate_rewards_length():
    prefs, delta, cluster, _, _ = synthetic(0)
    fit = length_controlled_win_rate(prefs, delta, cluster)
    assert fit["raw_win_rate"] == pytest.approx(np.mean(prefs))
    assert fit["raw_win_rate"] > sigmoid(0.3) + 0.1  # longer answers win more often: the raw rate is inflated
    assert fit["win_rate"] == pytest.approx(sigmoid(0.3), abs=2e-3)  # read at zero length difference
    assert fit["length_coef"] == pytest.approx(1.5, abs=0.02)
    assert fit["comparisons"] == 240 and fit["stderr"] is not None


def test_lc_with_an_instruction_term_averages_over_the_prompts():
    prefs, delta, cluster, diff, per_prompt = synthetic(1, theta=-0.2, phi=0.8, psi=0.7)
    fit = length_controlled_win_rate(prefs, delta, cluster, difficulty=diff)
    assert fit["win_rate"] == pytest.approx(float(np.mean(sigmoid(-0.2 + 0.7 * per_prompt))), abs=2e-3)
    # without the term the model is the "minimal" one: sigmoid(theta) of a pooled fit, not the same number
    assert abs(length_controlled_win_rate(prefs, delta, cluster)["win_rate"] - fit["win_rate"]) > 1e-3


def test_lc_standard_error_is_the_clustered_one():
    """With no length differences the fit is the mean preference, and its sandwich standard error, clustered by
    prompt, is the standard error of the per-prompt means (the prior shifts both by a hair)."""
    rng = np.random.default_rng(2)
    prefs = list(rng.uniform(0, 1, 200))
    cluster = list(np.repeat(np.arange(50), 4))
    fit = length_controlled_win_rate(prefs, [0.0] * 200, cluster)
    per_prompt = [float(np.mean(prefs[4 * c : 4 * c + 4])) for c in range(50)]
    mean, stderr = mean_and_stderr(per_prompt)
    assert fit["win_rate"] == pytest.approx(mean, abs=1e-3)
    assert fit["stderr"] == pytest.approx(stderr, rel=0.02)
    assert fit["length_coef"] == 0.0


def test_lc_standard_error_with_a_length_term_agrees_with_a_cluster_bootstrap():
    """The delta-method sandwich s.e. against the spread of the LC win rate over 400 resamples of whole prompts."""
    prefs, delta, cluster, _, _ = synthetic(5, prompts=80, noise=0.15)
    fit = length_controlled_win_rate(prefs, delta, cluster)
    rng = np.random.default_rng(6)
    by_prompt = {c: [m for m, x in enumerate(cluster) if x == c] for c in set(cluster)}
    draws = []
    for b in range(400):
        rows = [(m, k) for k, c in enumerate(rng.choice(sorted(by_prompt), len(by_prompt))) for m in by_prompt[c]]
        draws.append(length_controlled_win_rate([prefs[m] for m, _ in rows], [delta[m] for m, _ in rows],
                                                [k for _, k in rows])["win_rate"])
    assert fit["stderr"] == pytest.approx(float(np.std(draws, ddof=1)), rel=0.2)


def test_lc_of_a_judge_that_always_prefers_ours_is_finite_and_none_left_out():
    fit = length_controlled_win_rate([1.0, 1.0, None, 1.0, float("nan")], [3, -2, 5, 7, 1], [0, 0, 1, 1, 2])
    assert 0.99 < fit["win_rate"] < 1.0 and fit["comparisons"] == 3
    assert length_controlled_win_rate([None], [0], [0]) is None


@pytest.mark.parametrize("glm", ["length_controlled_minimal", "length_controlled_noreg"])
@pytest.mark.parametrize("soft", [True, False])
def test_lc_equals_the_alpaca_eval_packages(glm, soft, tmp_path, monkeypatch):
    """alpaca-eval's own fit (alpaca_eval.metrics.glm_winrate) on the same annotations. Tolerance 0.005 (half a
    point of a win rate in percent): the package fits an L1-penalised logistic regression whose strength it picks
    by 5-fold cross-validation, this project the unpenalised fit with a weak prior; on soft preferences they agree
    to about 1e-4, on 0/1 verdicts to about 2e-3. Its instruction difficulties and the annotations of its gamed
    baselines come from the Hub: here a local file with this data's difficulties stands in for them (the
    "minimal" and "noreg" GLMs read only the difficulties)."""
    pytest.importorskip("alpaca_eval")
    pd = pytest.importorskip("pandas")
    from alpaca_eval.metrics import glm_winrate

    prefs, delta, cluster, diff, per_prompt = synthetic(3, psi=0.8, noise=0.1)
    if not soft:
        prefs = list((np.random.default_rng(4).uniform(size=len(prefs)) < np.array(prefs)).astype(float))
    rows = [{"index": c, "output_1": "x" * 300, "output_2": "y" * int(300 + d), "preference": 1.0 + p,
             "generator_1": "baseline", "generator_2": "ours"} for p, d, c in zip(prefs, delta, cluster)]
    table = tmp_path / "df_gamed.csv"
    pd.DataFrame({"model": "m", "index": range(len(per_prompt)), "instruction_difficulty": per_prompt}).to_csv(
        table, index=False)
    monkeypatch.setattr(glm_winrate, "hf_hub_download", lambda **kw: str(table))
    theirs = glm_winrate.get_length_controlled_winrate(pd.DataFrame(rows), glm_name=glm, save_weights_dir=None,
                                                       is_warn_extreme_changes=False)
    ours = length_controlled_win_rate(prefs, delta, cluster,
                                      difficulty=diff if glm == "length_controlled_noreg" else None)
    assert ours["win_rate"] == pytest.approx(theirs["length_controlled_winrate"] / 100, abs=5e-3)
    assert ours["raw_win_rate"] == pytest.approx(theirs["win_rate"] / 100, abs=1e-9)


def test_reward_comparisons_by_hand():
    ours, refs = [[3.0, 0.0], [1.0, 1.0]], [[1.0], [1.0]]
    assert pair_indices(ours, refs) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]  # each against the reference
    assert pair_indices(ours, [[0.0, 5.0], [2.0, 1.0]]) == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    lengths, ref_lengths = [[10, 30], [20, 20]], [[20], [20]]
    function = reward_comparison(ours, refs, lengths, ref_lengths, bradley_terry=False)
    assert (function["wins"], function["ties"], function["losses"]) == (1, 2, 1)
    assert function["win_rate"] == 0.5 and function["length_controlled"]["raw_win_rate"] == 0.5
    model = reward_comparison(ours, refs, lengths, ref_lengths, bradley_terry=True)
    assert model["win_rate"] == 0.5  # the outcomes: the same for both
    assert model["length_controlled"]["raw_win_rate"] == pytest.approx((sigmoid(2.0) + sigmoid(-1.0) + 1.0) / 4)
    assert model["length_controlled"]["preferences"] == "bradley-terry" and model["lc_win_rate"] is not None
    # the standard error takes a prompt's comparisons together: that of the per-prompt rates 1, 0 and 1/2 (0.5 / √3),
    # not of six independent outcomes (√(0.3) / √6)
    clustered = reward_comparison([[2.0, 2.0], [0.0, 0.0], [2.0, 0.0]], [[1.0]] * 3, [[0, 0]] * 3, [[0]] * 3,
                                  bradley_terry=False)
    assert clustered["win_rate"] == 0.5 and clustered["win_rate_stderr"] == pytest.approx(0.5 / math.sqrt(3))

    judged = preference_comparison([1.0, 0.5, None, 0.25], [5, 0, 3, -2], [0, 0, 1, 1])
    assert judged["win_rate"] == pytest.approx((0.75 + 0.25) / 2)  # per-prompt means, then over prompts
    assert judged["win_rate_stderr"] == pytest.approx(0.25)  # |0.75 - 0.25| / √2, over √2
    assert (judged["wins"], judged["ties"], judged["losses"]) == (1, 1, 1)
    assert judged["length_controlled"]["comparisons"] == 3


# ---------------------------------------------------------------------------------------------------------------
# The judge


def test_verdicts_are_read_from_the_last_marker_and_never_guessed():
    assert parse_verdict("B is more helpful.\n[[B]]") == "B"
    assert parse_verdict("At first [[A]], but on reflection [[ C ]]") == "C"
    assert parse_verdict("Answer A is better") is None
    assert parse_verdict("[[D]]") is None and parse_verdict("") is None


def test_both_orders_cancel_a_judge_that_prefers_a_position():
    assert combine_orders("A", "B") == 1.0  # ours won in both positions
    assert combine_orders("B", "A") == 0.0
    assert combine_orders("A", "A") == 0.5  # always the first answer: no preference left
    assert combine_orders("C", "B") == 0.75
    # one order's verdict alone is that order's bias in full: no preference (a judge that always answers A, its
    # second answer unreadable half the time, would have won 3 comparisons in 4)
    assert combine_orders(None, "B") is None and combine_orders("A", None) is None
    assert combine_orders(None, None) is None
    first, second = judge_prompts("Say hi.", "OURS-TEXT", "THEIRS-TEXT")
    assert first.index("OURS-TEXT") < first.index("THEIRS-TEXT")
    assert second.index("THEIRS-TEXT") < second.index("OURS-TEXT")
    # a conversation is shown whole: its system prompt and earlier turns are what the answers respond to too
    conversation = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a fruit."},
                    {"role": "assistant", "content": "Une pomme."}, {"role": "user", "content": "Make it shorter."}]
    assert request_text(conversation) == ("System: Answer in French.\n\nUser: Name a fruit.\n\nAssistant: Une pomme."
                                          "\n\nUser: Make it shorter.")
    assert request_text([{"role": "user", "content": "Say hi."}]) == request_text("Say hi.") == "Say hi."
    assert "System: Answer in French." in judge_prompts(request_text(conversation), "a", "b")[0]
    s = judge_summary([("A", "B"), ("A", "A"), (None, "C"), (None, None)])
    assert s == {"comparisons": 4, "verdicts": 8, "unreadable": 3, "no_verdict": 1, "left_out": 2, "consistency": 0.5,
                 "first_position_rate": 0.75, "tie_rate": 0.2}


# ---------------------------------------------------------------------------------------------------------------
# rlhf eval with --reference and --judge


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_policy):
    from rlhf_pipeline.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("lcjudge")
    task = write_task_data(root)
    prompts = [json.loads(x) for x in Path(task["eval_prompts"]).read_text().splitlines()][:6]
    # AlpacaEval's layout: instruction + output, matched by the prompt's text; answers of several lengths
    refs = write_jsonl(root / "refs.jsonl", [{"instruction": p["prompt"], "output": "good " * (3 * i + 1)}
                                             for i, p in enumerate(reversed(prompts))])
    baseline = str(save_tiny_model(root / "baseline", kind="policy", seed=5))
    judge = shutil.copytree(tiny_policy, root / "judge")
    return {"root": root, "prompts": task["eval_prompts"], "refs": refs, "baseline": baseline, "judge": str(judge),
            "rows": prompts}


def eval_args(policy, setup, out, *extra):
    return ["eval", "--model", policy, "--prompts", setup["prompts"], "--output", out, "--n", 2,
            "--max-new-tokens", 10, "--limit", 6, "--engine", "hf", "--reward-fn", GOLD, *extra]


def fake_judge(monkeypatch, judge: str, choose) -> list:
    """The judge model's engine answers ``[[choose(answer_a, answer_b)]]``, reading both answers from the very
    prompt the judge was given (the tiny tokenizer decodes losslessly). Returns the list of the judge engines'
    context lengths, filled as they answer."""
    from rlhf_pipeline.engines.base import Completion
    from rlhf_pipeline.engines.hf import HFEngine

    real = HFEngine.generate
    pattern = re.compile(r"\[Answer A\]\n(.*)\n\n\[Answer B\]\n(.*)\n\nGive your reason", re.S)

    contexts = []

    def generate(self, prompts, *args, **kwargs):
        if Path(self.tokenizer.name_or_path) != Path(judge):
            return real(self, prompts, *args, **kwargs)
        contexts.append(self.context)
        out = []
        for ids in prompts:
            a, b = pattern.search(self.tokenizer.decode(ids)).groups()
            text = f"My reason. [[{choose(a, b)}]]"
            out.append(Completion(texts=[text], token_ids=[self.tokenizer(text)["input_ids"]],
                                  finish_reasons=["stop"]))
        return out

    monkeypatch.setattr(HFEngine, "generate", generate)
    return contexts


def longer(a: str, b: str) -> str:
    return "A" if len(a) > len(b) else "B" if len(b) > len(a) else "C"


def test_eval_against_references_and_a_baseline_with_a_judge_that_likes_length(setup, tiny_policy, tmp_path,
                                                                               monkeypatch):
    contexts = fake_judge(monkeypatch, setup["judge"], longer)
    out = tmp_path / "eval"
    # the policy's --max-model-len is the policy's: the judge, whose prompts hold two answers, keeps its own
    assert run(*eval_args(tiny_policy, setup, out, "--baseline", setup["baseline"], "--reference", setup["refs"],
                          "--judge", setup["judge"], "--max-model-len", 1000)) == 0
    assert contexts and set(contexts) == {4096}
    results = json.loads((out / "results.json").read_text())
    samples = load_from_disk(str(out / "samples"))
    assert results["reference"] == setup["refs"] and samples.num_rows == 6

    # the references, scored by the same function, each response of the policy against its prompt's one
    answers = {p["prompt"]: "good " * (3 * (5 - i) + 1) for i, p in enumerate(setup["rows"])}
    refs = [answers[p] for p in samples["prompt"]]
    assert samples["reference_rewards_reward_fn"] == [[r] for r in gold_reward(samples["prompt"], refs)]
    ours = samples["rewards_reward_fn"]
    outcomes = [1.0 if x > r[0] else 0.5 if x == r[0] else 0.0
                for xs, r in zip(ours, samples["reference_rewards_reward_fn"]) for x in xs]
    ref = results["scores"]["reward_fn"]["reference"]
    assert ref["win_rate"] == pytest.approx(sum(outcomes) / len(outcomes))
    assert ref["mean"] == pytest.approx(np.mean([r[0] for r in samples["reference_rewards_reward_fn"]]))
    assert ref["lc_win_rate"] is not None and ref["length_controlled"]["comparisons"] == 12
    assert results["scores"]["reward_fn"]["lc_win_rate"] is not None  # against the baseline too

    # the judge: every comparison in both orders, read; it agrees with itself, and prefers the longer answer
    for target, theirs in (("reference", [[a] for a in refs]),
                           ("baseline", load_from_disk(str(out / "baseline" / "generate"))["responses"])):
        j = results["judge"][target]
        expected = [[1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5
                     for a, b in zip(mine, their * 2 if len(their) == 1 else their)]
                    for mine, their in zip(samples["responses"], theirs)]
        assert samples[f"judge_{target}_preference"] == expected
        assert j["unreadable"] == 0 and j["verdicts"] == 24 and j["consistency"] == 1.0
        assert j["win_rate"] == pytest.approx(np.mean([np.mean(row) for row in expected]))
        assert all(v in ("AB", "BA", "CC") for row in samples[f"judge_{target}_verdicts"] for v in row)
    assert results["judge"]["model"] == setup["judge"]


def test_a_judge_that_always_picks_the_first_answer_cancels_out(setup, tiny_policy, tmp_path, monkeypatch):
    fake_judge(monkeypatch, setup["judge"], lambda a, b: "A")
    out = tmp_path / "eval"
    # --trust-remote-code is the policy's and the reward models': the judge runs its own code only when told to
    assert run(*eval_args(tiny_policy, setup, out, "--reference", setup["refs"], "--judge", setup["judge"],
                          "--trust-remote-code")) == 0
    trusted = {p: json.loads((out / p / "manifest.json").read_text())["config"]["trust_remote_code"]
               for p in ("generate", "judge_reference/generate")}
    assert trusted == {"generate": True, "judge_reference/generate": False}
    j = json.loads((out / "results.json").read_text())["judge"]["reference"]
    assert j["win_rate"] == 0.5 and j["consistency"] == 0.0 and j["first_position_rate"] == 1.0
    assert j["ties"] == 12 and j["lc_win_rate"] == pytest.approx(0.5, abs=1e-6)
    assert "baseline" not in json.loads((out / "results.json").read_text())["judge"]


def test_a_judge_that_ships_its_own_code_needs_its_own_flag_before_anything_runs(setup, tiny_policy, tmp_path, capsys):
    """--trust-remote-code does not cover the judge; a judge whose config.json names its own causal-LM code is one
    line naming --judge-trust-remote-code before the policy samples, not a refusal at the judge's step."""
    judge = shutil.copytree(setup["judge"], tmp_path / "remote_judge")
    config = json.loads((judge / "config.json").read_text())
    (judge / "config.json").write_text(json.dumps(dict(config, auto_map={"AutoModelForCausalLM": "own.OwnLM"})))
    out = tmp_path / "eval"
    assert run(*eval_args(tiny_policy, setup, out, "--reference", setup["refs"], "--judge", judge,
                          "--trust-remote-code")) == 1
    err = capsys.readouterr().err
    assert (f"--judge {judge}: ships its own model code (config.json's auto_map: AutoModelForCausalLM -> own.OwnLM), "
            "which is not run unless allowed; read that code, then allow it with --judge-trust-remote-code") in err
    assert not out.exists()


def test_a_judge_whose_answers_cannot_be_read_is_counted_not_crashed_on(setup, tiny_policy, tmp_path, capsys):
    """The tiny policy itself as the judge: it writes no verdict."""
    out = tmp_path / "eval"
    assert run(*eval_args(tiny_policy, setup, out, "--reference", setup["refs"], "--judge", setup["judge"],
                          "--judge-max-new-tokens", 6)) == 0
    j = json.loads((out / "results.json").read_text())["judge"]["reference"]
    assert j["unreadable"] == j["verdicts"] == 24 and j["no_verdict"] == 12
    assert j["win_rate"] is None and j["lc_win_rate"] is None and j["consistency"] is None
    assert "no comparison had both verdicts read; 24 of 24 verdicts unreadable" in capsys.readouterr().out
    assert len(load_from_disk(str(out / "judge_reference" / "generate"))) == 24


def test_prompts_under_another_column_name_go_through_references_a_baseline_and_the_judge(setup, tiny_policy,
                                                                                         tmp_path, monkeypatch):
    """--prompt-column question: the prompts, the reference answers matched to them by text, the baseline's samples
    and the judge's own prompts (made under 'prompt', which the option must not rename) give what the 'prompt' file
    gives. The judge's generate used to take the option and find no such column, after all the sampling."""
    fake_judge(monkeypatch, setup["judge"], longer)
    rows = [json.loads(x) for x in Path(setup["prompts"]).read_text().splitlines()]
    renamed = write_jsonl(tmp_path / "questions.jsonl", [{("question" if k == "prompt" else k): v
                                                         for k, v in r.items()} for r in rows])
    common = ["--baseline", setup["baseline"], "--reference", setup["refs"], "--judge", setup["judge"]]
    assert run(*eval_args(tiny_policy, setup, tmp_path / "plain", *common)) == 0
    args = eval_args(tiny_policy, setup, tmp_path / "renamed", *common, "--prompt-column", "question")
    assert run(*[str(renamed) if a == setup["prompts"] else a for a in args]) == 0
    plain, ours = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("plain", "renamed"))
    assert ours["scores"] == plain["scores"] and ours["judge"]["reference"] == plain["judge"]["reference"]
    assert ours["judge"]["baseline"] == plain["judge"]["baseline"]


def test_references_match_by_id_when_both_sides_have_one(setup, tiny_policy, tmp_path, capsys):
    """The eval prompts carry ``id``; a reference file with ``prompt_id`` (and no prompt text at all) matches by it."""
    rows = setup["rows"]
    refs = write_jsonl(tmp_path / "by_id.jsonl", [{"prompt_id": p["id"], "response": f"answer {i}"}
                                                  for i, p in enumerate(reversed(rows))])
    out = tmp_path / "eval"
    assert run(*eval_args(tiny_policy, setup, out, "--reference", refs)) == 0
    generated = load_from_disk(str(out / "reference" / "generate"))
    expected = {p["id"]: [f"answer {5 - i}"] for i, p in enumerate(rows)}
    assert dict(zip(generated["prompt_id"], generated["responses"])) == expected
    # a reference that also says its prompt: it must be the evaluated prompt of that id (ids shifted by one row
    # compared answers written for other prompts, saying nothing)
    shifted = write_jsonl(tmp_path / "shifted.jsonl", [{"prompt_id": p["id"], "prompt": q["prompt"], "response": "x"}
                                                       for p, q in zip(rows, rows[1:] + rows[:1])])
    capsys.readouterr()
    assert run(*eval_args(tiny_policy, setup, tmp_path / "shifted", "--reference", shifted)) == 1
    err = capsys.readouterr().err
    assert f"row 0 (prompt_id {rows[0]['id']}) answers the prompt {rows[1]['prompt'][:60]!r}" in err, err
    assert "drop the prompt_id column to match by text" in err and not (tmp_path / "shifted").exists()
    aligned = write_jsonl(tmp_path / "aligned.jsonl", [{"prompt_id": p["id"], "prompt": p["prompt"], "response": "x"}
                                                       for p in rows])
    assert run(*eval_args(tiny_policy, setup, tmp_path / "aligned", "--reference", aligned)) == 0


def test_a_rerun_reuses_the_judges_answers_unless_the_other_side_changed(setup, tiny_policy, tmp_path,
                                                                          monkeypatch):
    """An unfinished judged eval resumes without asking the judge again; when the side it was compared with has
    changed since (an earlier evaluation given as --baseline, run again), its prompts and answers are made anew."""
    from rlhf_pipeline.engines.hf import HFEngine

    fake_judge(monkeypatch, setup["judge"], longer)
    base = tmp_path / "base_eval"
    assert run(*eval_args(setup["baseline"], setup, base)) == 0
    out = tmp_path / "eval"
    args = eval_args(tiny_policy, setup, out, "--baseline", base, "--judge", setup["judge"])
    assert run(*args) == 0
    first = json.loads((out / "results.json").read_text())["judge"]["baseline"]
    (out / "manifest.json").unlink()  # as if the run had stopped before its last step
    judged = HFEngine.generate

    def refuse(self, *a, **kw):
        assert Path(self.tokenizer.name_or_path) != Path(setup["judge"]), "the judge was asked again"
        return judged(self, *a, **kw)

    monkeypatch.setattr(HFEngine, "generate", refuse)
    assert run(*args) == 0
    assert json.loads((out / "results.json").read_text())["judge"]["baseline"] == first

    # prompts an older version made, whose ids gave a prompt twice one id for both its rows: made again
    record = out / "judge_baseline" / "compared.json"
    assert json.loads(record.read_text())["ids"] == "row_key|ours|theirs|order"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "ids"}))
    (out / "manifest.json").unlink()
    before = json.loads((out / "judge_baseline" / "generate" / "manifest.json").read_text())["output_id"]
    monkeypatch.setattr(HFEngine, "generate", judged)
    assert run(*args) == 0
    assert json.loads((out / "judge_baseline" / "generate" / "manifest.json").read_text())["output_id"] != before

    (out / "manifest.json").unlink()
    assert run(*eval_args(setup["baseline"], setup, base, "--seed", 7, "--overwrite")) == 0  # the baseline anew
    monkeypatch.setattr(HFEngine, "generate", judged)
    assert run(*args) == 0
    theirs = load_from_disk(str(base / "generate"))["responses"]
    samples = load_from_disk(str(out / "samples"))
    expected = [[1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5 for a, b in zip(mine, their)]
                for mine, their in zip(samples["responses"], theirs)]
    assert samples["judge_baseline_preference"] == expected


def test_reference_mistakes_are_one_line_and_leave_nothing(setup, tiny_policy, tmp_path, capsys):
    short = write_jsonl(tmp_path / "short.jsonl", [{"instruction": setup["rows"][0]["prompt"], "output": "x"}])
    no_answer = write_jsonl(tmp_path / "noanswer.jsonl", [{"instruction": "x", "text": "y"}])
    cases = [(short, "has no answer for 5 of the 6 evaluated prompts, matched by text (the prompts' last user turn "
                     "against its instruction)"),
             (no_answer, "has no answer column (response, output, reference); its columns are instruction, text")]
    for refs, message in cases:
        out = tmp_path / "out"
        capsys.readouterr()
        assert run(*eval_args(tiny_policy, setup, out, "--reference", refs)) == 1
        err = capsys.readouterr().err
        assert f"error: --reference {refs}: {message}" in err, err
        assert not out.exists()
    capsys.readouterr()
    assert run(*eval_args(tiny_policy, setup, tmp_path / "out", "--judge", setup["judge"])) == 1
    assert "--judge compares two answers: give --baseline, --reference, or both" in capsys.readouterr().err


def test_a_prompt_given_twice_is_two_rows_each_matched_with_its_own(setup, tiny_policy, tmp_path, monkeypatch):
    """rlhf generate takes a prompt given twice and samples each row from its own seed. Eval matched the rows of both
    sides by prompt_id, so each copy got the last copy's rewards (counted twice), and the judge's prompts of the two
    copies shared ids and stopped the run after all its sampling. Now the k-th row of an id meets the other side's
    k-th: every number is the rows' own."""
    fake_judge(monkeypatch, setup["judge"], longer)
    rows = setup["rows"]
    prompts = write_jsonl(tmp_path / "twice.jsonl", [rows[0], rows[1], rows[0], rows[2]])
    out = tmp_path / "eval"
    args = ["eval", "--model", tiny_policy, "--prompts", prompts, "--output", out, "--n", 2, "--max-new-tokens", 10,
            "--engine", "hf", "--reward-fn", GOLD, "--baseline", setup["baseline"], "--judge", setup["judge"]]
    assert run(*args) == 0
    samples = load_from_disk(str(out / "samples"))
    assert samples["prompt_id"] == [rows[0]["id"], rows[1]["id"], rows[0]["id"], rows[2]["id"]]
    assert samples["responses"][0] != samples["responses"][2]  # two rows, sampled apart
    for side, generated in (("", samples), ("baseline_", load_from_disk(str(out / "baseline" / "generate")))):
        assert samples[f"{side}rewards_reward_fn"] == [gold_reward([p] * len(rs), rs)
                                                      for p, rs in zip(samples["prompt"], generated["responses"])]
    results = json.loads((out / "results.json").read_text())
    assert results["num_prompts"] == 4 and results["judge"]["baseline"]["verdicts"] == 16  # 4 rows x 2 x 2 orders
    means = [np.mean(rs) for rs in samples["rewards_reward_fn"]]
    assert results["scores"]["reward_fn"]["mean"] == pytest.approx(np.mean(means))
