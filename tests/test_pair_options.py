"""The DPO family's NLL term on the chosen response (RPO): hand-worked numbers, TRL's ``rpo_alpha`` where the two
agree (one pair per micro-batch) and where they differ, the option's checks, and a run that logs it."""

import json
import math

import pytest
import torch

from rlhf_pipeline.algorithms import compute_pair_loss, get, pair_loss_params
from rlhf_pipeline.stages.train import TrainConfig


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_nll_term_by_hand():
    """One pair: logπ(c) = −6 over 3 tokens, logπ(r) = −9, ref −7 and −8, β 0.1: Δ = (−6 + 7) − (−9 + 8) = 2,
    DPO −log σ(0.2) = 0.598139; NLL = 6 / 3 = 2; α = 0.5 → 0.598139 + 1."""
    params = pair_loss_params(get("dpo"), beta=0.1, nll_coef=0.5)
    chosen = t([-6.0]).requires_grad_()
    loss, metrics = compute_pair_loss("dpo", params, chosen, t([-9.0]), t([-7.0]), t([-8.0]),
                                      chosen_lengths=t([3.0]), rejected_lengths=t([5.0]))
    dpo = -math.log(1 / (1 + math.exp(-0.2)))
    assert loss.item() == pytest.approx(dpo + 1.0, abs=1e-12)
    assert metrics["nll"].item() == pytest.approx(2.0)
    (grad,) = torch.autograd.grad(loss.sum(), chosen)
    # d/dlogπ(c): DPO's −β·σ(−βΔ) plus the NLL's −α/|c|
    assert grad.item() == pytest.approx(-0.1 / (1 + math.exp(0.2)) - 0.5 / 3, abs=1e-12)
    plain, plain_metrics = compute_pair_loss("dpo", pair_loss_params(get("dpo"), beta=0.1), chosen, t([-9.0]),
                                             t([-7.0]), t([-8.0]))
    assert plain.item() == pytest.approx(dpo) and "nll" not in plain_metrics


def trl_rpo_nll(chosen_token_logps: list[torch.Tensor]) -> torch.Tensor:
    """TRL's ``rpo_alpha`` term, written out (``trl/trainer/dpo_trainer.py``, ``DPOTrainer.concatenated_forward``):
    ``cross_entropy`` over the chosen half's label tokens, ignore_index for the rest: the mean over every chosen
    token of the micro-batch."""
    return -torch.cat(chosen_token_logps).mean()


def test_nll_term_against_trls_rpo_alpha():
    gen = torch.Generator().manual_seed(0)
    tokens = [-torch.rand(n, generator=gen, dtype=torch.float64) * 4 for n in (2, 7)]
    sums, lengths = torch.stack([x.sum() for x in tokens]), t([2.0, 7.0])
    params = pair_loss_params(get("dpo"), nll_coef=1.0)
    zeros = torch.zeros(2, dtype=torch.float64)
    _, metrics = compute_pair_loss("dpo", params, sums, zeros, zeros, zeros, chosen_lengths=lengths,
                                   rejected_lengths=lengths)
    for i in range(2):  # one pair per micro-batch: the same number
        assert metrics["nll"][i].item() == pytest.approx(trl_rpo_nll([tokens[i]]).item(), abs=1e-12)
    # two pairs of 2 and 7 tokens in one micro-batch: TRL weighs each token, here each pair
    assert metrics["nll"].mean().item() != pytest.approx(trl_rpo_nll(tokens).item(), abs=1e-3)


@pytest.mark.parametrize("algo, value, message", [("rebel", 0.5, "--nll-coef is not read by --algo rebel"),
                                                  ("grpo", 0.5, "--nll-coef is not read by --algo grpo"),
                                                  ("dpo", -1.0, "--nll-coef must be >= 0")])
def test_nll_coef_checks(algo, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(model="m", data="d", output="o", algo=algo, nll_coef=value)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_dpo_with_the_nll_term_trains_and_logs_it(tmp_path, tiny_policy, small_prompts):
    from conftest import LENGTH_REWARD, logged, run

    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", tiny_policy, "--prompts", small_prompts, "--output", tmp_path / "gen", "--n", 2,
               "--max-new-tokens", 8) == 0
    assert run("score", "--input", tmp_path / "gen", "--output", tmp_path / "scored", "--reward-fn",
               f"{tmp_path}/reward.py:reward") == 0
    assert run("filter", "--input", tmp_path / "scored", "--output", tmp_path / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 0) == 0
    assert run("train", "--algo", "dpo", "--model", tiny_policy, "--data", tmp_path / "pairs", "--output",
               tmp_path / "out", "--max-steps", 2, "--batch-size", 2, "--nll-coef", 1.0, "--report-to", "none") == 0
    nll = [r for r in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())
           if any("nll" in k for k in r)]
    assert len(nll) == 2 and all(v > 0 for r in nll for k, v in r.items() if "nll" in k)
    assert len(logged(tmp_path / "out")) == 2
    params = json.loads((tmp_path / "out" / "manifest.json").read_text())["training"]["loss_params"]
    assert params["nll_coef"] == 1.0
