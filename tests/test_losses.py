"""Pairwise losses against numbers worked by hand (the arithmetic is in each docstring) and against the peers'
formulas written out independently. Tolerances are real: 1e-6 absolute on float64 unless stated."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlhf_pipeline.algorithms import ALGORITHMS, PAIRS, compute_pair_loss, names
from rlhf_pipeline.losses import (
    PairLossParams,
    cpo_loss,
    dpo_loss,
    dpo_norm_loss,
    ipo_loss,
    orpo_loss,
    rebel_loss,
    simpo_loss,
)


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def close(actual: torch.Tensor, expected, abs_tol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, rtol=0.0, atol=abs_tol), (actual, expected)


# ---------------------------------------------------------------------------------------------------- REBEL


def test_rebel_loss_hand_values():
    """eta = 0.5.
    Row 0: πc=−1, refc=−1.5 → 0.5; πr=−2, refr=−1.8 → −0.2; Δ = 0.7; Δ/eta = 1.4; rc−rr = 1−0 = 1;
           (1.4 − 1)² = 0.4² = 0.16.
    Row 1: πc=−3, refc=−3 → 0; πr=−1, refr=−2 → 1; Δ = −1; Δ/eta = −2; rc−rr = 0.5−1.5 = −1;
           (−2 − (−1))² = 1.0.
    """
    loss = rebel_loss(t(-1.0, -3.0), t(-2.0, -1.0), t(-1.5, -3.0), t(-1.8, -2.0), t(1.0, 0.5), t(0.0, 1.5), eta=0.5)
    close(loss, [0.16, 1.0])


def test_rebel_repo_form_is_eta_squared_times_paper_form():
    """REBEL's repo minimises (Δ − eta·Δr)². Same rows, eta = 0.5:
    Row 0: (0.7 − 0.5·1)² = 0.2² = 0.04 = 0.25·0.16.   Row 1: (−1 − 0.5·(−1))² = 0.5² = 0.25 = 0.25·1.0.
    """
    pc, pr, rc, rr, wc, wr, eta = t(-1.0, -3.0), t(-2.0, -1.0), t(-1.5, -3.0), t(-1.8, -2.0), t(1.0, 0.5), t(0.0, 1.5), 0.5
    repo = ((pc - rc) - (pr - rr) - eta * (wc - wr)) ** 2
    close(repo, [0.04, 0.25])
    close(repo, eta**2 * rebel_loss(pc, pr, rc, rr, wc, wr, eta))


def test_rebel_loss_zero_when_scaled_gap_matches_reward_gap():
    """eta = 2, Δ = (0 − (−1)) − (0 − 0) = 1 → Δ/eta = 0.5 = rc − rr = 0.75 − 0.25 → loss 0."""
    close(rebel_loss(t(0.0), t(0.0), t(-1.0), t(0.0), t(0.75), t(0.25), eta=2.0), [0.0])


# ---------------------------------------------------------------------------------------------------- DPO / cDPO


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_dpo_at_zero_margin_is_ln2(beta):
    """Δ = 0 → −logσ(0) = −log(1/2) = ln 2 = 0.693147..., whatever β."""
    close(dpo_loss(t(-3.0), t(-5.0), t(-3.0), t(-5.0), beta=beta), [math.log(2.0)])


def test_dpo_hand_value():
    """β = 0.1; πc=−1, refc=−2 → 1; πr=−3, refr=−2 → −1; Δ = 2; βΔ = 0.2.
    −logσ(0.2) = ln(1 + e^{−0.2}) = ln(1 + 0.818730753) = ln(1.818730753) = 0.598138869.
    """
    loss = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1)
    close(loss, [math.log(1.0 + math.exp(-0.2))])
    close(loss, [0.598138869])


def test_cdpo_hand_value():
    """β = 0.1, Δ = 2 (as above), ε = 0.1; z = βΔ = 0.2.
    −0.9·logσ(0.2) − 0.1·logσ(−0.2) = 0.9·ln(1+e^{−0.2}) + 0.1·ln(1+e^{0.2})
      = 0.9·0.598138869 + 0.1·0.798138869 = 0.538324982 + 0.079813887 = 0.618138869.
    (ln(1+e^{z}) − ln(1+e^{−z}) = z, so cDPO = DPO + ε·z = 0.598138869 + 0.02.)
    """
    loss = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1, label_smoothing=0.1)
    close(loss, [0.9 * math.log(1 + math.exp(-0.2)) + 0.1 * math.log(1 + math.exp(0.2))])
    close(loss, [0.618138869])


def test_cdpo_with_zero_smoothing_is_dpo():
    torch.manual_seed(0)
    pc, pr, rc, rr = (torch.randn(16, dtype=torch.float64) * 5 for _ in range(4))
    close(dpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.0), dpo_loss(pc, pr, rc, rr, beta=0.3), 0.0)


@pytest.mark.parametrize("eps", [0.5, 0.7, -0.1])
def test_dpo_rejects_label_smoothing_outside_range(eps):
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(t(0.0), t(0.0), t(0.0), t(0.0), beta=0.1, label_smoothing=eps)


def test_dpo_is_finite_for_huge_margins():
    """β = 0.1, Δ = −1e4 → z = −1000; −logσ(−1000) = ln(1 + e^{1000}) = 1000 (+ e^{−1000}). A naive
    log(sigmoid(z)) would give inf. At Δ = +1e4 the loss is ln(1 + e^{−1000}) = 0."""
    close(dpo_loss(t(-1e4, 1e4), t(0.0, 0.0), t(0.0, 0.0), t(0.0, 0.0), beta=0.1), [1000.0, 0.0])


def test_swapping_chosen_and_rejected_raises_dpo_loss_when_margin_positive():
    """Δ = 2 > 0 → loss ln(1+e^{−0.2}) = 0.598; swapped, Δ = −2 → ln(1+e^{0.2}) = 0.798."""
    right = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1)
    swapped = dpo_loss(t(-3.0), t(-1.0), t(-2.0), t(-2.0), beta=0.1)
    assert swapped.item() > right.item()
    close(swapped - right, [0.2])


# ---------------------------------------------------------------------------------------------------- IPO / SimPO


def test_ipo_hand_value():
    """β = 0.5 → 1/(2β) = 1. πc=−2, refc=−3 → 1; πr=−4, refr=−3.5 → −0.5; Δ = 1.5; (1.5 − 1)² = 0.25.
    Second row at Δ = 1/(2β) = 1 exactly (πc=0, refc=−1, πr=refr=−2): loss 0."""
    close(ipo_loss(t(-2.0, 0.0), t(-4.0, -2.0), t(-3.0, -1.0), t(-3.5, -2.0), beta=0.5), [0.25, 0.0])


def test_dpo_norm_hand_value_and_open_instructs_formula():
    """β = 5; logπc = −4, ref −6 over 4 tokens → +0.5 a token; logπr = −9, ref −7.5 over 3 tokens → −0.5 a token;
    −logσ(5·1.0) = ln(1 + e^−5) = 0.006715348. open-instruct's dpo_norm (``dpo_utils.dpo_loss`` on the mean token
    log-probs of policy and reference, ``average_log_prob=True``), written here independently."""
    loss = dpo_norm_loss(t(-4.0), t(-9.0), t(-6.0), t(-7.5), t(4.0), t(3.0), beta=5.0)
    close(loss, [0.006715348], 1e-9)
    g = torch.Generator().manual_seed(3)
    lc, lr = (torch.randint(1, 50, (32,), generator=g).double() for _ in range(2))
    pc, pr, rc, rr = (-torch.rand(32, generator=g, dtype=torch.float64) * 2 * n for n in (lc, lr, lc, lr))
    logits = (pc / lc - pr / lr) - (rc / lc - rr / lr)
    close(dpo_norm_loss(pc, pr, rc, rr, lc, lr, beta=5.0), -torch.nn.functional.logsigmoid(5.0 * logits))


def test_simpo_hand_value():
    """β = 2, γ = 0.5; logπc = −4 over 4 tokens → −1; logπr = −9 over 3 tokens → −3.
    2·(−1) − 2·(−3) − 0.5 = −2 + 6 − 0.5 = 3.5; −logσ(3.5) = ln(1 + e^{−3.5}) = ln(1.030197383) = 0.029750418."""
    loss = simpo_loss(t(-4.0), t(-9.0), torch.tensor([4]), torch.tensor([3]), beta=2.0, gamma=0.5)
    close(loss, [math.log(1.0 + math.exp(-3.5))])
    close(loss, [0.029750418])


# ---------------------------------------------------------------------------------------------------- peers


def test_matches_peer_formulas_on_random_tensors():
    """TRL sigmoid: −logσ(β·((πc−πr) − (refc−refr))); OpenRLHF DPOLoss: −logσ(βΔ)(1−ε) − logσ(−βΔ)ε;
    OpenRLHF IPO: (Δ − 1/(2β))². Written here independently, grouping Δ as the peers do."""
    torch.manual_seed(1234)
    pc, pr, rc, rr = (torch.randn(64, dtype=torch.float64) * 20 - 50 for _ in range(4))
    beta, eps = 0.1, 0.2
    logits = (pc - pr) - (rc - rr)
    trl_sigmoid = -F.logsigmoid(beta * logits)
    openrlhf_cdpo = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    openrlhf_ipo = (logits - 1 / (2 * beta)) ** 2
    close(dpo_loss(pc, pr, rc, rr, beta=beta), trl_sigmoid)
    close(dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps), openrlhf_cdpo)
    close(ipo_loss(pc, pr, rc, rr, beta=beta), openrlhf_ipo, 1e-6)
    # TRL's "robust" uses ε differently; it is not cDPO (documented in dpo_loss).
    trl_robust = (-(1 - eps) * F.logsigmoid(beta * logits) + eps * F.logsigmoid(-beta * logits)) / (1 - 2 * eps)
    assert not torch.allclose(trl_robust, openrlhf_cdpo, atol=1e-3)


# ---------------------------------------------------------------------------------------------------- properties


def _inputs(requires_grad: bool):
    """Two pairs of float64 inputs, every tensor a leaf so .grad can be inspected."""
    vals = dict(policy_chosen_logps=t(-1.0, -3.0), policy_rejected_logps=t(-2.0, -1.0),
                ref_chosen_logps=t(-1.5, -3.0), ref_rejected_logps=t(-1.8, -2.0),
                chosen_rewards=t(1.0, 0.5), rejected_rewards=t(0.0, 1.5),
                chosen_lengths=t(4.0, 2.0), rejected_lengths=t(3.0, 5.0))
    return {k: v.requires_grad_(requires_grad) for k, v in vals.items()}


ALL_PARAMS = PairLossParams(eta=0.5, beta=0.1, label_smoothing=0.1, gamma=0.5)


def _params_for(lt: str) -> PairLossParams:
    return ALL_PARAMS if lt == "cdpo" else PairLossParams(eta=0.5, beta=0.1, gamma=0.5)


@pytest.mark.parametrize("lt", list(names(PAIRS)))
def test_gradients_reach_policy_logps_only(lt):
    x = _inputs(requires_grad=True)
    loss, _ = compute_pair_loss(lt, _params_for(lt), **x)
    loss.sum().backward()
    for name in ("policy_chosen_logps", "policy_rejected_logps"):
        assert x[name].grad is not None and x[name].grad.abs().sum() > 0, name
    for name, v in x.items():
        if not name.startswith("policy_"):
            assert v.grad is None or torch.all(v.grad == 0), name


@pytest.mark.parametrize("lt", list(names(PAIRS)))
def test_metrics_detached_per_example_and_dtype_kept(lt):
    loss, metrics = compute_pair_loss(lt, _params_for(lt), **_inputs(requires_grad=True))
    assert loss.shape == (2,) and loss.dtype == torch.float64 and loss.requires_grad
    assert set(metrics) == {"margin", "accuracy", "chosen_logratio", "rejected_logratio"}
    for name, m in metrics.items():
        assert m.shape == (2,) and m.dtype == torch.float64 and not m.requires_grad, name


@pytest.mark.parametrize("lt", list(names(PAIRS)))
def test_accuracy_counts_no_win_within_float_noise(lt):
    """Regression: at step 1 the policy (a packed forward) and the reference (padded) differ by float noise, and DPO
    logged reward/train_accuracy 1.0 for margins of +2e-6. Pair 0: chosen 2e-5 nats above its reference (a tie
    within ACCURACY_TOLERANCE = 1e-4): no win. Pair 1: chosen 0.5 nats above, rejected 0.5 below: a win."""
    from rlhf_pipeline.algorithms.pairs import ACCURACY_TOLERANCE

    assert ACCURACY_TOLERANCE == 1e-4
    x = dict(policy_chosen_logps=t(-2.0 + 2e-5, -1.5), policy_rejected_logps=t(-3.0, -3.5),
             ref_chosen_logps=t(-2.0, -2.0), ref_rejected_logps=t(-3.0, -3.0),
             chosen_rewards=t(1.0, 1.0), rejected_rewards=t(0.0, 0.0),
             chosen_lengths=t(4.0, 4.0), rejected_lengths=t(4.0, 4.0))
    if not ALGORITHMS[lt].needs_reference:  # reference-free: the same gaps on the policy's log-probs alone
        # SimPO and ORPO compare mean token log-probs (/|y| = 4: a 5e-5 gap, then a 0.5 one); CPO sequence sums
        x["policy_chosen_logps"] = t(-2.0 + (5e-5 if lt == "cpo" else 2e-4), -1.5)
        x["policy_rejected_logps"] = t(-2.0, -3.5)
    _, metrics = compute_pair_loss(lt, _params_for(lt), **x)
    assert metrics["accuracy"].tolist() == [0.0, 1.0], lt
    assert metrics["margin"][0] > 0  # the margin itself is still reported as it is


def test_pair_algorithm_properties():
    pairs = [ALGORITHMS[n] for n in names(PAIRS)]
    assert {"rebel", "dpo", "cdpo", "ipo", "simpo"} <= {a.name for a in pairs}
    assert {a.name for a in pairs if not a.needs_reference} == {"simpo", "orpo", "cpo"}
    assert {a.name for a in pairs if a.uses_rewards} == {"rebel"}
    assert {a.name for a in pairs if a.length_normalized} == {"dpo_norm", "simpo", "orpo", "cpo"}
    assert {a.name for a in pairs if a.sft_term} == {"orpo", "cpo"}
    assert {a.name for a in pairs if a.logp_at_sampling_temperature} == {"rebel"}


def test_dispatch_matches_direct_functions_and_margins():
    """Inputs from _inputs: chosen log-ratios [0.5, 0], rejected [−0.2, 1] → Δ = [0.7, −1].
    REBEL eta=0.5: margin Δ/eta = [1.4, −2]; loss [0.16, 1.0] (test_rebel_loss_hand_values).
    DPO/cDPO/IPO β=0.1: margin βΔ = [0.07, −0.1].
    dpo_norm β=0.1: log-ratios over lengths [4, 2] and [3, 5]: c = [0.125, 0], r = [−0.0667, 0.2]; margin
    0.1·[0.191667, −0.2].
    SimPO β=0.1: c = [−1/4, −3/2] = [−0.25, −1.5], r = [−2/3, −1/5]; margin = 0.1·[0.416667, −1.3] = [0.0416667, −0.13].
    accuracy = [1, 0] for all.
    """
    x = _inputs(requires_grad=False)
    pc, pr, rc, rr = (x[k] for k in ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps",
                                     "ref_rejected_logps"))
    direct = {
        "rebel": rebel_loss(pc, pr, rc, rr, x["chosen_rewards"], x["rejected_rewards"], eta=0.5),
        "dpo": dpo_loss(pc, pr, rc, rr, beta=0.1),
        "cdpo": dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1),
        "ipo": ipo_loss(pc, pr, rc, rr, beta=0.1),
        "dpo_norm": dpo_norm_loss(pc, pr, rc, rr, x["chosen_lengths"], x["rejected_lengths"], beta=0.1),
        "simpo": simpo_loss(pc, pr, x["chosen_lengths"], x["rejected_lengths"], beta=0.1, gamma=0.5),
        "orpo": orpo_loss(pc, pr, x["chosen_lengths"], x["rejected_lengths"], beta=0.1),
        "cpo": cpo_loss(pc, pr, x["chosen_lengths"], beta=0.1),
    }
    margins = {"rebel": [1.4, -2.0], "dpo": [0.07, -0.1], "cdpo": [0.07, -0.1],
               "ipo": [0.07, -0.1], "dpo_norm": [0.1 * (0.5 / 4 + 0.2 / 3), 0.1 * (0.0 - 1.0 / 5)],
               "simpo": [0.1 * (-0.25 + 2 / 3), 0.1 * (-1.5 + 0.2)],
               "orpo": [0.1 * (-0.25 + 2 / 3), 0.1 * (-1.5 + 0.2)], "cpo": [0.1, -0.2]}
    for lt in names(PAIRS):
        loss, metrics = compute_pair_loss(lt, _params_for(lt), **x)
        close(loss, direct[lt], 0.0)
        close(metrics["margin"], margins[lt])
        close(metrics["accuracy"], [1.0, 0.0], 0.0)
    close(direct["rebel"], [0.16, 1.0])
    _, simpo_metrics = compute_pair_loss("simpo", _params_for("simpo"), **x)
    close(simpo_metrics["chosen_logratio"], [-0.25, -1.5])
    close(simpo_metrics["rejected_logratio"], [-2 / 3, -0.2])
    _, dpo_metrics = compute_pair_loss("dpo", _params_for("dpo"), **x)
    close(dpo_metrics["chosen_logratio"], [0.5, 0.0])
    close(dpo_metrics["rejected_logratio"], [-0.2, 1.0])


@pytest.mark.parametrize("lt, drop", [
    ("rebel", "chosen_rewards"), ("rebel", "ref_rejected_logps"), ("dpo", "ref_chosen_logps"),
    ("cdpo", "ref_rejected_logps"), ("ipo", "ref_chosen_logps"), ("simpo", "rejected_lengths"),
])
def test_missing_input_raises(lt, drop):
    x = _inputs(requires_grad=False)
    x[drop] = None
    with pytest.raises(ValueError, match=drop):
        compute_pair_loss(lt, _params_for(lt), **x)


def test_simpo_needs_no_reference():
    x = _inputs(requires_grad=False)
    x.update(ref_chosen_logps=None, ref_rejected_logps=None, chosen_rewards=None, rejected_rewards=None)
    loss, _ = compute_pair_loss("simpo", _params_for("simpo"), **x)
    assert loss.shape == (2,)


def test_cdpo_with_zero_label_smoothing_raises():
    with pytest.raises(ValueError, match=r"label_smoothing > 0 \(e\.g\. 0\.1\)"):
        compute_pair_loss("cdpo", PairLossParams(label_smoothing=0.0), **_inputs(requires_grad=False))


def test_dpo_with_label_smoothing_raises_rather_than_silently_ignoring_it():
    with pytest.raises(ValueError, match="cdpo"):
        compute_pair_loss("dpo", PairLossParams(label_smoothing=0.1), **_inputs(requires_grad=False))


def test_token_level_input_is_rejected():
    x = _inputs(requires_grad=False)
    x["ref_chosen_logps"] = torch.zeros(2, 7, dtype=torch.float64)
    with pytest.raises(ValueError, match="ref_chosen_logps has shape"):
        compute_pair_loss("dpo", PairLossParams(), **x)


def test_import_pulls_in_torch_only():
    code = ("import sys, rlhf_pipeline.losses; "
            "print(','.join(m for m in ('transformers', 'datasets', 'deepspeed', 'vllm', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# ==================================================================================================== PPO family
# Per-token losses and KL estimators. Peer formulas are written out here (TRL is a bench-only dependency and
# OpenRLHF is not installed; neither is imported).

from rlhf_pipeline.losses import (  # noqa: E402
    KL_ESTIMATORS,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    ppo_policy_loss,
    value_loss,
)

NAN = float("nan")


def _ppo_hand_inputs():
    """ε = 0.2, old_logp = 0, logp = log ρ. Row 0 = tokens a, b, c; row 1 = d, e, pad (pad holds NaN).
    a: A=+1, ρ=1.5: −Aρ = −1.5, −A·clip = −1.2 → max −1.2   clipped (ρ above range, A > 0): gradient 0
    b: A=+1, ρ=0.5: −0.5 vs −0.8                  → −0.5   unclipped (below range but A > 0: the min keeps ρ)
    c: A=−1, ρ=0.5:  0.5 vs  0.8                  →  0.8   clipped (ρ below range, A < 0): gradient 0
    d: A=−1, ρ=1.5:  1.5 vs  1.2                  →  1.5   unclipped (above range but A < 0)
    e: A=+2, ρ=1.1: −2.2 vs −2.2                  → −2.2   inside the range
    """
    rho = t(1.5, 0.5, 0.5, 1.5, 1.1, 1.0).view(2, 3)
    logp = torch.log(rho)
    logp[1, 2] = NAN
    old = torch.zeros(2, 3, dtype=torch.float64)
    old[1, 2] = NAN
    adv = t(1.0, 1.0, -1.0, -1.0, 2.0, NAN).view(2, 3)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logp.requires_grad_(True), old, adv, mask


def test_ppo_policy_loss_hand_values_token_mean():
    """Token mean over the 5 real tokens: (−1.2 − 0.5 + 0.8 + 1.5 − 2.2)/5 = −1.6/5 = −0.32.
    Gradient per token = −Aρ/5 where unclipped, 0 where clipped: a 0; b −0.5/5 = −0.1; c 0; d 1.5/5 = 0.3;
    e −2.2/5 = −0.44; pad 0.
    clip_frac = 2/5 = 0.4 (a, c).  ratio_mean = (1.5 + 0.5 + 0.5 + 1.5 + 1.1)/5 = 5.1/5 = 1.02.
    approx_kl = mean of ρ − 1 − log ρ: 1.5 → 0.5 − 0.4054651 = 0.0945349; 0.5 → −0.5 + 0.6931472 = 0.1931472;
    1.1 → 0.1 − 0.0953102 = 0.0046898; (2·0.0945349 + 2·0.1931472 + 0.0046898)/5 = 0.5800539/5 = 0.1160108."""
    logp, old, adv, mask = _ppo_hand_inputs()
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, clip=0.2)
    close(loss, -0.32)
    loss.backward()
    close(logp.grad, [[0.0, -0.1, 0.0], [0.3, -0.44, 0.0]])
    close(metrics["clip_frac"], 0.4)
    close(metrics["ratio_mean"], 1.02)
    close(metrics["approx_kl"], 0.1160108)
    for name, value in metrics.items():
        assert value.shape == () and not value.requires_grad and value.dtype == torch.float64, name


def test_ppo_policy_loss_hand_values_sequence_mean():
    """Row 0: (−1.2 − 0.5 + 0.8)/3 = −0.3; row 1: (1.5 − 2.2)/2 = −0.35; mean (−0.3 − 0.35)/2 = −0.325.
    Gradient weight per token 1/(2·len): b −0.5/6 = −0.0833333; d 1.5/4 = 0.375; e −2.2/4 = −0.55.
    Metrics stay token means (same as above)."""
    logp, old, adv, mask = _ppo_hand_inputs()
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, clip=0.2, reduction="sequence")
    close(loss, -0.325)
    loss.backward()
    close(logp.grad, [[0.0, -0.5 / 6, 0.0], [0.375, -0.55, 0.0]])
    close(metrics["clip_frac"], 0.4)


def test_ppo_policy_loss_flat_tokens_equal_padded():
    logp, old, adv, mask = _ppo_hand_inputs()
    flat, _ = ppo_policy_loss(logp.detach().reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1).long(),
                              clip=0.2)
    close(flat, -0.32)
    with pytest.raises(ValueError, match="reduction='sequence' needs"):
        ppo_policy_loss(logp.detach().reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1), clip=0.2,
                        reduction="sequence")


@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("rho", [0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0])
def test_ppo_clip_zeroes_gradient_exactly_where_clipped(rho, advantage):
    """ε = 0.2. Clipped (gradient 0, clip_frac 1) iff A > 0 and ρ > 1.2, or A < 0 and ρ < 0.8; otherwise the
    gradient is −A·ρ (one token, so the mean divides by 1)."""
    logp = torch.tensor([math.log(rho)], dtype=torch.float64, requires_grad=True)
    loss, metrics = ppo_policy_loss(logp, t(0.0), t(advantage), torch.tensor([True]), clip=0.2)
    loss.backward()
    clipped = (advantage > 0 and rho > 1.2) or (advantage < 0 and rho < 0.8)
    close(logp.grad, [0.0 if clipped else -advantage * rho])
    close(metrics["clip_frac"], 1.0 if clipped else 0.0)
    close(loss, max(-advantage * rho, -advantage * min(max(rho, 0.8), 1.2)))


def test_ppo_on_policy_gradient_is_minus_advantage_over_token_count():
    """First PPO epoch: logp == old_logp → ρ = 1, nothing clipped, ∂loss/∂logp = −A/N on real tokens."""
    gen = torch.Generator().manual_seed(10)
    logp = torch.randn(4, 6, generator=gen, dtype=torch.float64) - 2
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=gen) < 0.7
    logp.requires_grad_(True)
    loss, metrics = ppo_policy_loss(logp, logp.detach().clone(), adv, mask, clip=0.2)
    loss.backward()
    close(logp.grad, torch.where(mask, -adv / mask.sum(), 0))
    close(metrics["clip_frac"], 0.0)
    close(metrics["approx_kl"], 0.0)
    close(metrics["ratio_mean"], 1.0)


def test_ppo_policy_loss_matches_peers_on_random_tensors():
    """TRL GRPO (trl/trainer/grpo_trainer.py 1.16, ``_compute_loss``): coef_1 = exp(logp − old), coef_2 =
    clamp(coef_1, 1 − ε, 1 + ε), per_token_loss = −min(coef_1·A, coef_2·A); ``bnpo``: Σ(loss·mask)/Σmask
    (clamp 1); ``grpo``: mean over rows of Σ_t(loss·mask)/Σ_t mask (clamp 1). Clip region: (coef_1 < 1 − ε & A < 0)
    | (coef_1 > 1 + ε & A > 0). OpenRLHF ``PolicyLoss``: clip_ratio = masked_mean(surr2 < surr1)."""
    gen = torch.Generator().manual_seed(11)
    b, n, eps = 6, 9, 0.2
    old = torch.randn(b, n, generator=gen, dtype=torch.float64) - 3
    logp = old + 0.4 * torch.randn(b, n, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, n, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, n + 1, (b,), generator=gen)  # no empty rows: TRL would count them as 0-loss rows
    mask = torch.arange(n)[None, :] < lengths[:, None]
    fm = mask.double()
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    bnpo = (per_token * fm).sum() / fm.sum().clamp(min=1.0)
    grpo = ((per_token * fm).sum(-1) / fm.sum(-1).clamp(min=1.0)).mean()
    region = ((coef_1 < 1 - eps) & (adv < 0)) | ((coef_1 > 1 + eps) & (adv > 0))
    surr1, surr2 = coef_1 * adv, coef_2 * adv
    loss_token, metrics = ppo_policy_loss(logp, old, adv, mask, clip=eps)
    loss_seq, _ = ppo_policy_loss(logp, old, adv, mask, clip=eps, reduction="sequence")
    close(loss_token, bnpo)
    close(loss_seq, grpo)
    close(metrics["clip_frac"], (region.double() * fm).sum() / fm.sum())
    close(metrics["clip_frac"], ((surr2 < surr1).double() * fm).sum() / fm.sum())
    assert 0 < metrics["clip_frac"] < 1  # the data exercise both branches
    assert not torch.allclose(loss_token, loss_seq, atol=1e-3)  # ragged lengths: the two reductions differ


def test_ppo_per_sequence_advantages_broadcast_over_tokens():
    gen = torch.Generator().manual_seed(12)
    old = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    logp = old + 0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    adv = t(1.0, -0.5, 2.0)
    mask = torch.ones(3, 5, dtype=torch.bool)
    a, _ = ppo_policy_loss(logp, old, adv, mask, clip=0.2)
    b, _ = ppo_policy_loss(logp, old, adv[:, None].expand(3, 5), mask, clip=0.2)
    close(a, b, 0.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        ppo_policy_loss(logp, old, t(1.0, 2.0), mask, clip=0.2)


def test_ppo_padding_garbage_never_leaks():
    """Padding holding NaN/inf (logp, old_logp, advantages) changes nothing: same loss and finite gradients as
    with zeros there."""
    logp, old, adv, mask = _ppo_hand_inputs()
    logp2 = logp.detach().clone()
    logp2[1, 2] = float("inf")
    old2 = old.clone()
    old2[1, 2] = -float("inf")
    logp2.requires_grad_(True)
    loss, metrics = ppo_policy_loss(logp2, old2, adv, mask, clip=0.2)
    loss.backward()
    close(loss, -0.32)
    assert torch.isfinite(logp2.grad).all() and logp2.grad[1, 2] == 0
    assert all(torch.isfinite(v) for v in metrics.values())


def test_ppo_sequence_mean_counts_empty_rows_as_zero_and_empty_batch_is_zero():
    """Row 1 has no real token: it is a 0-loss row of the sequence mean, as in TRL's ``grpo`` (rows of
    Σ_t(loss·mask)/Σ_t mask with the count clamped to 1, then the mean over rows). Row 0 one token A=1, ρ=1 → −1;
    row 2 one token A=−2, ρ=1 → 2; mean (−1 + 0 + 2)/3. Dr. GRPO's sums over 2 tokens: (−1 + 0 + 2)/2/3."""
    logp = torch.zeros(3, 2, dtype=torch.float64)
    adv = t([1.0, 0.0], [5.0, 5.0], [-2.0, 0.0])
    mask = torch.tensor([[True, False], [False, False], [True, False]])
    close(ppo_policy_loss(logp, logp, adv, mask, clip=0.2, reduction="sequence")[0], 1 / 3)
    close(ppo_policy_loss(logp, logp, adv, mask, clip=0.2, reduction="sequence_sum_norm", max_tokens=2)[0], 1 / 6)
    empty = torch.zeros(3, 2, dtype=torch.bool)
    for reduction in ("token", "sequence"):
        loss, metrics = ppo_policy_loss(logp, logp, adv, empty, clip=0.2, reduction=reduction)
        close(loss, 0.0)
        close(metrics["clip_frac"], 0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip=0.0), "clip must be > 0"), (dict(clip=0.2, reduction="batch"), "reduction must be one of"),
])
def test_ppo_policy_loss_rejects_bad_arguments(kwargs, match):
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        ppo_policy_loss(x, x, x, torch.ones(2, 3, dtype=torch.bool), **kwargs)


