"""Advantage estimators against numbers worked by hand (arithmetic in each docstring), against plain-Python-loop
oracles, against numpy, and against the peers' formulas written out here independently (TRL is a bench-only
dependency and OpenRLHF is not installed: nothing here imports either). Tolerances: 1e-6 absolute on float64."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from rlhf_pipeline.advantages import (
    gae,
    group_norm,
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_pp,
    reinforce_pp_returns,
    rloo,
)


def t(*rows):
    """t([1, 2]) → shape (2,); t([1, 2], [3, 4]) → shape (2, 2); float64."""
    return torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=torch.float64)


def m(*rows):
    """m(1, 0, 1) → shape (3,); m([1, 0], [1, 1]) → shape (2, 2); bool."""
    return torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=torch.bool)


def close(actual: torch.Tensor, expected, abs_tol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, rtol=0.0, atol=abs_tol), (actual, expected)


def ragged_mask(batch: int, steps: int, gen: torch.Generator) -> torch.Tensor:
    """Right-padded mask with lengths drawn in [0, steps]; rows 0 and 1 forced to length 0 and full length."""
    lengths = torch.randint(0, steps + 1, (batch,), generator=gen)
    lengths[0], lengths[1] = 0, steps
    return torch.arange(steps)[None, :] < lengths[:, None]


# ---------------------------------------------------------------------------------------------------- masked stats


def test_masked_mean_hand_values():
    """values [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [1, 0, 0]]:
    all: (1 + 2 + 4)/3 = 7/3 = 2.333333;  per row: (1+2)/2 = 1.5, 4/1 = 4;  per column: (1+4)/2 = 2.5, 2/1 = 2, 0/0 → 0.
    """
    values, mask = t([1, 2, 3], [4, 5, 6]), m([1, 1, 0], [1, 0, 0])
    close(masked_mean(values, mask), 7 / 3)
    close(masked_mean(values, mask, dim=-1), [1.5, 4.0])
    close(masked_mean(values, mask, dim=0), [2.5, 2.0, 0.0])
    close(masked_mean(values, mask.long(), dim=1, keepdim=True), [[1.5], [4.0]])
    close(masked_mean(values, None), 3.5)


def test_masked_mean_ignores_nan_in_padding_and_empty_gives_zero():
    values = t([1.0, float("nan")], [float("inf"), -float("inf")])
    mask = m([1, 0], [0, 0])
    close(masked_mean(values, mask), 1.0)
    close(masked_mean(values, mask, dim=-1), [1.0, 0.0])


def test_masked_mean_rejects_mask_of_other_shape():
    with pytest.raises(ValueError, match="mask has shape"):
        masked_mean(torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool))


def test_masked_whiten_hand_values():
    """Selected values 1 and 3 (the 99 is padding): μ = 2, population σ² = ((1−2)² + (3−2)²)/2 = 1
    → [−1, 1]·(1 + 1e−8)^(−1/2) = [−0.999999995, 0.999999995], padding → 0.
    Unbiased σ² = 2/1 = 2 → [−1/√2, 1/√2] = [−0.70710678, 0.70710678].
    shift_mean=False: (x − μ)/σ + μ = [−1 + 2, 1 + 2] = [1, 3] (TRL's semantics: the mean is kept)."""
    values, mask = t([1.0, 99.0, 3.0]), m(1, 0, 1)
    close(masked_whiten(values, mask), [-1.0, 0.0, 1.0])
    close(masked_var(values, mask), 1.0)
    close(masked_var(values, mask, unbiased=True), 2.0)
    close(masked_whiten(values, mask, unbiased=True), [-(0.5**0.5), 0.0, 0.5**0.5])
    close(masked_whiten(values, mask, shift_mean=False), [1.0, 0.0, 3.0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_whiten_matches_numpy(seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(6, 9, generator=gen, dtype=torch.float64) * 3 + 1
    mask = ragged_mask(6, 9, gen)
    x = values.numpy()[mask.numpy()]
    for unbiased, ddof in ((False, 0), (True, 1)):
        expected = np.zeros(values.shape)
        expected[mask.numpy()] = (x - x.mean()) / np.sqrt(x.var(ddof=ddof) + 1e-8)
        close(masked_whiten(values, mask, unbiased=unbiased), expected)
        close(masked_var(values, mask, unbiased=unbiased), x.var(ddof=ddof))
    kept = np.zeros(values.shape)
    kept[mask.numpy()] = (x - x.mean()) / np.sqrt(x.var() + 1e-8) + x.mean()
    close(masked_whiten(values, mask, shift_mean=False), kept)


def test_masked_whiten_unbiased_matches_trl_ppo_formula():
    """TRL's ``masked_whiten`` (trl/experimental/ppo/ppo_trainer.py in the git tree; the 1.16 wheel does not ship
    it): ``(values − mean)·rsqrt(masked_var + 1e−8)`` with ``masked_var`` Bessel-corrected by mask_sum/(mask_sum−1).
    Written out; TRL leaves padding unwhitened, we zero it, so compare on real tokens."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = ragged_mask(5, 7, gen)
    fm = mask.double()
    mean = (values * fm).sum() / fm.sum()
    var = ((values - mean) ** 2 * fm).sum() / fm.sum() * (fm.sum() / (fm.sum() - 1))
    trl = (values - mean) * torch.rsqrt(var + 1e-8)
    close(masked_whiten(values, mask, unbiased=True)[mask], trl[mask])


def test_masked_whiten_refuses_undefined_variance():
    with pytest.raises(ValueError, match="at least 1"):
        masked_whiten(t([1.0, 2.0]), m(0, 0))
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(t([1.0, 2.0]), m(1, 0), unbiased=True)
    close(masked_whiten(t([5.0, 2.0]), m(1, 0)), [0.0, 0.0])  # one value, population σ² = 0 → (5−5)·1e4 = 0


# ---------------------------------------------------------------------------------------------------- GAE


def test_gae_hand_values():
    """γ = 0.9, λ = 0.8 → γλ = 0.72.
    Row 0, r = [0, 0, 1], V = [0.5, 0.6, 0.7], all real:
      t=2: δ = 1 + 0.9·0 − 0.7 = 0.3 (no V past the end);           A2 = 0.3
      t=1: δ = 0 + 0.9·0.7 − 0.6 = 0.03;                             A1 = 0.03 + 0.72·0.3 = 0.246
      t=0: δ = 0 + 0.9·0.6 − 0.5 = 0.04;                             A0 = 0.04 + 0.72·0.246 = 0.21712
      returns = A + V = [0.71712, 0.846, 1.0]
    Row 1, r = [0, 2, pad], V = [1, 0.5, pad] (pad holds 99): bootstrapping stops at the last real token:
      t=1: δ = 2 + 0.9·0 − 0.5 = 1.5;                                A1 = 1.5
      t=0: δ = 0 + 0.9·0.5 − 1 = −0.55;                              A0 = −0.55 + 0.72·1.5 = 0.53
      returns = [1.53, 2.0, 0]
    """
    rewards = t([0.0, 0.0, 1.0], [0.0, 2.0, 99.0])
    values = t([0.5, 0.6, 0.7], [1.0, 0.5, 99.0])
    adv, ret = gae(rewards, values, gamma=0.9, lam=0.8, mask=m([1, 1, 1], [1, 1, 0]))
    close(adv, [[0.21712, 0.246, 0.3], [0.53, 1.5, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [1.53, 2.0, 0.0]])


def test_gae_special_cases():
    """γ = λ = 1: A_t = Σ_{k≥t} r_k − V_t (Monte Carlo).  λ = 0: A_t = δ_t = r_t + γV_{t+1} − V_t (TD(0)).
    r = [1, 2, 3], V = [0.5, 1, 1.5]:
      MC:  [6 − 0.5, 5 − 1, 3 − 1.5] = [5.5, 4, 1.5]
      TD, γ = 0.5: [1 + 0.5·1 − 0.5, 2 + 0.5·1.5 − 1, 3 + 0 − 1.5] = [1.0, 1.75, 1.5]"""
    r, v = t([1.0, 2.0, 3.0]).unsqueeze(0), t([0.5, 1.0, 1.5]).unsqueeze(0)
    close(gae(r, v, gamma=1.0, lam=1.0)[0], [[5.5, 4.0, 1.5]])
    close(gae(r, v, gamma=0.5, lam=0.0)[0], [[1.0, 1.75, 1.5]])
    close(gae(r, v, gamma=1.0, lam=1.0)[1], [[6.0, 5.0, 3.0]])  # returns = A + V = returns-to-go


def _gae_loop(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """Textbook GAE on ONE unpadded sequence, plain Python floats."""
    advantages, last = [0.0] * len(rewards), 0.0
    for i in reversed(range(len(rewards))):
        next_value = values[i + 1] if i + 1 < len(rewards) else 0.0
        last = rewards[i] + gamma * next_value - values[i] + gamma * lam * last
        advantages[i] = last
    return advantages


def _loop_oracle(rewards, values, mask, gamma, lam):
    """Run _gae_loop on each row's real tokens only (compacted), scatter back, 0 elsewhere."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        out = _gae_loop([rewards[b, i].item() for i in idx], [values[b, i].item() for i in idx], gamma, lam)
        for i, a in zip(idx, out):
            adv[b, i] = a
    return adv


@pytest.mark.parametrize("seed, gamma, lam", [(0, 1.0, 0.95), (1, 0.99, 0.95), (2, 0.9, 0.0), (3, 0.5, 1.0)])
def test_gae_matches_python_loop_on_ragged_batches(seed, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(7, 11, generator=gen, dtype=torch.float64)
    values = torch.randn(7, 11, generator=gen, dtype=torch.float64)
    mask = ragged_mask(7, 11, gen)
    rewards[~mask], values[~mask] = float("nan"), float("nan")  # padding must not leak
    adv, ret = gae(rewards, values, gamma, lam, mask)
    expected = _loop_oracle(rewards, values, mask, gamma, lam)
    close(adv, expected)
    close(ret, torch.where(mask, expected + values, 0))
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_gae_skips_interior_holes_like_removed_tokens():
    """A masked position inside a sequence is not a step: same as the sequence with it removed."""
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 9, generator=gen) < 0.6
    adv, _ = gae(rewards, values, 0.95, 0.9, mask)
    close(adv, _loop_oracle(rewards, values, mask, 0.95, 0.9))


def test_gae_matches_peer_formula_on_right_padding():
    """OpenRLHF ``get_advantages_and_returns`` / TRL PPO loop, written out: rewards and values multiplied by the
    mask, then one recursion over every column (padding included)."""
    gen = torch.Generator().manual_seed(5)
    rewards = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    mask = ragged_mask(6, 8, gen)
    gamma, lam = 0.97, 0.9
    v, r = values * mask, rewards * mask
    lastgaelam, reversed_adv = 0.0, []
    for col in reversed(range(8)):
        nextvalues = v[:, col + 1] if col < 7 else 0.0
        delta = r[:, col] + gamma * nextvalues - v[:, col]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_adv.append(lastgaelam)
    peer_adv = torch.stack(reversed_adv[::-1], dim=1)
    adv, ret = gae(rewards, values, gamma, lam, mask)
    close(adv, peer_adv)  # the peers' advantages are 0 at padding too: δ = 0 there and nothing flows back
    close(ret[mask], (peer_adv + v)[mask])


def test_gae_outputs_are_detached_and_keep_dtype():
    rewards = torch.randn(2, 3, dtype=torch.float32, requires_grad=True)
    values = torch.randn(2, 3, dtype=torch.float32, requires_grad=True)
    adv, ret = gae(rewards, values, 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma=1.5, lam=0.9), "gamma"), (dict(gamma=0.9, lam=-0.1), "lam"),
])
def test_gae_rejects_bad_coefficients(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), **kwargs)


