"""The 2026 losses (ORPO, CPO, CISPO, SAPO, SPPO, GDPO's advantages) and the policy's entropy: each against numbers
worked by hand (the arithmetic is in the docstrings) and against the peer's formula written out independently here
(TRL at commit f2cd577, July 2026: ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer._compute_loss`` for CISPO and
SAPO, ``_generate_and_score_completions`` for GDPO; ``trl/experimental/orpo`` and ``cpo`` for ORPO and CPO; the SPPO
paper's update, Wu et al. 2024, eq. 3.5). Float64, 1e-9 absolute unless stated."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhf_pipeline.advantages import decoupled_group_norm, win_rates
from rlhf_pipeline.algorithms import ALGORITHMS, compute_pair_loss, get
from rlhf_pipeline.algorithms.groups import RLParams
from rlhf_pipeline.losses import (
    PairLossParams,
    cispo_policy_loss,
    cpo_loss,
    orpo_loss,
    sapo_policy_loss,
    sppo_loss,
)


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def close(actual, expected, tol=1e-9):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, rtol=0.0, atol=tol), (actual, expected)


# ------------------------------------------------------------------------------------------------ ORPO and CPO


def test_orpo_hand_value():
    """logπc = −2 over 2 tokens (mean c = −1), logπr = −6 over 3 (r = −2), β = 0.1.
    log odds(yc) − log odds(yr) = (c − r) − (log(1 − e^c) − log(1 − e^r)) = 1 − (log 0.6321206 − log 0.8646647)
    = 1 + 0.3132616 = 1.3132616; log σ(1.3132616) = −log(1 + 0.2689415) = −0.2381830;
    loss = −c − β·(−0.2381830) = 1.0238183."""
    loss = orpo_loss(t(-2.0), t(-6.0), t(2.0), t(3.0), beta=0.1)
    log_odds = 1 - (math.log(1 - math.exp(-1)) - math.log(1 - math.exp(-2)))
    assert log_odds == pytest.approx(1.3132617, abs=1e-7)
    close(loss, t(1.0 + 0.1 * math.log1p(math.exp(-log_odds))))
    assert float(loss) == pytest.approx(1.0238183, abs=1e-7)


def test_orpo_matches_trl_odds_ratio_loss():
    """TRL's ORPOTrainer: average log-probs, ``log_odds = (c − r) − (log1p(−exp(c)) − log1p(−exp(r)))``,
    ``ratio = logsigmoid(log_odds)``, loss = NLL − β·ratio (per pair here: the NLL of the pair's chosen tokens)."""
    g = torch.Generator().manual_seed(0)
    lengths_c, lengths_r = torch.randint(1, 40, (64,), generator=g).double(), torch.randint(1, 40, (64,), generator=g).double()
    pc = -torch.rand(64, generator=g, dtype=torch.float64) * 3 * lengths_c
    pr = -torch.rand(64, generator=g, dtype=torch.float64) * 3 * lengths_r
    c, r = pc / lengths_c, pr / lengths_r
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    trl = -c - 0.25 * F.logsigmoid(log_odds)
    close(orpo_loss(pc, pr, lengths_c, lengths_r, beta=0.25), trl)
    close(orpo_loss(pc, pr, lengths_c, lengths_r, beta=0.25, sft_coef=0.6), -0.6 * c - 0.25 * F.logsigmoid(log_odds))


def test_orpo_is_finite_with_its_gradient_when_a_response_is_certain():
    """A mean token log-prob of exactly 0 (an empty response, or one the model is sure of in float32): the odds are
    infinite, the odds term is at its limit (0), and the gradient stays finite; log(1 − e^0) = −inf made it NaN, and
    the step was skipped."""
    pc, pr = t(0.0, -2.0, 0.0).requires_grad_(), t(-6.0, 0.0, 0.0).requires_grad_()
    loss = orpo_loss(pc, pr, t(2.0, 2.0, 1.0), t(3.0, 1.0, 1.0), beta=0.1)
    loss_values = loss.detach()
    assert float(loss_values[0]) == pytest.approx(0.0, abs=1e-12)  # −c − β·log σ(+inf)
    assert math.isfinite(float(loss_values[1])) and float(loss_values[1]) > 5.0  # rejected certain: +inf at the limit
    assert float(loss_values[2]) == pytest.approx(0.1 * math.log(2.0))  # both certain: log odds 0, −β·log σ(0)
    loss.sum().backward()
    assert torch.isfinite(pc.grad).all() and torch.isfinite(pr.grad).all()


def test_cpo_hand_value_and_trl():
    """logπc = −3 over 3 tokens, logπr = −5, β = 0.1: −log σ(0.2) + 1 = log(1 + e^−0.2) + 1 = 1.5981389.
    TRL's CPOTrainer (loss_type sigmoid, no label smoothing): ``−logsigmoid(β(logπc − logπr)) + cpo_alpha·NLL``."""
    close(cpo_loss(t(-3.0), t(-5.0), t(3.0), beta=0.1), t(math.log1p(math.exp(-0.2)) + 1.0))
    assert float(cpo_loss(t(-3.0), t(-5.0), t(3.0), beta=0.1)) == pytest.approx(1.5981389, abs=1e-7)
    g = torch.Generator().manual_seed(1)
    pc, pr = -torch.rand(32, generator=g, dtype=torch.float64) * 50, -torch.rand(32, generator=g, dtype=torch.float64) * 50
    lengths = torch.randint(1, 30, (32,), generator=g).double()
    trl = -F.logsigmoid(0.5 * (pc - pr)) + 0.7 * (-pc / lengths)
    close(cpo_loss(pc, pr, lengths, beta=0.5, sft_coef=0.7), trl)


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_orpo_and_cpo_through_the_registry_are_reference_free(name):
    algo = get(name)
    assert not algo.needs_reference and algo.sft_term
    params = PairLossParams(beta=0.1)
    loss, metrics = compute_pair_loss(algo, params, t(-2.0, -3.0), t(-6.0, -5.0), chosen_lengths=t(2.0, 3.0),
                                      rejected_lengths=t(3.0, 3.0))
    expected = (orpo_loss(t(-2.0, -3.0), t(-6.0, -5.0), t(2.0, 3.0), t(3.0, 3.0), 0.1) if name == "orpo"
                else cpo_loss(t(-2.0, -3.0), t(-6.0, -5.0), t(2.0, 3.0), 0.1))
    close(loss, expected)
    assert metrics["accuracy"].tolist() == [1.0, 1.0]


def test_sft_coef_is_refused_where_there_is_no_nll_term():
    from rlhf_pipeline.stages.train import TrainConfig

    TrainConfig(algo="cpo", model="m", data="d", output="o", sft_coef=0.5).check_options(get("cpo"))
    with pytest.raises(ValueError, match=r"--sft-coef is not read by --algo dpo \(it is read by orpo, cpo\)"):
        TrainConfig(algo="dpo", model="m", data="d", output="o", sft_coef=0.5).check_options(get("dpo"))


# ------------------------------------------------------------------------------------------------ CISPO and SAPO


def policy_inputs(seed=0, b=6, width=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, width, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, width, generator=g, dtype=torch.float64) * 0.8  # ratios from ~0.1 to ~10
    advantages = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    return logp.requires_grad_(True), old, advantages, mask


def test_cispo_hand_values_and_gradient():
    """Two tokens, A = 2: ρ = e^0.5 = 1.6487 (under the cap 3) and e^2 = 7.389 (capped at 3). Per token
    −sg(min(ρ, 3))·A·logp with logp = (−1, −0.5): (1.6487·2·1, 3·2·0.5) = (3.2974, 3.0), token mean 3.1487.
    The gradient with respect to each logp is −min(ρ, 3)·A / 2 (the stopped weight, the token mean): no token dropped,
    even the capped one."""
    logp = t(-1.0, -0.5).requires_grad_(True)
    old = t(-1.5, -2.5)
    loss, metrics = cispo_policy_loss(logp, old, t(2.0, 2.0), torch.tensor([True, True]), max_weight=3.0)
    close(loss, t((math.exp(0.5) * 2 + 3.0 * 2 * 0.5) / 2).reshape(()))
    loss.backward()
    close(logp.grad, t(-math.exp(0.5) * 2 / 2, -3.0 * 2 / 2))
    close(metrics["clip_frac"], t(0.5).reshape(()))


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_cispo_matches_trl(reduction):
    """TRL: ``clamped = clamp(coef_1, max=epsilon_high).detach(); per_token_loss = −clamped·A·logp``; loss_type cispo
    divides the token sum by the token count (here for one process and no accumulation: the token mean);
    'sequence' as loss_type grpo's per-sequence mean. Here the cap is 1 + clip_high (clip_high 4 = TRL's 5.0)."""
    logp, old, advantages, mask = policy_inputs()
    ours, _ = cispo_policy_loss(logp, old, advantages, mask, max_weight=5.0, reduction=reduction)
    coef_1 = torch.exp(logp - old)
    per_token = -torch.clamp(coef_1, max=5.0).detach() * advantages.unsqueeze(1) * logp
    m = mask.double()
    trl = ((per_token * m).sum() / m.sum() if reduction == "token"
           else ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean())
    close(ours, trl)
    g_ours = torch.autograd.grad(ours, logp)[0]
    g_trl = torch.autograd.grad(trl, logp)[0]
    close(g_ours, g_trl)


def test_sapo_on_policy_is_the_policy_gradient_and_hand_value():
    """ρ = 1 everywhere: the gate σ(τ·0) = 1/2, so each token's loss is −A·(1/2)·4/τ = −2A/τ, and its gradient is
    −A·4·σ(1 − σ)·ρ·∇logp = −A·∇logp: the plain policy gradient. A = (1, −1), τ+ = 1, τ− = 1.05, one token each:
    loss = mean(−2, 2/1.05) = (−2 + 1.9047619)/2 = −0.0476190; gradient (−1/2, 1/2)."""
    logp = t(-1.0, -2.0).reshape(2, 1).requires_grad_(True)
    loss, metrics = sapo_policy_loss(logp, logp.detach(), t(1.0, -1.0), torch.ones(2, 1, dtype=torch.bool),
                                     temperature_pos=1.0, temperature_neg=1.05, reduction="sequence")
    close(loss, t(-0.0476190476190476).reshape(()), tol=1e-12)
    loss.backward()
    close(logp.grad, t(-0.5, 0.5).reshape(2, 1))
    close(metrics["gate_mean"], t(1.0).reshape(()))


def test_sapo_matches_trl():
    """TRL: ``temperatures = where(A > 0, τ+, τ−); soft_coef_1 = sigmoid(τ(coef_1 − 1))·4/τ; per_token_loss =
    −soft_coef_1·A``, loss_type sapo reduced per sequence, then over the sequences."""
    logp, old, advantages, mask = policy_inputs(seed=3)
    ours, _ = sapo_policy_loss(logp, old, advantages, mask, 1.0, 1.05, reduction="sequence")
    a = advantages.unsqueeze(1)
    tau = torch.where(a > 0, t(1.0), t(1.05))
    per_token = -torch.sigmoid(tau * (torch.exp(logp - old) - 1)) * 4 / tau * a
    m = mask.double()
    trl = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    close(ours, trl)
    close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(trl, logp)[0])