def test_ppo_policy_loss_rejects_mismatched_shapes():
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="old_logp has shape"):
        ppo_policy_loss(x, torch.zeros(2, 4), x, torch.ones(2, 3, dtype=torch.bool), clip=0.2)
    with pytest.raises(ValueError, match="mask has shape"):
        ppo_policy_loss(x, x, x, torch.ones(3, 2, dtype=torch.bool), clip=0.2)


# ---------------------------------------------------------------------------------------------------- value loss


def _value_hand_inputs():
    """ε = 0.2; token 3 is padding (NaN).
    tok 0: V=1.0, V_old=0.5, R=0.8: (V−R)² = 0.2² = 0.04; clip(V) = 0.5 + 0.2 = 0.7, (0.7−0.8)² = 0.01 → 0.04
    tok 1: V=1.0, V_old=0.5, R=1.5: (V−R)² = 0.25;        clip(V) = 0.7, (0.7−1.5)² = 0.64          → 0.64 clipped
    tok 2: V=0.0, V_old=0.1, R=0.0: 0;                     clip(V) = 0.1 − 0.1 = 0.0 (inside), 0      → 0
    """
    values = t(1.0, 1.0, 0.0, NAN).requires_grad_(True)
    return values, t(0.5, 0.5, 0.1, NAN), t(0.8, 1.5, 0.0, NAN), torch.tensor([1, 1, 1, 0])