def test_gae_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"per-token \(B, T\)"):
        gae(torch.zeros(4), torch.zeros(4), 1.0, 1.0)
    with pytest.raises(ValueError, match="values has shape"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), 1.0, 1.0)
    with pytest.raises(ValueError, match="mask has shape"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), 1.0, 1.0, mask=torch.ones(3, 2))


# ---------------------------------------------------------------------------------------------------- RLOO


def test_rloo_hand_values():
    """Group [1, 2, 3, 6], n = 4, Σ = 12: baselines (12−r)/3 = [11/3, 10/3, 3, 2]
    → A = [1 − 11/3, 2 − 10/3, 3 − 3, 6 − 2] = [−8/3, −4/3, 0, 4];
    check: n/(n−1)·(r − mean) = 4/3·[−2, −1, 0, 3] = [−8/3, −4/3, 0, 4]. Advantages of a group sum to 0.
    Groups of two: [1, 0] → [1 − 0, 0 − 1] = [1, −1];  [5, 5] → [0, 0]."""
    close(rloo(t([1.0, 2.0, 3.0, 6.0]).unsqueeze(0)), [[-8 / 3, -4 / 3, 0.0, 4.0]])
    close(rloo(t([1.0, 0.0], [5.0, 5.0])), [[1.0, -1.0], [0.0, 0.0]])


