"""Several reward sources (issue 14, item 4): ``rlhf score`` keeps each source's raw rewards in ``rewards_<key>``
and writes ``rewards`` as the weighted sum of the standardised sources; ``rlhf eval`` reports every source and
the combination. The numbers are checked against hand computations on tiny examples; one source stays exactly as
it was."""

import json
import math
import statistics
from pathlib import Path

import pytest
from datasets import load_from_disk

from conftest import run, write_jsonl

SOURCES = '''
def length(prompts, responses, **columns):
    return [float(len(r)) for r in responses]

def stopped(prompts, responses, **columns):
    return [1.0 if f == "stop" else 0.0 for f in columns["finish_reasons"]]

def constant(prompts, responses, **columns):
    return [0.1] * len(responses)

def letter_e(prompts, responses, **columns):
    return [float(r.count("e")) for r in responses]
'''

# Two prompts, two responses each, texts only (rlhf filter tokenizes them). Lengths 1, 3, 5, 7; stopped 0, 0, 1, 1.
GEN_ROWS = [
    {"prompt_id": "p0", "prompt": "Say a.", "responses": ["a", "abc"], "finish_reasons": ["length", "length"]},
    {"prompt_id": "p1", "prompt": "Say more.", "responses": ["abcde", "abcdefg"], "finish_reasons": ["stop", "stop"]},
]


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


@pytest.fixture
def kit(tmp_path) -> dict[str, str]:
    (tmp_path / "sources.py").write_text(SOURCES)
    return {"gen": write_jsonl(tmp_path / "gen.jsonl", GEN_ROWS), "fns": str(tmp_path / "sources.py"),
            "dir": str(tmp_path)}


def test_score_combines_standardised_sources_by_hand(kit, tmp_path):
    """length = [1, 3, 5, 7]: mean 4, std sqrt(5) (population); stopped = [0, 0, 1, 1]: mean 0.5, std 0.5;
    constant = 0.1 everywhere: adds 0. Weights (1, 2, 5): rewards = (len - 4)/sqrt5 + 2 (stopped - 0.5)/0.5
    = [-3/sqrt5 - 2, -1/sqrt5 - 2, 1/sqrt5 + 2, 3/sqrt5 + 2] = [-3.341641, -2.447214, 2.447214, 3.341641]."""
    out = tmp_path / "scored"
    fns = kit["fns"]
    assert run("score", "--input", kit["gen"], "--output", out, "--reward-fn", f"{fns}:length", f"{fns}:stopped",
               "--reward-fn", f"{fns}:constant", "--reward-weights", 1, 2, 5) == 0
    ds = load_from_disk(str(out))
    assert [c for c in ds.column_names if c.startswith("rewards")] == [
        "rewards_reward_fn_length", "rewards_reward_fn_stopped", "rewards_reward_fn_constant", "rewards"]
    assert ds["rewards_reward_fn_length"] == [[1.0, 3.0], [5.0, 7.0]]  # raw, per response
    assert ds["rewards_reward_fn_stopped"] == [[0.0, 0.0], [1.0, 1.0]]
    flat = [r for rs in ds["rewards"] for r in rs]
    assert flat == pytest.approx([-3.341641, -2.447214, 2.447214, 3.341641], abs=1e-5)

    reward = manifest(out)["reward"]
    assert reward["eps"] == 1e-6 and "(r_k - mean_k) / (std_k + eps)" in reward["combination"]
    length, stopped, constant = reward["sources"]
    assert length == {"key": "reward_fn_length", "column": "rewards_reward_fn_length", "reward_fn": f"{fns}:length",
                      "weight": 1.0, "mean": 4.0, "std": pytest.approx(math.sqrt(5)), "constant": False}
    assert (stopped["weight"], stopped["mean"], stopped["std"]) == (2.0, 0.5, 0.5)
    assert constant["constant"] and constant["std"] == 0.0 and constant["weight"] == 5.0
    assert manifest(out)["config"]["reward_fn"] == [f"{fns}:length", f"{fns}:stopped", f"{fns}:constant"]
    # the same command again reuses the output
    before = manifest(out)["output_id"]
    assert run("score", "--input", kit["gen"], "--output", out, "--reward-fn", f"{fns}:length", f"{fns}:stopped",
               "--reward-fn", f"{fns}:constant", "--reward-weights", 1, 2, 5) == 0
    assert manifest(out)["output_id"] == before


