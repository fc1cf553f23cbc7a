"""KTO on unpaired data: the filter's rule (above / below the prompt's mean reward), its ties and dropped counts, the
mismatched pairs of the reference point, the reference pass, and the trainer's invariants for ``--algo kto`` (batch
x accumulation, resume, 2 processes under ZeRO-3 against 1). The loss itself is checked in test_losses.py."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from rlhf_pipeline.training import loop as trainer
from rlhf_pipeline.selection import (
    EQUAL_REWARDS,
    FEWER_THAN_TWO,
    PROMPT_TOO_LONG,
    REWARD_AT_MEAN,
    LengthLimits,
    decide_unpaired,
    mismatched_partners,
)
from conftest import (
    assert_same_gradient_norms,
    launch_cpu_zero3,
    LENGTH_REWARD,
    logged,
    max_weight_diff,
    micro_batch_sizes,
    run,
    spy_token_budget_plans,
    write_jsonl,
)

REPO = Path(__file__).resolve().parents[1]
LIMITS = LengthLimits(max_prompt_tokens=10, max_response_tokens=3)


# ---------------------------------------------------------------------------------------------------- the rule


def test_above_the_mean_is_desirable_below_undesirable_at_it_left_out():
    """Rewards (0.5, −1, 2, 0.5): mean (0.5 − 1 + 2 + 0.5)/4 = 0.5. Response 2 (2.0) is desirable, response 1 (−1.0)
    undesirable, responses 0 and 3 sit exactly at the mean and are left out. Rewards (3, 0, 0, 0): mean 0.75, one
    desirable and three undesirable (skewed groups give unbalanced classes)."""
    d = decide_unpaired(4, [[1], [2], [3], [4]], [0.5, -1.0, 2.0, 0.5], None, LIMITS)
    assert d.reason is None and d.labels == [(1, False), (2, True)]
    assert d.response_problems == {REWARD_AT_MEAN: 2}
    d = decide_unpaired(4, [[1], [2], [3], [4]], [3.0, 0.0, 0.0, 0.0], None, LIMITS)
    assert d.labels == [(0, True), (1, False), (2, False), (3, False)] and d.response_problems == {}


def test_ties_equal_groups_and_length_filters():
    """0.2 is the mean of (0.1, 0.2, 0.3) though floats make it 0.19999999999999998: a tie, not a label. All-equal
    rewards: the prompt is dropped (equal_rewards). A response over the token limit is left out first, and the mean
    is of the usable ones: (9 [too long], 1, 0, 2) -> mean of (1, 0, 2) = 1: response 1 at the mean."""
    d = decide_unpaired(4, [[1], [2], [3]], [0.1, 0.2, 0.3], None, LIMITS)
    assert d.labels == [(0, False), (2, True)] and d.response_problems == {REWARD_AT_MEAN: 1}
    assert decide_unpaired(4, [[1], [2], [3]], [1.0, 1.0, 1.0], None, LIMITS).reason == EQUAL_REWARDS
    d = decide_unpaired(4, [[1, 1, 1, 1], [2], [3], [4]], [9.0, 1.0, 0.0, 2.0], None, LIMITS)
    assert d.labels == [(2, False), (3, True)]
    assert d.response_problems == {"response_too_long": 1, REWARD_AT_MEAN: 1}
    d = decide_unpaired(4, [[1], [2], [3]], [1.0, 0.0, 2.0], ["stop", "length", "length"],
                        LengthLimits(10, 3, drop_truncated=True))
    assert d.reason == FEWER_THAN_TWO and d.response_problems == {"response_truncated": 2}
    assert decide_unpaired(11, [[1], [2]], [1.0, 0.0], None, LIMITS).reason == PROMPT_TOO_LONG


@pytest.mark.parametrize("keys", [
    [0, 0, 0, 1, 1, 2, 2, 2, 3, 4],  # blocks of at most 3 in 10 rows: a permutation
    [7, 7, 7, 7, 1, 1, 1, 1],  # two prompts of 4: each row gets the other prompt's responses, each once
    [0, 0, 0, 1],  # one prompt holds 3 of 4 rows: no permutation exists; still never the row's own prompt
    list(range(5)),  # one response per prompt: TRL's rotation
])
def test_mismatched_partners_are_other_prompts_and_a_permutation_when_possible(keys):
    partners = mismatched_partners(keys, seed=3)
    assert all(keys[p] != keys[i] for i, p in enumerate(partners))
    if max(Counter(keys).values()) * 2 <= len(keys):
        assert sorted(partners) == list(range(len(keys)))
    assert partners == mismatched_partners(keys, seed=3)  # seeded


def test_mismatched_partners_need_two_prompts():
    with pytest.raises(ValueError, match="at least 2 prompts"):
        mismatched_partners([5, 5, 5], seed=0)


# ---------------------------------------------------------------------------------------------------- rlhf filter

SCORED = [  # (rewards of 4 responses) -> what the rule keeps
    [0.5, -1.0, 2.0, 0.5],  # p0: 1 desirable (2.0), 1 undesirable (-1.0), 2 at the mean
    [1.0, 1.0, 1.0, 1.0],  # p1: all equal: dropped (equal_rewards)
    [0.1, 0.2, 0.3, 0.2],  # p2: 0.3 desirable, 0.1 undesirable, both 0.2 at the mean (0.8/4 = 0.2)
    [3.0, 0.0, 0.0, 0.0],  # p3: 1 desirable, 3 undesirable
    [0.0, 1.0, 0.0, 1.0],  # p4: 2 and 2
    [0.0, 2.0, 1.0, 5.0],  # p5: mean 2: 5.0 desirable, 0.0 and 1.0 undesirable, 2.0 at the mean
]


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> str:
    rows = [{"prompt_id": f"p{i}", "prompt": f"Review thing {i}.", "label": i,
             "responses": [f"Answer {j} to {i}." for j in range(4)], "rewards": r,
             "finish_reasons": ["stop"] * 4} for i, r in enumerate(SCORED)]
    return write_jsonl(tmp_path_factory.mktemp("kto_scored") / "scored.jsonl", rows)


def test_filter_unpaired_labels_counts_and_pairs(scored, tiny_policy, tmp_path):
    assert run("filter", "--input", scored, "--output", tmp_path / "u", "--tokenizer", tiny_policy, "--mode",
               "unpaired", "--test-size", 0) == 0
    train = load_from_disk(str(tmp_path / "u"))["train"]
    labels = {(r["prompt_id"], r["response_index"]): r["desirable"] for r in train}
    assert labels == {("p0", 1): False, ("p0", 2): True, ("p2", 0): False, ("p2", 2): True,
                      ("p3", 0): True, ("p3", 1): False, ("p3", 2): False, ("p3", 3): False,
                      ("p4", 0): False, ("p4", 1): True, ("p4", 2): False, ("p4", 3): True,
                      ("p5", 0): False, ("p5", 2): False, ("p5", 3): True}
    for r in train:  # each row: its own response, reward and the prompt's columns carried through
        assert r["completion"] == f"Answer {r['response_index']} to {r['label']}."
        assert r["reward"] == SCORED[r["label"]][r["response_index"]]
    manifest = json.loads((tmp_path / "u" / "manifest.json").read_text())
    assert manifest["rows_in"] == 6 and manifest["rows_out"] == {"train": 15}
    assert manifest["dropped"] == {"equal_rewards": 1, "response_at_mean": 5}
    assert manifest["unpaired"]["train"] == {"prompts": 5, "desirable": 6, "undesirable": 9}
    # the mismatched pairs: another prompt's response, every response used once (no prompt holds half the rows)
    assert all(r["kl_prompt_id"] != r["prompt_id"] for r in train)
    assert sorted(map(tuple, train["kl_completion_token_ids"])) == sorted(map(tuple, train["completion_token_ids"]))


def test_filter_unpaired_splits_by_prompt(scored, tiny_policy, tmp_path):
    assert run("filter", "--input", scored, "--output", tmp_path / "u", "--tokenizer", tiny_policy, "--mode",
               "unpaired", "--test-size", 2, "--seed", 1) == 0
    dd = load_from_disk(str(tmp_path / "u"))
    prompts = {split: set(dd[split]["prompt_id"]) for split in dd}
    assert len(prompts["test"]) == 2 and len(prompts["train"]) == 3 and not prompts["test"] & prompts["train"]
    for split in dd:  # the mismatched response comes from the same split
        assert set(dd[split]["kl_prompt_id"]) <= prompts[split]


# ---------------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    """generate -> score -> filter --mode unpaired -> ref-logps (at temperature 1.0, KTO's, as the DPO family)."""
    d = tmp_path_factory.mktemp("kto_data")
    (d / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", tiny_policy, "--prompts", bundled_prompts, "--output", d / "gen", "--n", 4,
               "--max-new-tokens", 16, "--limit", 40) == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored", "--reward-fn", f"{d}/reward.py:reward") == 0
    assert run("filter", "--input", d / "scored", "--output", d / "unpaired", "--tokenizer", tiny_policy,
               "--mode", "unpaired", "--test-size", 6) == 0
    assert run("ref-logps", "--model", tiny_policy, "--input", d / "unpaired", "--output", d / "ref") == 0
    # KTO's temperature, though the responses were sampled at 0.8: KTO is the only algorithm of unpaired data
    assert json.loads((d / "ref" / "manifest.json").read_text())["ref_logps"]["temperature"] == 1.0
    # For the invariants: the mismatched pairs' reference log-probs lowered by 0.5, 1.5 or 2.5 (by row), so that z0
    # is well above 0 from the first step and differs between any two subsets of a step's rows.
    dd = load_from_disk(str(d / "ref"))
    dd.map(lambda r, i: {"kl_ref_logp": r["kl_ref_logp"] - 0.5 - i % 3}, with_indices=True).save_to_disk(
        str(d / "shifted"))
    return d


def train_args(data: Path, policy: str, out: Path, *extra, split: str = "ref") -> list:
    return ["train", "--algo", "kto", "--model", policy, "--data", data / split, "--output", out,
            "--report-to", "none", *extra]


def test_ref_logps_of_responses_and_mismatched_pairs(unpaired, tiny_policy):
    from rlhf_pipeline.chat import load_tokenizer
    from rlhf_pipeline.logprobs import build_batch, sequence_logps
    from rlhf_pipeline.modeling import load_causal_lm

    row = load_from_disk(str(unpaired / "ref"))["test"][0]
    model, tok = load_causal_lm(tiny_policy), load_tokenizer(tiny_policy)
    batch = build_batch([row["prompt_token_ids"]] * 2, [row["completion_token_ids"], row["kl_completion_token_ids"]],
                        tok.pad_token_id)
    with torch.no_grad():
        completion, kl = sequence_logps(model, batch, temperature=1.0).tolist()
    assert row["completion_ref_logp"] == pytest.approx(completion, abs=1e-4)
    assert row["kl_ref_logp"] == pytest.approx(kl, abs=1e-4)


def test_kto_lowers_the_loss_changes_every_parameter_and_reuses_the_reference_pass(unpaired, tiny_policy, tmp_path):
    # about two epochs: the second sees the same responses again, and their loss falls
    common = ["--max-steps", 30, "--batch-size", 8, "--learning-rate", 1e-3, "--warmup-ratio", 0.0, "--beta", 1.0]
    out = tmp_path / "kto"
    assert run(*train_args(unpaired, tiny_policy, out, *common)) == 0
    curve = logged(out)
    assert len(curve) == 30 and sum(curve[-5:]) / 5 < 0.8 * sum(curve[:5]) / 5, curve
    before, after = load_file(Path(tiny_policy) / "model.safetensors"), load_file(out / "model.safetensors")
    assert not [k for k in before if torch.equal(before[k], after[k])]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"loss/train", "loss/eval", "reward/accuracy", "kl/train_kl", "logp/train_logratio"} <= set().union(*records)
    assert all(r["kl/train_kl"] >= 0 for r in records if "kl/train_kl" in r)  # z0 is clamped at 0
    # the log-ratio over each label's responses: the test split's overall mean is their mix by the label counts
    final = [r for r in records if "logp/desirable_logratio" in r][-1]
    labels = load_from_disk(str(unpaired / "ref"))["test"]["desirable"]
    wanted = sum(labels)
    assert 0 < wanted < len(labels)
    mix = (wanted * final["logp/desirable_logratio"] + (len(labels) - wanted) * final["logp/undesirable_logratio"])
    assert mix / len(labels) == pytest.approx(final["logp/logratio"], rel=1e-5)
    assert final["logp/desirable_logratio"] > final["logp/undesirable_logratio"]  # KTO pulls the two apart
    training = json.loads((out / "manifest.json").read_text())["training"]
    train = load_from_disk(str(unpaired / "ref"))["train"]
    assert training["classes"]["desirable"] == sum(train["desirable"]) and training["logp_temperature"] == 1.0
    assert training["loss_params"] == {"beta": 1.0, "desirable_weight": 1.0, "undesirable_weight": 1.0}
    assert not (out / "ref_logps").exists()  # the columns came with the data

    # Without the columns, train runs the same reference pass itself (kept in OUTPUT/ref_logps): the same run.
    own = tmp_path / "own"
    assert run(*train_args(unpaired, tiny_policy, own, *common, split="unpaired")) == 0
    cached = load_from_disk(str(own / "ref_logps"))["train"]
    assert cached["kl_ref_logp"] == pytest.approx(train["kl_ref_logp"], abs=1e-5)
    assert logged(own) == pytest.approx(curve, abs=1e-5)