def test_rloo_matches_peers_on_random_groups():
    """TRL RLOOTrainer (trl/trainer/rloo_trainer.py, 1.16): ``baselines = (grouped_sum − grouped_rewards) /
    (scorable_counts − 1)`` then ``rewards − baselines`` on the flattened rewards (no NaN rewards here).
    OpenRLHF ``rloo``: ``(rewards.sum(-1, keepdim=True) − rewards) / (n − 1)``."""
    gen = torch.Generator().manual_seed(6)
    rewards = torch.randn(5 * 8, generator=gen, dtype=torch.float64)
    grouped = rewards.view(-1, 8)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    trl = rewards - ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    ours = rloo(grouped)
    close(ours.reshape(-1), trl)
    close(ours, grouped - (grouped.sum(-1, keepdim=True) - grouped) / 7)
    close(ours, 8 / 7 * (grouped - grouped.mean(-1, keepdim=True)))
    close(ours.sum(-1), torch.zeros(5))


@pytest.mark.parametrize("fn", [rloo, group_norm])
def test_group_baselines_reject_bad_groups(fn):
    with pytest.raises(ValueError, match="n >= 2"):
        fn(torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"\(groups, n\)"):
        fn(torch.zeros(6))


# ---------------------------------------------------------------------------------------------------- GRPO


