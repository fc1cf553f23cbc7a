"""Pairwise losses against numbers worked by hand (the arithmetic is in each docstring) and against the peers'
formulas written out independently. Tolerances are real: 1e-6 absolute on float64 unless stated."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlhf_pipeline.losses import (
    LossType,
    PairLossParams,
    compute_pair_loss,
    dpo_loss,
    ipo_loss,
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


def _params_for(lt: LossType) -> PairLossParams:
    return ALL_PARAMS if lt is LossType.CDPO else PairLossParams(eta=0.5, beta=0.1, gamma=0.5)


@pytest.mark.parametrize("lt", list(LossType))
def test_gradients_reach_policy_logps_only(lt):
    x = _inputs(requires_grad=True)
    loss, _ = compute_pair_loss(lt, _params_for(lt), **x)
    loss.sum().backward()
    for name in ("policy_chosen_logps", "policy_rejected_logps"):
        assert x[name].grad is not None and x[name].grad.abs().sum() > 0, name
    for name, v in x.items():
        if not name.startswith("policy_"):
            assert v.grad is None or torch.all(v.grad == 0), name


@pytest.mark.parametrize("lt", list(LossType))
def test_metrics_detached_per_example_and_dtype_kept(lt):
    loss, metrics = compute_pair_loss(lt, _params_for(lt), **_inputs(requires_grad=True))
    assert loss.shape == (2,) and loss.dtype == torch.float64 and loss.requires_grad
    assert set(metrics) == {"margin", "accuracy", "chosen_logratio", "rejected_logratio"}
    for name, m in metrics.items():
        assert m.shape == (2,) and m.dtype == torch.float64 and not m.requires_grad, name


def test_loss_type_properties():
    assert [lt.value for lt in LossType] == ["rebel", "dpo", "cdpo", "ipo", "simpo"]
    assert LossType("cdpo") is LossType.CDPO and LossType.DPO == "dpo"
    assert {lt for lt in LossType if not lt.needs_reference} == {LossType.SIMPO}
    assert {lt for lt in LossType if lt.uses_rewards} == {LossType.REBEL}
    assert {lt for lt in LossType if lt.length_normalized} == {LossType.SIMPO}
    assert {lt for lt in LossType if lt.default_logp_temperature_is_sampling} == {LossType.REBEL}


def test_dispatch_matches_direct_functions_and_margins():
    """Inputs from _inputs: chosen log-ratios [0.5, 0], rejected [−0.2, 1] → Δ = [0.7, −1].
    REBEL eta=0.5: margin Δ/eta = [1.4, −2]; loss [0.16, 1.0] (test_rebel_loss_hand_values).
    DPO/cDPO/IPO β=0.1: margin βΔ = [0.07, −0.1].
    SimPO β=0.1: c = [−1/4, −3/2] = [−0.25, −1.5], r = [−2/3, −1/5]; margin = 0.1·[0.416667, −1.3] = [0.0416667, −0.13].
    accuracy = [1, 0] for all.
    """
    x = _inputs(requires_grad=False)
    pc, pr, rc, rr = (x[k] for k in ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps",
                                     "ref_rejected_logps"))
    direct = {
        LossType.REBEL: rebel_loss(pc, pr, rc, rr, x["chosen_rewards"], x["rejected_rewards"], eta=0.5),
        LossType.DPO: dpo_loss(pc, pr, rc, rr, beta=0.1),
        LossType.CDPO: dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1),
        LossType.IPO: ipo_loss(pc, pr, rc, rr, beta=0.1),
        LossType.SIMPO: simpo_loss(pc, pr, x["chosen_lengths"], x["rejected_lengths"], beta=0.1, gamma=0.5),
    }
    margins = {LossType.REBEL: [1.4, -2.0], LossType.DPO: [0.07, -0.1], LossType.CDPO: [0.07, -0.1],
               LossType.IPO: [0.07, -0.1], LossType.SIMPO: [0.1 * (-0.25 + 2 / 3), 0.1 * (-1.5 + 0.2)]}
    for lt in LossType:
        loss, metrics = compute_pair_loss(lt.value, _params_for(lt), **x)
        close(loss, direct[lt], 0.0)
        close(metrics["margin"], margins[lt])
        close(metrics["accuracy"], [1.0, 0.0], 0.0)
    close(direct[LossType.REBEL], [0.16, 1.0])
    _, simpo_metrics = compute_pair_loss(LossType.SIMPO, _params_for(LossType.SIMPO), **x)
    close(simpo_metrics["chosen_logratio"], [-0.25, -1.5])
    close(simpo_metrics["rejected_logratio"], [-2 / 3, -0.2])
    _, dpo_metrics = compute_pair_loss(LossType.DPO, _params_for(LossType.DPO), **x)
    close(dpo_metrics["chosen_logratio"], [0.5, 0.0])
    close(dpo_metrics["rejected_logratio"], [-0.2, 1.0])


@pytest.mark.parametrize("lt, drop", [
    (LossType.REBEL, "chosen_rewards"), (LossType.REBEL, "ref_rejected_logps"), (LossType.DPO, "ref_chosen_logps"),
    (LossType.CDPO, "ref_rejected_logps"), (LossType.IPO, "ref_chosen_logps"), (LossType.SIMPO, "rejected_lengths"),
])
def test_missing_input_raises(lt, drop):
    x = _inputs(requires_grad=False)
    x[drop] = None
    with pytest.raises(ValueError, match=drop):
        compute_pair_loss(lt, _params_for(lt), **x)


def test_simpo_needs_no_reference():
    x = _inputs(requires_grad=False)
    x.update(ref_chosen_logps=None, ref_rejected_logps=None, chosen_rewards=None, rejected_rewards=None)
    loss, _ = compute_pair_loss(LossType.SIMPO, _params_for(LossType.SIMPO), **x)
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
        compute_pair_loss(LossType.DPO, PairLossParams(), **x)


def test_import_pulls_in_torch_only():
    code = ("import sys, rlhf_pipeline.losses; "
            "print(','.join(m for m in ('transformers', 'datasets', 'deepspeed', 'vllm', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