def test_kto_batch_times_accumulation_and_a_token_budget_are_invariant(unpaired, tiny_policy, tmp_path, monkeypatch):
    """z0 comes from the whole step's mismatched pairs, so 4 x 1, 2 x 2 and 2 x 2 cut by --max-tokens-per-micro-batch
    into micro-batches of other sizes train against the same z0 (per micro-batch, as TRL estimates it, the parts of a
    step would get different ones)."""
    common = ["--max-steps", 3, "--learning-rate", 1e-3, "--beta", 1.0]
    assert run(*train_args(unpaired, tiny_policy, tmp_path / "b4", *common, "--batch-size", 4, split="shifted")) == 0
    assert run(*train_args(unpaired, tiny_policy, tmp_path / "b2", *common, "--batch-size", 2,
                           "--gradient-accumulation-steps", 2, split="shifted")) == 0
    plans = spy_token_budget_plans(monkeypatch)
    assert run(*train_args(unpaired, tiny_policy, tmp_path / "tokens", *common, "--batch-size", 2,
                           "--gradient-accumulation-steps", 2, "--max-tokens-per-micro-batch", 60,
                           split="shifted")) == 0
    assert len(micro_batch_sizes(plans) - {2}) >= 1, plans
    z0 = logged(tmp_path / "b4", "kl/train_kl")
    assert min(z0) > 0.5
    for other in ("b2", "tokens"):
        assert logged(tmp_path / "b4") == pytest.approx(logged(tmp_path / other), abs=1e-5)
        assert_same_gradient_norms(tmp_path / "b4", tmp_path / other)
        # z0 sums log-probs over whole sequences: the weights' float-order differences (~1e-7) show up at 1e-5
        assert z0 == pytest.approx(logged(tmp_path / other, "kl/train_kl"), abs=1e-4)
        assert max_weight_diff(tmp_path / "b4", tmp_path / other) < 1e-4