def test_group_norm_hand_values():
    """Group [1, 2, 3, 6]: mean 3, deviations [−2, −1, 0, 3], Σd² = 4 + 1 + 0 + 9 = 14,
    unbiased σ² = 14/3 = 4.666667, σ = 2.1602469 (population σ would be √3.5 = 1.8708287).
    eps = 0: [−2, −1, 0, 3]/2.1602469 = [−0.9258201, −0.4629100, 0, 1.3887301].
    eps = 1e−4 (default, TRL's): /2.1603469 = [−0.9257772, −0.4628886, 0, 1.3886659].
    A constant group [5, 5, 5] gives 0/(0 + eps) = [0, 0, 0]. scale=False: [−2, −1, 0, 3]."""
    r = t([1.0, 2.0, 3.0, 6.0]).unsqueeze(0)
    close(group_norm(r, eps=0.0), [[-0.9258201, -0.4629100, 0.0, 1.3887301]])
    close(group_norm(r), [[-0.9257772, -0.4628886, 0.0, 1.3886659]])
    close(group_norm(t([5.0, 5.0, 5.0]).unsqueeze(0)), [[0.0, 0.0, 0.0]])
    close(group_norm(r, scale=False), [[-2.0, -1.0, 0.0, 3.0]])


def test_group_norm_matches_peers_and_uses_unbiased_std():
    """TRL GRPOTrainer (trl/trainer/grpo_trainer.py 1.16, ``sum_then_normalize``, ``scale_rewards="group"``):
    ``(rewards − nanmean(group)) / (nanstd(group) + 1e−4)`` with ``nanstd`` from trl/trainer/utils.py:
    mean of squared deviations × count/(count − 1). OpenRLHF ``group_norm``: ``(r − mean)/(r.std(-1) + 1e−9)``."""
    gen = torch.Generator().manual_seed(7)
    n = 6
    rewards = torch.randn(4 * n, generator=gen, dtype=torch.float64)
    grouped = rewards.view(-1, n)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    var = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True) * (n / (n - 1))
    trl = (rewards - mean.repeat_interleave(n).view(-1)) / (var.sqrt().repeat_interleave(n).view(-1) + 1e-4)
    close(group_norm(grouped).reshape(-1), trl)
    openrlhf = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-9)
    close(group_norm(grouped, eps=1e-9), openrlhf)
    population = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True, correction=0) + 1e-4)
    assert not torch.allclose(group_norm(grouped), population, atol=1e-3)