def test_one_source_is_scored_exactly_as_before(kit, tmp_path):
    """No standardisation, no extra column, the manifest's reward record and config as they were."""
    out = tmp_path / "one"
    assert run("score", "--input", kit["gen"], "--output", out, "--reward-fn", f"{kit['fns']}:length") == 0
    ds = load_from_disk(str(out))
    assert ds["rewards"] == [[1.0, 3.0], [5.0, 7.0]]
    assert not [c for c in ds.column_names if c.startswith("rewards_")]
    m = manifest(out)
    assert m["reward"] == {"reward_fn": f"{kit['fns']}:length"}
    assert m["config"]["reward_fn"] == f"{kit['fns']}:length"  # a string, as before: old outputs stay reusable
    assert m["config"]["reward_model"] is None and m["config"]["reward_weights"] is None


def test_reward_model_and_function_from_yaml_then_filter(kit, tmp_path, tiny_rm, tiny_policy):
    """A YAML config with a reward model and a function (default weights 1): the model's column holds its raw
    rewards (those of a one-source run), ``rewards`` is the sum of the two standardised columns, and filter
    builds pairs and groups from ``rewards`` while carrying the source columns."""
    (tmp_path / "score.yaml").write_text(f"reward_model: {tiny_rm}\nreward_fn:\n  - {kit['fns']}:length\n"
                                         "batch_size: 3\n")
    both, alone = tmp_path / "both", tmp_path / "rm_alone"
    assert run("score", "--config", tmp_path / "score.yaml", "--input", kit["gen"], "--output", both) == 0
    assert run("score", "--input", kit["gen"], "--output", alone, "--reward-model", tiny_rm, "--batch-size", 3) == 0
    ds, raw = load_from_disk(str(both)), load_from_disk(str(alone))
    assert ds["rewards_reward_model"] == raw["rewards"]  # the key of the only model is its kind, as in rlhf eval
    assert ds["rewards_reward_fn"] == [[1.0, 3.0], [5.0, 7.0]]
    rm = [r for rs in raw["rewards"] for r in rs]
    mu, sd = statistics.fmean(rm), statistics.pstdev(rm)
    expected = [(r - mu) / (sd + 1e-6) + (n - 4) / (math.sqrt(5) + 1e-6) for r, n in zip(rm, [1, 3, 5, 7])]
    assert [r for rs in ds["rewards"] for r in rs] == pytest.approx(expected, abs=1e-9)
    sources = manifest(both)["reward"]["sources"]
    assert [s["key"] for s in sources] == ["reward_model", "reward_fn"] and sources[0]["reward_model"] == tiny_rm
    assert sources[0]["truncated_sequences"] == 0 and sources[0]["weight"] == sources[1]["weight"] == 1.0

    assert run("filter", "--input", both, "--output", tmp_path / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 0) == 0
    pairs = load_from_disk(str(tmp_path / "pairs"))["train"]
    for row, combined in zip(pairs, ds["rewards"]):
        assert (row["chosen_reward"], row["rejected_reward"]) == (max(combined), min(combined))
        assert "rewards_reward_model" in row  # carried, per response of the prompt
    assert run("filter", "--input", both, "--output", tmp_path / "groups", "--tokenizer", tiny_policy,
               "--mode", "groups", "--test-size", 0) == 0
    groups = load_from_disk(str(tmp_path / "groups"))["train"]
    assert groups["rewards"] == ds["rewards"] and groups["rewards_reward_fn"] == ds["rewards_reward_fn"]


