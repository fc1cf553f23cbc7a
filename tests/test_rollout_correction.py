"""The sampler's log-probs, kept by rlhf generate and carried to training, and the PPO family's rollout correction.

The correction's weights against hand-worked numbers and the peers' formulas written out (TRL f2cd577,
``GRPOTrainer._generate_and_score_completions``: ``token_truncate`` and ``token_mask``; verl's geometric-mean sequence
masking, ``rollout_rs="geometric"``); then the columns through the stages, and training runs where the sampler and
the trainer agree (T as sampled: the weights are 1 to float noise) and where they do not (the trainer told another
temperature: ``rollout/train_kl_sampler`` rises and the correction acts)."""

import json
import math

import pytest
import torch

from rlhf_pipeline.advantages import rollout_correction
from conftest import LENGTH_REWARD, logged, run

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_weights_hand_values():
    """Trainer minus sampler log-probs (0, log 3, −log 3, log 1.5) on one response, cap 2: w = (1, 3, 1/3, 1.5).
    tis: (1, 2, 1/3, 1.5), one token truncated; mask: (1, 0, 0, 1); sequence_mask: geometric mean
    exp((log 3 − log 3 + log 1.5)/4) = 1.5^(1/4) = 1.107 ≤ 2: all kept. k3 per token w − 1 − log w:
    (0, 3 − 1 − 1.0986, 1/3 − 1 + 1.0986, 1.5 − 1 − 0.4055) = (0, 0.9014, 0.4319, 0.0945), mean 0.356967."""
    trainer = t([0.0, math.log(3), -math.log(3), math.log(1.5)]) - 1.0
    sampler = t([-1.0, -1.0, -1.0, -1.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    tis, metrics = rollout_correction(trainer, sampler, mask, "tis", 2.0)
    assert tis[0].tolist() == pytest.approx([1.0, 2.0, 1 / 3, 1.5])
    assert metrics["corrected_fraction"] == pytest.approx(0.25)
    assert metrics["kl_sampler"] == pytest.approx((0.9013877 + 0.4319456 + 0.0945349) / 4, abs=1e-6)
    mask_w, metrics = rollout_correction(trainer, sampler, mask, "mask", 2.0)
    assert mask_w[0].tolist() == [1.0, 0.0, 0.0, 1.0] and metrics["corrected_fraction"] == 0.5
    seq, _ = rollout_correction(trainer, sampler, mask, "sequence_mask", 2.0)
    assert seq[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    seq, metrics = rollout_correction(trainer, sampler, mask, "sequence_mask", 1.1)  # 1.107 > 1.1: dropped
    assert seq[0].tolist() == [0.0] * 4 and metrics["weight_mean"] == 0.0


def test_weights_match_trl_and_verl_on_random_tensors():
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(8, 12, generator=g, dtype=torch.float64) * 4
    sampler = trainer + torch.randn(8, 12, generator=g, dtype=torch.float64) * 0.7
    lengths = torch.randint(1, 13, (8,), generator=g)
    mask = torch.arange(12).unsqueeze(0) < lengths.unsqueeze(1)
    m = mask.double()
    ratio = torch.exp((trainer - sampler) * m)  # TRL: exp((old − sampling) · mask)
    ours, _ = rollout_correction(trainer, sampler, mask, "tis", 3.0)
    assert torch.allclose(ours, torch.clamp(ratio, max=3.0) * m)  # token_truncate, clip_max 3
    ours, _ = rollout_correction(trainer, sampler, mask, "mask", 3.0)
    trl_mask = ratio.masked_fill((ratio < 1 / 3.0) | (ratio > 3.0), 0.0)  # token_mask, clip_min 1/3, clip_max 3
    assert torch.allclose(ours, torch.where(trl_mask > 0, 1.0, 0.0).double() * m)
    # verl: the geometric mean of the token ratios, exp(masked mean of the log ratios), kept within [1/C, C]
    log_ratio = ((trainer - sampler) * m).sum(-1) / m.sum(-1)
    keep = ((torch.exp(log_ratio) >= 1 / 1.2) & (torch.exp(log_ratio) <= 1.2)).double().unsqueeze(-1)
    ours, _ = rollout_correction(trainer, sampler, mask, "sequence_mask", 1.2)
    assert torch.allclose(ours, keep * m)
    assert 0 < keep.sum() < 8  # the check can fail both ways here


def test_an_unknown_sampler_log_prob_weighs_one_and_is_counted():
    weights, metrics = rollout_correction(t([-1.0, -2.0]), t([float("nan"), -2.0]), torch.ones(1, 2, dtype=torch.bool),
                                          "mask", 2.0)
    assert weights[0].tolist() == [1.0, 1.0] and metrics["unknown_fraction"] == 0.5 and metrics["kl_sampler"] == 0.0


def sampled(d, policy, prompts, top_p: float, modes=("groups",)):
    (d / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", policy, "--prompts", prompts, "--output", d / "gen", "--n", 4,
               "--max-new-tokens", 12, "--limit", 24, "--temperature", 0.8, "--top-p", top_p, "--engine", "hf") == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored", "--reward-fn", f"{d}/reward.py:reward") == 0
    for mode in modes:
        assert run("filter", "--input", d / "scored", "--output", d / mode, "--tokenizer", policy, "--mode", mode,
                   "--test-size", 4) == 0
    return d


@pytest.fixture(scope="module")
def stages(tmp_path_factory, tiny_policy, bundled_prompts):
    """Sampled at T = 0.8 without truncation (top-p 1), filtered in every mode."""
    return sampled(tmp_path_factory.mktemp("rollout"), tiny_policy, bundled_prompts, 1.0,
                   ("groups", "pairs", "unpaired", "best"))


def test_the_sampler_log_probs_travel_with_their_responses(stages):
    from datasets import load_from_disk

    gen = load_from_disk(str(stages / "gen"))
    manifest = json.loads((stages / "gen" / "manifest.json").read_text())
    assert manifest["sampler_logprobs"]["column"] == "response_logprobs"
    row = gen[0]
    assert [len(x) for x in row["response_logprobs"]] == [len(x) for x in row["response_token_ids"]]
    assert all(x <= 0 for lps in row["response_logprobs"] for x in lps)
    by_prompt = {r["prompt_id"]: r for r in gen}
    groups = load_from_disk(str(stages / "groups"))["train"][0]
    assert groups["response_logprobs"] == by_prompt[groups["prompt_id"]]["response_logprobs"]
    for mode, pairs in (("pairs", (("chosen", "chosen_logprobs"), ("rejected", "rejected_logprobs"))),
                        ("best", (("completion", "completion_logprobs"),)),
                        ("unpaired", (("completion", "completion_logprobs"),))):
        row = load_from_disk(str(stages / mode))["train"][0]
        source = by_prompt[row["prompt_id"]]
        for text, column in pairs:
            j = source["responses"].index(row[text])
            assert row[column] == source["response_logprobs"][j], (mode, column)


def train(stages, policy, out, *extra):
    return run("train", "--algo", "grpo", "--model", policy, "--data", stages / "groups", "--output", out,
               "--report-to", "none", "--max-steps", 2, "--batch-size", 8, "--learning-rate", 1e-3, *extra)


def test_at_the_sampling_temperature_the_correction_is_the_identity(stages, tiny_policy, tmp_path):
    """The hf engine samples with the trainer's own kernels: by default (tis, cap 2) every weight is 1 to float
    noise, and the run equals one without the correction."""
    assert train(stages, tiny_policy, tmp_path / "tis") == 0
    assert train(stages, tiny_policy, tmp_path / "none", "--rollout-correction", "none") == 0
    record = json.loads((tmp_path / "tis" / "manifest.json").read_text())["training"]["rollout_correction"]
    assert record["mode"] == "tis" and record["cap"] == 2.0
    assert record["kl_sampler"] < 1e-8 and record["corrected_fraction"] == 0.0
    assert record["weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert logged(tmp_path / "tis") == pytest.approx(logged(tmp_path / "none"), abs=1e-5)
    assert max(logged(tmp_path / "tis", "rollout/train_kl_sampler")) < 1e-8
    assert json.loads((tmp_path / "none" / "manifest.json").read_text())["training"]["rollout_correction"]["mode"] \
        == "none"


def test_a_trainer_at_another_temperature_sees_the_gap_and_the_correction_acts(stages, tiny_policy, tmp_path):
    """Sampled at T = 0.8, trained as if at T = 2.0: the trainer's log-probs are not the sampler's, the k3 KL between
    them is far from 0, and masking at cap 1.2 drops the tokens whose ratio left [1/1.2, 1.2]."""
    assert train(stages, tiny_policy, tmp_path / "t1", "--temperature", 2.0, "--rollout-correction", "mask",
                 "--rollout-correction-cap", 1.2) == 0
    record = json.loads((tmp_path / "t1" / "manifest.json").read_text())["training"]["rollout_correction"]
    assert record["kl_sampler"] > 1e-3 and 0 < record["corrected_fraction"] < 1
    assert record["weight_mean"] == pytest.approx(1 - record["corrected_fraction"])
    assert min(logged(tmp_path / "t1", "rollout/train_kl_sampler")) > 1e-3
    assert max(logged(tmp_path / "t1", "rollout/train_corrected_fraction")) > 0


def test_data_without_sampler_log_probs_trains_and_an_asked_correction_is_one_line(stages, tiny_policy, tmp_path,
                                                                                  capsys):
    from datasets import load_from_disk

    old = load_from_disk(str(stages / "groups"))
    old = old.remove_columns("response_logprobs")
    old.save_to_disk(str(tmp_path / "old_groups"))
    args = ["train", "--algo", "grpo", "--model", tiny_policy, "--data", tmp_path / "old_groups", "--report-to",
            "none", "--max-steps", 1, "--batch-size", 8, "--temperature", 0.8]
    assert run(*args, "--output", tmp_path / "plain") == 0
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["training"]["rollout_correction"] is None
    capsys.readouterr()
    assert run(*args, "--output", tmp_path / "asked", "--rollout-correction", "tis") == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "--rollout-correction tis needs the sampler's log-probs (response_logprobs)" in line
    assert not (tmp_path / "asked").exists()


def test_under_top_p_the_sampler_is_the_renormalised_nucleus_and_tis_weighs_it_back(tmp_path, tiny_policy,
                                                                                  bundled_prompts):
    """Top-p 0.9: each sampled token's sampler log-prob is the trainer's plus −log(nucleus mass), and the nucleus
    holds at least 0.9 of the mass, so w = π_old/π_sampler is in [0.9, 1]: the default tis (cap 2) truncates nothing
    and weighs each token by its nucleus mass, the importance weight back to the untruncated policy."""
    d = sampled(tmp_path, tiny_policy, bundled_prompts, 0.9)
    assert train(d, tiny_policy, tmp_path / "tis") == 0
    record = json.loads((tmp_path / "tis" / "manifest.json").read_text())["training"]["rollout_correction"]
    assert record["mode"] == "tis" and record["corrected_fraction"] == 0.0
    assert 0.9 - 1e-4 <= record["weight_mean"] < 1.0 and record["kl_sampler"] > 1e-4