# ------------------------------------------------------------------------------------------------ SPPO


def test_win_rates_hand_values():
    """Rewards (0, 1, 3): P0 = (σ(−1) + σ(−3))/2 = (0.2689414 + 0.0474259)/2 = 0.1581836;
    P1 = (σ(1) + σ(−2))/2 = (0.7310586 + 0.1192029)/2 = 0.4251307; P2 = (σ(3) + σ(2))/2 = 0.9166856.
    The win rates of a group sum to n/2 (each pair's two probabilities sum to 1)."""
    p = win_rates(t(0.0, 1.0, 3.0).unsqueeze(0))
    close(p, t(0.1581836, 0.4251307, 0.9166856).unsqueeze(0), tol=1e-7)
    close(p.sum(), t(1.5).reshape(()))


def test_sppo_loss_is_the_papers_regression():
    """Wu et al. 2024, eq. 3.5: (log π(y)/π_t(y) − η(P(y ≻ π_t) − 1/2))², the log-ratio summed over the response's
    tokens. Two responses: log-ratios 0.3 (tokens 0.1 + 0.2) and −0.4; targets η(P − 1/2) with η = 2, P = (0.9, 0.2):
    0.8 and −0.6; errors (0.3 − 0.8)² = 0.25 and (−0.4 + 0.6)² = 0.04; mean 0.145."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = t(0.1, 0.2, -0.4, 123.0).reshape(2, 2).requires_grad_(True)  # 123: a padding position, never read
    mask = torch.tensor([[True, True], [True, False]])
    targets = 2.0 * (t(0.9, 0.2) - 0.5)
    loss, metrics = sppo_loss(logp, old, targets, mask)
    close(loss, t(0.145).reshape(()))
    loss.backward()
    close(logp.grad, t(2 * (0.3 - 0.8) / 2, 2 * (0.3 - 0.8) / 2, 2 * (-0.4 + 0.6) / 2, 0.0).reshape(2, 2))
    close(metrics["logratio_mean"], t(-0.05).reshape(()))
    # a third response with no token is a 0-loss row (not (0 − target)²) that still counts in the mean
    loss3, _ = sppo_loss(torch.cat([logp.detach(), torch.zeros(1, 2, dtype=torch.float64)]),
                         torch.zeros(3, 2, dtype=torch.float64), torch.cat([targets, t(5.0)]),
                         torch.cat([mask, torch.zeros(1, 2, dtype=torch.bool)]))
    close(loss3, t(0.29 / 3).reshape(()))


def test_sppo_targets_through_the_registry():
    algo = get("sppo")
    params = RLParams(algo="sppo", eta=4.0)
    scores = algo.baseline_fn()(t(0.0, 1.0, 3.0).unsqueeze(0), params)
    close(scores, 4.0 * (win_rates(t(0.0, 1.0, 3.0).unsqueeze(0)) - 0.5))


# ------------------------------------------------------------------------------------------------ GDPO


def test_decoupled_group_norm_matches_trl_normalize_then_sum():
    """TRL ``multi_objective_aggregation="normalize_then_sum"``: per group and source ``(r − mean) / (std + 1e-4)``
    (unbiased std), the weighted sum, then ``(s − mean) / (std + 1e-4)`` over the batch."""
    g = torch.Generator().manual_seed(5)
    groups, n, k = 6, 4, 3
    rewards = torch.randn(groups * n, k, generator=g, dtype=torch.float64) * t(1.0, 10.0, 0.1)
    weights = t(1.0, 0.5, 2.0)
    grouped = rewards.view(groups, n, k)
    normed = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
    summed = (normed.view(-1, k) * weights).sum(dim=1)
    trl = (summed - summed.mean()) / (summed.std() + 1e-4)
    ours = decoupled_group_norm(rewards, torch.arange(groups).repeat_interleave(n), weights)
    close(ours, trl)


def test_decoupled_group_norm_is_not_the_sum_then_normalize():
    """The reason GDPO exists: a source on a large scale dominates a sum of raw rewards. One group of two samples;
    source 0 prefers sample 0 by 100, source 1 (weight 2) prefers sample 1 by 1. Summed first (100 vs 2), sample 0
    wins; normalised per source first (±0.707 each), the weight-2 source wins: sample 1."""
    rewards = t(100.0, 0.0, 0.0, 1.0).reshape(2, 2)
    ours = decoupled_group_norm(rewards, torch.tensor([0, 0]), t(1.0, 2.0))
    assert ours[0] < 0 < ours[1]
    summed = rewards @ t(1.0, 2.0)
    assert summed[0] > summed[1]


# ------------------------------------------------------------------------------------------------ entropy


def test_token_entropy_equals_the_full_softmax_entropy(tiny_policy):
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.logprobs import build_batch, token_logps, token_logps_and_entropy

    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float64).eval()
    batch = build_batch([[1, 5, 6], [1, 7]], [[8, 9, 2], [10, 2]], pad_id=0)
    logps, seq, entropy = token_logps_and_entropy(model, batch, temperature=0.7, chunk_size=2)
    reference, _ = token_logps(model, batch, temperature=0.7)
    close(logps, reference)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 0.7
    expected = []
    for row, (prompt, response) in enumerate([([1, 5, 6], [8, 9, 2]), ([1, 7], [10, 2])]):
        for j in range(len(response)):
            dist = torch.log_softmax(logits[row, len(prompt) - 1 + j], dim=-1)
            expected.append(float(-(dist.exp() * dist).sum()))
    close(entropy, t(*expected), tol=1e-9)
    assert seq.tolist() == [0, 0, 0, 1, 1]


def test_every_new_entry_is_registered_in_its_family():
    assert {"orpo", "cpo"} <= {n for n, a in ALGORITHMS.items() if a.data == "pairs"}
    assert {"cispo", "sapo", "gdpo", "sppo"} <= {n for n, a in ALGORITHMS.items() if a.data == "groups"}