def test_a_repeated_list_flag_adds_and_replaces_the_yaml_value(tmp_path):
    from rlhf_pipeline.config import parse_config
    from rlhf_pipeline.stages.score import ScoreConfig

    (tmp_path / "s.yaml").write_text("input: g\noutput: o\nreward_fn: [y.py:a, y.py:b]\nreward_weights: [1, 2]\n")
    parse = lambda *argv: parse_config(ScoreConfig, ["--config", str(tmp_path / "s.yaml"), *argv], "rlhf score")
    assert parse().reward_fn == ["y.py:a", "y.py:b"] and parse().reward_weights == [1.0, 2.0]
    # flags win over the YAML file, whole; repeating the flag and listing after it give the same
    assert parse("--reward-fn", "f.py:x", "--reward-fn", "f.py:z").reward_fn == ["f.py:x", "f.py:z"]
    assert parse("--reward-fn", "f.py:x", "f.py:z").reward_fn == ["f.py:x", "f.py:z"]
    two = parse("--reward-fn", "f.py:x", "--reward-weights", "3", "1", "--reward-model", "m")
    assert (two.reward_fn, two.reward_model, two.reward_weights) == ("f.py:x", "m", [3.0, 1.0])  # one: a string
    assert [s.key for s in two.sources] == ["reward_model", "reward_fn"]  # models first: the order of the weights


@pytest.fixture(scope="module")
def evals(tmp_path_factory, tiny_policy, small_prompts_module) -> dict[str, Path]:
    """The tiny policy evaluated with two reward functions: against itself (seed 0), then with another seed
    against that evaluation (its samples reused as the baseline), and with default weights and no baseline."""
    d = tmp_path_factory.mktemp("evals")
    (d / "sources.py").write_text(SOURCES)
    fns = ["--reward-fn", f"{d}/sources.py:length", "--reward-fn", f"{d}/sources.py:letter_e"]
    common = ["--model", tiny_policy, "--prompts", small_prompts_module, "--n", 2, "--max-new-tokens", 16,
              "--limit", 6, "--engine", "hf"]
    paths = {name: d / name for name in ("self", "other", "unweighted", "separate")}
    assert run("eval", *common, *fns, "--reward-weights", 1, -0.5, "--baseline", tiny_policy,
               "--output", paths["self"]) == 0
    assert run("eval", *common, *fns, "--reward-weights", 1, -0.5, "--seed", 1, "--baseline", paths["self"],
               "--output", paths["other"]) == 0
    assert run("eval", *common, *fns, "--reward-weights", 1, 1, "--output", paths["unweighted"]) == 0
    assert run("eval", *common, *fns, "--output", paths["separate"]) == 0  # no weights: each source on its own
    return paths


@pytest.fixture(scope="module")
def small_prompts_module(tmp_path_factory) -> str:
    from rlhf_pipeline.tiny import bundled_path

    rows = [json.loads(line) for line in bundled_path("prompts.jsonl").read_text().splitlines()[:6]]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", rows)