def test_group_norm_rejects_negative_eps():
    with pytest.raises(ValueError, match="eps"):
        group_norm(torch.zeros(2, 3), eps=-1.0)


# ---------------------------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand_values():
    """γ = 0.5. Row 0 r = [0, −0.1, 1]: G2 = 1; G1 = −0.1 + 0.5·1 = 0.4; G0 = 0 + 0.5·0.4 = 0.2.
    Row 1 r = [0.5, 0, pad]: G1 = 0; G0 = 0.5 + 0.5·0 = 0.5; pad → 0.
    Whitening over the 5 real tokens [0.2, 0.4, 1, 0.5, 0]: μ = 2.1/5 = 0.42;
    d = [−0.22, −0.02, 0.58, 0.08, −0.42]; d² = [0.0484, 0.0004, 0.3364, 0.0064, 0.1764], Σ = 0.568;
    population σ² = 0.568/5 = 0.1136, σ = 0.33704599
    → A = d/σ = [−0.6527299, −0.0593391, 1.7208333, 0.2373563, −1.2461207]."""
    rewards, mask = t([0.0, -0.1, 1.0], [0.5, 0.0, 7.0]), m([1, 1, 1], [1, 1, 0])
    close(reinforce_pp_returns(rewards, gamma=0.5, mask=mask), [[0.2, 0.4, 1.0], [0.5, 0.0, 0.0]])
    close(reinforce_pp(rewards, mask, gamma=0.5),
          [[-0.6527299, -0.0593391, 1.7208333], [0.2373563, -1.2461207, 0.0]])


def test_reinforce_pp_returns_equal_gae_with_zero_values_and_lambda_one():
    gen = torch.Generator().manual_seed(8)
    rewards = torch.randn(5, 10, generator=gen, dtype=torch.float64)
    mask = ragged_mask(5, 10, gen)
    close(reinforce_pp_returns(rewards, 0.9, mask), gae(rewards, torch.zeros_like(rewards), 0.9, 1.0, mask)[0])


def test_reinforce_pp_matches_openrlhf():
    """OpenRLHF ``reinforce``: ``get_cumulative_returns`` (rewards × mask, G_t = r_t + γG_{t+1} over every
    column), then the global normalisation in experience_maker.py: ``mean = Σ(A·mask)/Σmask``,
    ``var = Σ((A − mean)²·mask)/Σmask`` (population), ``A = (A − mean)·rsqrt(max(var, 1e−8))``."""
    gen = torch.Generator().manual_seed(9)
    rewards = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = ragged_mask(6, 9, gen)
    gamma = 0.95
    r = rewards * mask
    returns, running = torch.zeros_like(r), torch.zeros(6, dtype=torch.float64)
    for col in reversed(range(9)):
        running = r[:, col] + gamma * running
        returns[:, col] = running
    fm = mask.double()
    mean = (returns * fm).sum() / fm.sum()
    var = ((returns - mean) ** 2 * fm).sum() / fm.sum()
    peer = (returns - mean) * var.clamp(min=1e-8).rsqrt()
    ours = reinforce_pp(rewards, mask, gamma=gamma)
    close(ours[mask], peer[mask])
    assert torch.all(ours[~mask] == 0)
    close(masked_mean(ours, mask), 0.0)
    close(masked_var(ours, mask), 1.0)


# ---------------------------------------------------------------------------------------------------- module


def test_import_pulls_in_torch_only():
    code = ("import sys, rlhf_pipeline.advantages; "
            "print(','.join(m for m in ('transformers', 'datasets', 'deepspeed', 'vllm', 'accelerate', 'trl') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