def test_value_loss_clipped_hand_values():
    """0.5·(0.04 + 0.64 + 0)/3 = 0.5·0.2266667 = 0.1133333. clip_frac 1/3.
    Gradient 0.5·2·(V−R)/3 where unclipped: tok 0 0.2/3 = 0.0666667; tok 1 clipped → 0; tok 2 0; pad 0."""
    values, old, ret, mask = _value_hand_inputs()
    loss, metrics = value_loss(values, old, ret, mask, clip=0.2)
    close(loss, 0.68 / 6)
    loss.backward()
    close(values.grad, [0.2 / 3, 0.0, 0.0, 0.0])
    close(metrics["clip_frac"], 1 / 3)


def test_value_loss_unclipped_hand_values():
    """clip=None: 0.5·(0.04 + 0.25 + 0)/3 = 0.5·0.0966667 = 0.0483333; gradient (V−R)/3: [0.0666667, −0.1666667, 0]."""
    values, old, ret, mask = _value_hand_inputs()
    loss, metrics = value_loss(values, old, ret, mask)
    close(loss, 0.29 / 6)
    loss.backward()
    close(values.grad, [0.2 / 3, -0.5 / 3, 0.0, 0.0])
    close(metrics["clip_frac"], 0.0)


def test_value_loss_matches_peers_on_random_tensors():
    """OpenRLHF ``ValueLoss``: clipped = old + (V − old).clamp(−ε, ε); 0.5·masked_mean(max((clipped−R)², (V−R)²)).
    TRL PPO (trl/experimental/ppo/ppo_trainer.py): vpredclipped = clamp(V, old − ε, old + ε);
    0.5·masked_mean(max((V−R)², (vpredclipped−R)²)); vf_clipfrac = masked_mean((vpredclipped−R)² > (V−R)²)."""
    gen = torch.Generator().manual_seed(13)
    old = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    values = old + 0.5 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    ret = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=gen) < 0.8
    mask[3] = False  # an empty response: a 0-loss row of the sequence mean, as the policy losses count it
    fm, eps = mask.double(), 0.2
    openrlhf = 0.5 * (torch.max((old + (values - old).clamp(-eps, eps) - ret) ** 2, (values - ret) ** 2) * fm).sum() \
        / fm.sum()
    vclip = torch.clamp(values, old - eps, old + eps)
    l1, l2 = (values - ret) ** 2, (vclip - ret) ** 2
    trl = 0.5 * (torch.max(l1, l2) * fm).sum() / fm.sum()
    loss, metrics = value_loss(values, old, ret, mask, clip=eps)
    close(loss, openrlhf)
    close(loss, trl)
    close(metrics["clip_frac"], ((l2 > l1).double() * fm).sum() / fm.sum())
    assert 0 < metrics["clip_frac"] < 1
    unclipped, _ = value_loss(values, old, ret, mask)
    close(unclipped, 0.5 * (l1 * fm).sum() / fm.sum())
    seq, _ = value_loss(values, old, ret, mask, clip=eps, reduction="sequence")
    per_row = (torch.max(l1, l2) * fm).sum(-1) / fm.sum(-1).clamp(min=1)  # 0 for the empty row
    close(seq, 0.5 * per_row.sum() / 5)