def test_kto_interrupted_run_resumed_equals_uninterrupted(unpaired, tiny_policy, tmp_path, monkeypatch):
    common = ["--max-steps", 5, "--batch-size", 2, "--save-every", 2, "--learning-rate", 1e-3]
    assert run(*train_args(unpaired, tiny_policy, tmp_path / "full", *common, split="shifted")) == 0
    real_save = trainer.save_checkpoint

    def save_then_crash(accelerator, model, tokenizer, output, state, **kwargs):
        path = real_save(accelerator, model, tokenizer, output, state, **kwargs)
        if state["step"] == 2:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_crash)
    assert run(*train_args(unpaired, tiny_policy, tmp_path / "cut", *common, split="shifted")) == 130
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    assert run(*train_args(unpaired, tiny_policy, tmp_path / "cut", *common, "--resume", split="shifted")) == 0
    assert logged(tmp_path / "cut") == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    assert logged(tmp_path / "cut", "kl/train_kl") == pytest.approx(logged(tmp_path / "full", "kl/train_kl"), abs=1e-6)
    assert max_weight_diff(tmp_path / "cut", tmp_path / "full") < 1e-6


def test_kto_two_process_zero3_equals_one_process(unpaired, tiny_policy, tmp_path):
    """2 processes x batch 2 under DeepSpeed ZeRO-3 (CPU, gloo) against 1 process x batch 2 x accumulation 2: the z0
    pass is shared over the processes and gathered, the evaluation's z0 is per batch on both."""
    common = ["--max-steps", 3, "--learning-rate", 1e-3, "--beta", 1.0]
    assert run(*train_args(unpaired, tiny_policy, tmp_path / "single", *common, "--batch-size", 2,
                           "--gradient-accumulation-steps", 2, split="shifted")) == 0
    launch_cpu_zero3(train_args(unpaired, tiny_policy, tmp_path / "zero3", *common, "--batch-size", 2,
                                split="shifted"))
    for key in ("loss/train", "kl/train_kl", "loss/eval"):
        assert logged(tmp_path / "zero3", key) == pytest.approx(logged(tmp_path / "single", key), abs=1e-5), key
    assert max_weight_diff(tmp_path / "zero3", tmp_path / "single") < 1e-4


# ---------------------------------------------------------------------------------------------------- the registry


def test_iterate_and_demo_derive_the_unpaired_filter_mode(tmp_path):
    from rlhf_pipeline.algorithms import UNPAIRED, get
    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.stages.iterate import IterateConfig, plan

    assert get("kto").data == UNPAIRED and get("kto").demo
    config = dict(output=str(tmp_path / "run"), model="base", prompts="p.jsonl", iterations=2, reward_model="rm",
                  algo="kto")
    steps = plan(IterateConfig(**config))
    filters = [s for s in steps if s.stage == "filter"]
    assert len(filters) == 2 and all(s.args[s.args.index("--mode") + 1] == "unpaired" for s in filters)
    assert not any("--ref-model" in s.args for s in steps)  # the reference is the sampling policy, as for DPO
    with pytest.raises(PipelineError, match="trains on unpaired; remove filter mode 'pairs'"):
        plan(IterateConfig(**config, filter={"mode": "pairs"}))