def test_eval_reports_every_source_and_the_combination_on_the_baselines_scale(evals):
    results = json.loads((evals["other"] / "results.json").read_text())
    assert set(results["scores"]) == {"reward_fn_length", "reward_fn_letter_e"}
    assert (evals["other"] / "samples").exists() and not (evals["other"] / "score_reward_fn").exists()
    ours, theirs = load_from_disk(str(evals["other"] / "samples")), load_from_disk(str(evals["self"] / "samples"))
    base = {k: dict(zip(theirs["prompt_id"], theirs[f"rewards_{k}"])) for k in results["scores"]}
    # every source's own numbers, as one scorer's always were
    for key, s in results["scores"].items():
        per_prompt = [sum(r) / len(r) for r in ours[f"rewards_{key}"]]
        assert s["mean"] == pytest.approx(statistics.fmean(per_prompt), abs=1e-12)
        assert s["stderr"] == pytest.approx(statistics.stdev(per_prompt) / math.sqrt(len(per_prompt)), abs=1e-12)
        assert ours[f"baseline_rewards_{key}"] == [base[key][i] for i in ours["prompt_id"]]

    # the combination, recomputed: each source standardised with the baseline's mean and population std
    c = results["combined"]
    assert c["weights"] == {"reward_fn_length": 1.0, "reward_fn_letter_e": -0.5}
    assert c["statistics_from"] == "baseline"
    weights, stats = c["weights"], {}
    for key in weights:
        values = [r for rs in theirs[f"rewards_{key}"] for r in rs]
        stats[key] = (statistics.fmean(values), statistics.pstdev(values))
        assert (c["statistics"][key]["mean"], c["statistics"][key]["std"]) == pytest.approx(stats[key], abs=1e-12)

    def combined(dataset, prefix=""):
        return [[sum(weights[k] * (row[f"{prefix}rewards_{k}"][j] - stats[k][0]) / (stats[k][1] + 1e-6)
                     for k in weights) for j in range(2)] for row in dataset]

    mine, baseline = combined(ours), combined(ours, "baseline_")
    per_prompt = [sum(r) / 2 for r in mine]
    assert c["mean"] == pytest.approx(statistics.fmean(per_prompt), abs=1e-9)
    assert c["stderr"] == pytest.approx(statistics.stdev(per_prompt) / math.sqrt(6), abs=1e-9)
    assert c["baseline_mean"] == pytest.approx(0.0, abs=1e-9)  # the baseline on its own scale
    wins = sum(a > b for x, y in zip(mine, baseline) for a, b in zip(x, y))
    ties = sum(a == b for x, y in zip(mine, baseline) for a, b in zip(x, y))
    assert (c["wins"], c["ties"]) == (wins, ties) and c["win_rate"] == pytest.approx((wins + ties / 2) / 12)
    assert c["mean"] != 0.0 and c["wins"] + c["losses"] > 0  # another seed, other samples: not all zeros and ties
    assert not any(st["constant"] for st in c["statistics"].values())
    assert json.loads((evals["other"] / "manifest.json").read_text())["eval"]["combined"] == c


def test_eval_against_itself_and_without_weights(evals):
    itself = json.loads((evals["self"] / "results.json").read_text())["combined"]
    assert itself["win_rate"] == 0.5 and itself["mean"] == pytest.approx(0.0, abs=1e-9)
    unweighted = json.loads((evals["unweighted"] / "results.json").read_text())
    c = unweighted["combined"]
    assert c["weights"] == {"reward_fn_length": 1.0, "reward_fn_letter_e": 1.0}
    # no baseline: the samples' own statistics, so the combined mean is 0 by construction and no win rate
    assert c["statistics_from"] == "evaluated samples" and c["win_rate"] is None
    assert c["mean"] == pytest.approx(0.0, abs=1e-9)
    assert set(unweighted["scores"]) == {"reward_fn_length", "reward_fn_letter_e"}
    assert (evals["unweighted"] / "score_reward_fn_length" / "manifest.json").exists()
    # without --reward-weights the sources are reported each on its own, with no combination (the demo evaluates a
    # gold function beside the reward model: their sum would mean nothing)
    separate = json.loads((evals["separate"] / "results.json").read_text())
    assert "combined" not in separate and separate["scores"] == unweighted["scores"]


def test_eval_with_one_scorer_writes_no_combination(tmp_path, tiny_policy, small_prompts, kit):
    out = tmp_path / "e"
    assert run("eval", "--model", tiny_policy, "--prompts", small_prompts, "--n", 1, "--max-new-tokens", 4,
               "--limit", 2, "--engine", "hf", "--reward-fn", f"{kit['fns']}:length", "--output", out) == 0
    results = json.loads((out / "results.json").read_text())
    assert "combined" not in results and set(results["scores"]) == {"reward_fn"}
    assert manifest(out / "score_reward_fn")["config"]["reward_fn"] == f"{kit['fns']}:length"