def test_value_loss_gradient_reaches_values_only():
    values, old, ret, mask = _value_hand_inputs()
    old.requires_grad_(True)
    ret.requires_grad_(True)
    loss, _ = value_loss(values, old, ret, mask, clip=0.2)
    loss.backward()
    assert old.grad is None and ret.grad is None and torch.isfinite(values.grad).all()


def test_value_loss_rejects_bad_clip_and_shapes():
    x = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="clip must be > 0"):
        value_loss(x, x, x, torch.ones(4, dtype=torch.bool), clip=-0.1)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(x, x, torch.zeros(5), torch.ones(4, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    """log_ratio = logp − ref = [0.5, −0.5, 0]:
    k1 = [0.5, −0.5, 0];  k2 = lr²/2 = [0.125, 0.125, 0];
    k3 = e^{−lr} − 1 + lr = [e^{−0.5} − 0.5, e^{0.5} − 1.5, 0] = [0.6065307 − 0.5, 1.6487213 − 1.5, 0]
       = [0.1065307, 0.1487213, 0]."""
    logp, ref = t(-1.0, -2.0, -3.0), t(-1.5, -1.5, -3.0)
    close(kl_k1(logp, ref), [0.5, -0.5, 0.0])
    close(kl_k2(logp, ref), [0.125, 0.125, 0.0])
    close(kl_k3(logp, ref), [0.1065307, 0.1487213, 0.0])
    for kind, fn in KL_ESTIMATORS.items():
        close(kl_estimate(logp, ref, kind=kind), fn(logp, ref), 0.0)
    close(kl_estimate(logp, ref), kl_k1(logp, ref), 0.0)  # default k1


def test_kl_k2_k3_nonnegative_even_for_tiny_ratios():
    """k3 is computed as expm1(−lr) + lr: the naive exp(−lr) − 1 + lr cancels catastrophically and goes negative
    for |lr| ≲ 1e−9 (float64) or 1e−4 (float32). For small lr, k3 = lr²/2 − lr³/6 + ... ≈ k2."""
    gen = torch.Generator().manual_seed(14)
    for dtype, tiny in ((torch.float64, [1e-9, -1e-9, 1e-10, 3e-10, -3e-10, 1e-12, 0.0]),
                        (torch.float32, [1e-4, 3e-5, -3e-5, 1e-6, -1e-7, 0.0])):
        lr = torch.cat([torch.tensor(tiny, dtype=dtype), 10 * torch.randn(1000, generator=gen).to(dtype)])
        assert (kl_k3(lr, torch.zeros_like(lr)) >= 0).all(), dtype
        assert (kl_k2(lr, torch.zeros_like(lr)) >= 0).all(), dtype
        naive = torch.exp(-lr) - 1 + lr
        assert (naive < 0).any(), "the naive form no longer cancels; the expm1 rationale is stale"
    lr = torch.tensor([1e-4, -1e-4, 1e-6, 1e-9], dtype=torch.float64)
    assert torch.allclose(kl_k3(lr, torch.zeros_like(lr)), lr**2 / 2, rtol=1e-4, atol=0.0)


def _categorical(seed: int, size: int = 6):
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(size, generator=gen, dtype=torch.float64)
    ref = torch.log_softmax(torch.randn(size, generator=gen, dtype=torch.float64), -1)
    return theta, ref


def test_kl_expectations_exact_on_a_categorical():
    """Over the whole support, E_π[k] = Σ_x π(x)·k(x): k1 and k3 equal KL(π‖ref) exactly (unbiased); k2 does not."""
    theta, ref = _categorical(15)
    logp = torch.log_softmax(theta, -1)
    pi = logp.exp()
    kl = (pi * (logp - ref)).sum()
    close((pi * kl_k1(logp, ref)).sum(), kl)
    close((pi * kl_k3(logp, ref)).sum(), kl)
    assert abs((pi * kl_k2(logp, ref)).sum() - kl) > 1e-3


def test_kl_sample_means_are_unbiased():
    """200,000 tokens drawn from π: the sample means of k1 and k3 lie within 4 standard errors of KL(π‖ref)."""
    theta, ref = _categorical(16)
    logp = torch.log_softmax(theta, -1)
    kl = (logp.exp() * (logp - ref)).sum()
    idx = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=torch.Generator().manual_seed(17))
    for fn in (kl_k1, kl_k3):
        k = fn(logp[idx], ref[idx])
        stderr = k.std() / math.sqrt(k.numel())
        assert abs(k.mean() - kl) < 4 * stderr, (fn.__name__, k.mean().item(), kl.item(), stderr.item())
    # These two distributions are far apart (KL ≈ 0.9): some sampled tokens are far likelier under ref, where
    # k3 = r − 1 − log r with r = ref/π is large, so k3's variance here EXCEEDS k1's.
    assert kl_k3(logp[idx], ref[idx]).var() > kl_k1(logp[idx], ref[idx]).var()


def test_kl_k3_has_lower_variance_than_k1_for_nearby_policies():
    """Schulman's regime: π and ref close (logits differ by 0.1·noise) → same mean, k3's variance far below k1's
    (k3 ≈ lr²/2 is second order in the log-ratio, k1 first order)."""
    gen = torch.Generator().manual_seed(20)
    theta = torch.randn(6, generator=gen, dtype=torch.float64)
    logp = torch.log_softmax(theta, -1)
    ref = torch.log_softmax(theta + 0.1 * torch.randn(6, generator=gen, dtype=torch.float64), -1)
    idx = torch.multinomial(logp.exp(), 100_000, replacement=True, generator=gen)
    assert kl_k3(logp[idx], ref[idx]).var() < 0.1 * kl_k1(logp[idx], ref[idx]).var()


def test_kl_estimator_gradients_as_losses():
    """Differentiated through logp with the sampling weights π held fixed (what a per-token loss does):
    E_π[∇k1] = 0, E_π[∇k2] = ∇KL(π‖ref), E_π[∇k3] = ∇KL(ref‖π) — exact over the support."""
    theta, ref = _categorical(18)

    def expected_grad(fn):
        th = theta.clone().requires_grad_(True)
        logp = torch.log_softmax(th, -1)
        (logp.exp().detach() * fn(logp, ref)).sum().backward()
        return th.grad

    def grad_of(f):
        th = theta.clone().requires_grad_(True)
        f(torch.log_softmax(th, -1)).backward()
        return th.grad

    reverse = grad_of(lambda lp: (lp.exp() * (lp - ref)).sum())
    forward = grad_of(lambda lp: (ref.exp() * (ref - lp)).sum())
    close(expected_grad(kl_k1), torch.zeros(6))
    close(expected_grad(kl_k2), reverse)
    close(expected_grad(kl_k3), forward)
    assert not torch.allclose(reverse, forward, atol=1e-3)


def test_kl_matches_peer_formulas():
    """TRL GRPO: exp(ref − logp) − (ref − logp) − 1 (k3). TRL PPO: logr = ref − logp; k1 = −logr,
    k3 = (exp(logr) − 1) − logr. OpenRLHF ``compute_approx_kl``: k1 = lr, k2 = lr²/2, k3 = exp(−lr) − 1 + lr."""
    gen = torch.Generator().manual_seed(19)
    logp = torch.randn(4, 5, generator=gen, dtype=torch.float64) - 2
    ref = logp + 0.5 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    logr = ref - logp
    close(kl_k3(logp, ref), torch.exp(ref - logp) - (ref - logp) - 1)
    close(kl_k1(logp, ref), -logr)
    close(kl_k3(logp, ref), (logr.exp() - 1) - logr)
    lr = logp - ref
    close(kl_k2(logp, ref), lr**2 / 2.0)
    close(kl_k3(logp, ref), (-lr).exp() - 1 - (-lr))


def test_kl_reference_is_detached_and_dtype_kept():
    logp = t(-1.0, -2.0).requires_grad_(True)
    ref = t(-1.5, -1.0).requires_grad_(True)
    for kind in KL_ESTIMATORS:
        out = kl_estimate(logp, ref, kind=kind)
        assert out.dtype == torch.float64 and out.shape == (2,)
        out.sum().backward()
    assert ref.grad is None and logp.grad is not None


def test_kl_estimate_rejects_unknown_kind_and_shapes():
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_estimate(t(0.0), t(0.0), kind="k4")
    with pytest.raises(ValueError, match="ref_logp has shape"):
        kl_k3(torch.zeros(2, 3), torch.zeros(3))


# ---------------------------------------------------------------------------------------------------- KTO (unpaired)

from rlhf_pipeline.algorithms import UNPAIRED, compute_unpaired_loss  # noqa: E402
from rlhf_pipeline.losses import UnpairedLossParams, kto_loss, kto_reference_point  # noqa: E402


def _kto_hand_inputs():
    """β = 0.5. Mismatched pairs: logπθ = (−4.0, −5.0), logπref = (−4.2, −5.4) → (0.2, 0.4), mean 0.3 = z0.
    Row 0 desirable:   π = −1, ref = −1.5 → r = 0.5;  β(r − z0) = 0.5·0.2 = 0.1.
    Row 1 undesirable: π = −3, ref = −2   → r = −1;   β(z0 − r) = 0.5·1.3 = 0.65.
    Row 2 desirable:   π = −2, ref = −2   → r = 0;    β(r − z0) = 0.5·(−0.3) = −0.15.
    """
    z0 = kto_reference_point(t(-4.0, -5.0), t(-4.2, -5.4))
    return t(-1.0, -3.0, -2.0), t(-1.5, -2.0, -2.0), torch.tensor([True, False, True]), z0


def test_kto_reference_point_hand_values():
    """Mean of (0.2, 0.4) = 0.3; a negative mean, (−5 − (−4) + 0)/2 = −0.5, is clamped to 0."""
    assert kto_reference_point(t(-4.0, -5.0), t(-4.2, -5.4)).item() == pytest.approx(0.3, abs=1e-12)
    assert kto_reference_point(t(-5.0, -1.0), t(-4.0, -1.0)).item() == 0.0
    with pytest.raises(ValueError, match="non-empty"):
        kto_reference_point(t(), t())


def test_kto_loss_hand_values():
    """1 − σ(x) = 1/(1 + e^x):
    Row 0: 1/(1 + e^0.1)   = 1/(1 + 1.105170918) = 1/2.105170918 = 0.475020813.
    Row 1: 1/(1 + e^0.65)  = 1/(1 + 1.915540829) = 1/2.915540829 = 0.342989...  (0.3429895)
    Row 2: 1/(1 + e^−0.15) = 1/(1 + 0.860707976) = 1/1.860707976 = 0.537429845.
    With λ_D = 2, λ_U = 0.5: (0.950041626, 0.171494766, 1.074859690).
    """
    pol, ref, desirable, z0 = _kto_hand_inputs()
    close(kto_loss(pol, ref, desirable, z0, beta=0.5), [0.475020813, 0.342989531, 0.537429845])
    close(kto_loss(pol, ref, desirable, z0, beta=0.5, desirable_weight=2.0, undesirable_weight=0.5),
          [0.950041626, 0.171494766, 1.074859690])


def test_kto_matches_trl_formula_on_random_tensors():
    """TRL's ``KTOTrainer._compute_loss`` (trl/trainer/kto_trainer.py, commit f2cd577; before June 2026 the method
    ``KTOTrainer.kto_loss``), transcribed: chosen and rejected split by label, kl = mean over the KL pairs, clamped,
    detached; losses = cat(λ_D·(1 − σ(β(r_c − kl))), λ_U·(1 − σ(β(kl − r_r)))), loss = losses.nanmean()."""
    def trl(policy_chosen, policy_rejected, policy_kl, ref_chosen, ref_rejected, ref_kl, beta, dw, uw):
        kl = (policy_kl - ref_kl).mean().detach().clamp(min=0)
        chosen_losses = 1 - torch.sigmoid(beta * ((policy_chosen - ref_chosen) - kl))
        rejected_losses = 1 - torch.sigmoid(beta * (kl - (policy_rejected - ref_rejected)))
        return torch.cat((dw * chosen_losses, uw * rejected_losses), 0).nanmean(), kl

    g = torch.Generator().manual_seed(0)
    for beta, dw, uw, shift in [(0.1, 1.0, 1.0, 0.0), (0.5, 1.33, 1.0, 3.0), (2.0, 1.0, 0.7, -3.0)]:
        pol = -torch.rand(32, generator=g, dtype=torch.float64) * 40
        ref = pol + torch.randn(32, generator=g, dtype=torch.float64) * 2
        kl_pol = -torch.rand(32, generator=g, dtype=torch.float64) * 40
        kl_ref = kl_pol - torch.randn(32, generator=g, dtype=torch.float64) - shift  # z0 > 0, clamped, or near 0
        desirable = torch.rand(32, generator=g) < 0.4
        ours = kto_loss(pol, ref, desirable, kto_reference_point(kl_pol, kl_ref), beta, dw, uw)
        expected, kl = trl(pol[desirable], pol[~desirable], kl_pol, ref[desirable], ref[~desirable], kl_ref,
                           beta, dw, uw)
        assert ours.mean().item() == pytest.approx(expected.item(), abs=1e-12)
        assert kto_reference_point(kl_pol, kl_ref).item() == pytest.approx(kl.item(), abs=1e-12)


def test_kto_gradient_direction_and_size():
    """On-policy-ish check of the sign: minimising raises a desirable response's log-prob and lowers an undesirable
    one's; size: |∂loss/∂logπ| = λ·β·σ(x)(1 − σ(x)) at the x of each row (row 0: x = 0.1, σ = 0.524979, β·σ(1−σ) =
    0.5·0.249376 = 0.124688). Nothing reaches the reference, the mismatched pairs or z0."""
    pol, ref, desirable, _ = _kto_hand_inputs()
    pol.requires_grad_(True)
    ref.requires_grad_(True)
    kl_pol = t(-4.0, -5.0).requires_grad_(True)
    z0 = kto_reference_point(kl_pol, t(-4.2, -5.4))
    kto_loss(pol, ref, desirable, z0, beta=0.5, undesirable_weight=2.0).sum().backward()
    assert pol.grad[0] < 0 and pol.grad[2] < 0 and pol.grad[1] > 0
    x = torch.tensor([0.1, 0.65, -0.15], dtype=torch.float64)
    expected = torch.tensor([-1.0, 2.0, -1.0], dtype=torch.float64) * 0.5 * torch.sigmoid(x) * (1 - torch.sigmoid(x))
    close(pol.grad, expected, abs_tol=1e-12)
    close(pol.grad[:1], [-0.124688], abs_tol=1e-6)
    assert ref.grad is None and kl_pol.grad is None and not z0.requires_grad


def test_kto_reference_point_moves_the_classes_apart():
    """A larger z0 asks more of a desirable response (its loss rises) and less of an undesirable one (it falls)."""
    pol, ref, desirable, _ = _kto_hand_inputs()
    low, high = (kto_loss(pol, ref, desirable, torch.tensor(z, dtype=torch.float64), 0.5) for z in (0.0, 1.0))
    assert (high[desirable] > low[desirable]).all() and (high[~desirable] < low[~desirable]).all()


def test_kto_dispatch_metrics_and_bad_arguments():
    """Through the registry: the margin is β(r − z0) signed by the label (row 0: +0.1, row 1: −0.5·(−1.3) = +0.65,
    row 2: −0.15), accuracy its sign, kl the z0 each row was trained against."""
    pol, ref, desirable, z0 = _kto_hand_inputs()
    loss, metrics = compute_unpaired_loss("kto", UnpairedLossParams(beta=0.5), pol, ref, desirable, z0)
    close(loss, kto_loss(pol, ref, desirable, z0, 0.5))
    close(metrics["margin"], [0.1, 0.65, -0.15], abs_tol=1e-12)
    close(metrics["accuracy"], [1.0, 1.0, 0.0])
    close(metrics["kl"], [0.3, 0.3, 0.3], abs_tol=1e-12)
    close(metrics["logratio"], [0.5, -1.0, 0.0])
    assert names(UNPAIRED) == ("kto",) and ALGORITHMS["kto"].needs_reference
    with pytest.raises(ValueError, match="beta must be > 0"):
        kto_loss(pol, ref, desirable, z0, beta=0.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        kto_loss(pol, ref, desirable, z0, beta=0.1, undesirable_weight=-1.0)
    with pytest.raises(ValueError, match="scalar"):
        kto_loss(pol, ref, desirable, t(0.1, 0.2, 0.3), beta=0.1)
    with pytest.raises(ValueError, match="trains on pairs and has no unpaired loss"):
        compute_unpaired_loss("dpo", UnpairedLossParams(), pol, ref, desirable, z0)
    with pytest.raises(ValueError, match="trains on unpaired and has no pair loss"):
        compute_pair_loss("kto", PairLossParams(), pol, pol, ref, ref)
    with pytest.raises(ValueError, match="desirable must be 1-D"):
        compute_unpaired_loss("kto", UnpairedLossParams(), pol, ref, desirable[:2], z0)


def test_losses_reduce_with_advantages_masked_mean():
    """The PPO-family losses use advantages.masked_mean, the one masked mean (losses' own twin is gone), and it gives
    what the twin gave their bool masks, ``where(m, x, 0).sum(dim) / m.sum(dim).clamp(min=1)``, bit for bit: NaN in
    padding selected out, an all-masked row 0."""
    from rlhf_pipeline import advantages, losses

    assert losses.masked_mean is advantages.masked_mean and not hasattr(losses, "_masked_mean")
    x = torch.tensor([[1.0, 2.0, float("nan")], [float("nan"), float("nan"), float("nan")], [0.5, -3.0, 7.25]])
    m = torch.tensor([[True, True, False], [False, False, False], [True, False, True]])
    for dim in (None, -1, 0):
        twin = torch.where(m, x, 0).sum(dim=dim) / m.sum(dim=dim).clamp(min=1)
        assert torch.equal(advantages.masked_mean(x, m, dim=dim), twin), dim
    assert advantages.masked_mean(x, m, dim=-1).tolist() == [1.5, 0.0, 3.875]
