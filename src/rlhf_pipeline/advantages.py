"""Advantages for the PPO family: GAE (with a critic), and the critic-free baselines RLOO, GRPO and REINFORCE++,
plus the masked statistics they share. Pure functions of tensors; imports torch only.

Conventions shared by every function here:

- Per-token tensors are (B, T): B sequences, T response tokens (the prompt is not included), right-padded.
  ``mask`` is (B, T), bool or 0/1 (any non-zero entry counts as a real token); True marks a real response token.
- Masked positions are not time steps. Whatever they hold (0, garbage, NaN) never reaches a result, and every
  per-token output is exactly 0 there. GAE and the discounted returns skip them, so right padding (the contract),
  left padding and holes inside a sequence all give what the same sequence without those positions would give.
- Per-sequence rewards for group baselines are (G, n): G prompts, n samples of each, one row per prompt. Flatten
  with ``.reshape(-1)`` to get one value per sample, in the order the samples were drawn.
- Advantages and returns are training targets, i.e. constants: every input is detached here, and no output
  carries a graph.
- The dtype follows the inputs (float64 in gives float64 out). Pass float32 or wider: statistics in bf16 are
  inaccurate.

Which peer each function matches, and where it differs, is in its docstring. "OpenRLHF" means
``openrlhf/trainer/ppo_utils/experience_maker.py`` (``get_advantages_and_returns``, ``get_cumulative_returns``,
the advantage normalisation, the ``rloo``/``group_norm`` reward shaping); "TRL" means the installed
``trl/trainer/{grpo,rloo}_trainer.py`` 1.16 and, for PPO (not shipped in the 1.16 wheel), the git tree's
``trl/experimental/ppo/ppo_trainer.py``.
"""

from __future__ import annotations

import torch


def _token_mask(mask: torch.Tensor | None, like: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """``mask`` as a bool tensor of ``like``'s shape (all True when None); no broadcasting, so a transposed or
    per-sequence mask fails loudly instead of silently selecting the wrong tokens."""
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but the values have shape {tuple(like.shape)}; "
                         "pass one mask entry per token")
    return mask if mask.dtype == torch.bool else mask != 0


def _per_token(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected per-token (B, T)")


def _groups(rewards: torch.Tensor) -> int:
    if rewards.dim() != 2:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected (groups, n): one row per prompt, "
                         "one column per sample (e.g. rewards.view(-1, n))")
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(f"a group baseline needs n >= 2 samples per prompt, got n={n}")
    return n


def _unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


# ---------------------------------------------------------------------------------------------------- masked stats


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None,
                keepdim: bool = False) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is set; over everything (dim=None) or along ``dim``.

    ``sum(values·mask) / sum(mask)`` as in OpenRLHF's and TRL's ``masked_mean``, except that masked entries are
    selected out (``torch.where``) rather than multiplied by 0, so a NaN or inf in padding cannot leak, and an empty
    selection gives 0 instead of NaN (TRL GRPO's ``mask.sum().clamp(min=1)``). ``mask=None`` means all positions.
    """
    m = _token_mask(mask, values)
    total = torch.where(m, values, 0).sum(dim=dim, keepdim=keepdim)
    count = m.sum(dim=dim, keepdim=keepdim).clamp(min=1)
    return total / count


def masked_var(values: torch.Tensor, mask: torch.Tensor | None, unbiased: bool = False) -> torch.Tensor:
    """Variance of ``values`` over all positions where ``mask`` is set (a scalar).

    ``unbiased=False`` (default) divides by the count, as OpenRLHF's advantage normalisation does;
    ``unbiased=True`` applies Bessel's correction count/(count−1), as TRL's ``masked_var`` does. Raises when fewer
    than 1 (2 when unbiased) positions are selected, because the variance is then undefined.
    """
    m = _token_mask(mask, values)
    count = int(m.sum())
    need = 2 if unbiased else 1
    if count < need:
        raise ValueError(f"masked_var needs at least {need} selected value(s) (unbiased={unbiased}), got {count}; "
                         "normalise over a larger batch")
    mean = masked_mean(values, m)
    var = masked_mean((values - mean) ** 2, m)
    return var * (count / (count - 1)) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor | None, shift_mean: bool = True, eps: float = 1e-8,
                  unbiased: bool = False) -> torch.Tensor:
    """Normalise ``values`` to mean 0 and variance 1 over the selected positions: ``(x − μ)·(σ² + eps)^(−1/2)``.

    μ and σ² are one pair of scalars over ALL selected positions of the tensor (global whitening, not per row).
    ``shift_mean=False`` keeps the mean: ``(x − μ)/σ + μ``, which is TRL's ``masked_whiten(shift_mean=False)``
    (used there to whiten rewards without moving them), not ``x/σ``. Masked positions come back as 0.

    Variance: population (divide by the count) by default. The installed TRL 1.16 has no ``masked_whiten``; the
    peer whose normalisation this is used for is OpenRLHF (REINFORCE++ and GAE advantages,
    ``var = ((adv − mean)²·mask).sum() / mask.sum()``), so its biased variance is the default. ``unbiased=True``
    gives TRL's PPO ``masked_whiten`` (Bessel-corrected ``masked_var``). eps is added to σ² as TRL does;
    OpenRLHF instead clamps, ``rsqrt(max(σ², 1e-8))``. The two differ only when σ² is of order eps.
    """
    m = _token_mask(mask, values)
    mean = masked_mean(values, m)
    var = masked_var(values, m, unbiased=unbiased)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, 0)


# ---------------------------------------------------------------------------------------------------- GAE


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float,
        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16): ``(advantages, returns)``, each (B, T).

    Per token: ``δ_t = r_t + γ·V_{t+1} − V_t`` and ``A_t = δ_t + γλ·A_{t+1}``, where ``t+1`` is the next real token
    of the same sequence; after the last real token ``V = 0`` and ``A = 0`` (the episode ends: no bootstrapping from
    padding). ``returns = advantages + values``, the critic's regression target (λ-returns). Both are 0 at masked
    positions.

    ``rewards`` (B, T) are per-token rewards, typically the sequence reward on the last real token minus a per-token
    KL penalty. ``values`` (B, T) are the critic's values V(s_t) from the rollout. γ = λ = 1 gives Monte-Carlo
    advantages ``Σ_{k≥t} r_k − V_t``; λ = 0 gives one-step TD errors ``δ_t``.

    Same numbers as OpenRLHF's ``get_advantages_and_returns`` and TRL's PPO loop for right-padded masks (they
    multiply rewards and values by the mask and run the same recursion). Vectorised over the batch; the loop runs
    over T. Advantages are returned unwhitened: whiten them over the whole rollout batch (``masked_whiten``), as
    both peers do, when wanted.
    """
    _unit_interval("gamma", gamma)
    _unit_interval("lam", lam)
    _per_token("rewards", rewards)
    if values.shape != rewards.shape:
        raise ValueError(f"values has shape {tuple(values.shape)} but rewards has {tuple(rewards.shape)}; "
                         "both are per-token (B, T)")
    m = _token_mask(mask, rewards)
    r = torch.where(m, rewards.detach(), 0)
    v = torch.where(m, values.detach(), 0)
    batch, steps = r.shape
    advantages = torch.zeros_like(r)
    last_gae = r.new_zeros(batch)  # A of the next real token of each sequence (0 past the end)
    next_value = r.new_zeros(batch)  # V of the next real token of each sequence (0 past the end)
    for t in reversed(range(steps)):
        real = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * lam * last_gae
        advantages[:, t] = torch.where(real, candidate, 0)
        last_gae = torch.where(real, candidate, last_gae)  # a masked position is skipped, not a step
        next_value = torch.where(real, v[:, t], next_value)
    returns = torch.where(m, advantages + v, 0)
    return advantages, returns


# ---------------------------------------------------------------------------------------------------- critic-free


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): ``r_i − mean_{j≠i} r_j`` per group.

    ``rewards`` (G, n) → advantages (G, n). The baseline ``(Σ_j r_j − r_i)/(n−1)`` excludes the sample itself, so
    it is independent of it and the estimator stays unbiased; equivalently ``n/(n−1)·(r_i − mean_j r_j)``.
    Same as OpenRLHF's ``rloo`` shaping and TRL's ``RLOOTrainer`` (with ``normalize_advantages=False``, its
    default) without a KL penalty. With one in the reward, TRL subtracts the sequence's summed KL from its reward
    before the baseline; here, as in OpenRLHF, the per-token penalty is added after it, as returns-to-go
    (``rlhf_pipeline.algorithms.groups``). Raises for n < 2, where there is no "other" sample.
    """
    n = _groups(rewards)
    r = rewards.detach()
    baseline = (r.sum(dim=-1, keepdim=True) - r) / (n - 1)
    return r - baseline


def group_norm(rewards: torch.Tensor, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """GRPO (Shao et al. 2024, §4.1.2): ``(r_i − mean(r)) / (std(r) + eps)`` within each group, (G, n) → (G, n).

    std is the UNBIASED sample standard deviation (divide by n−1), as both peers compute it: TRL's
    ``GRPOTrainer`` uses ``nanstd`` (Bessel-corrected) with ``+ 1e-4`` (``scale_rewards="group"``), and OpenRLHF's
    ``group_norm`` uses ``torch.std`` (unbiased by default) with ``+ 1e-9``. The default eps is TRL's, so results
    match the side-by-side baseline. A group whose rewards are all equal gets advantages 0.

    ``scale=False`` only subtracts the group mean (Dr. GRPO, Liu et al. 2025; TRL ``scale_rewards="none"``;
    OpenRLHF ``reinforce_baseline``). Raises for n < 2.
    """
    _groups(rewards)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = rewards.detach()
    centered = r - r.mean(dim=-1, keepdim=True)
    if not scale:
        return centered
    return centered / (r.std(dim=-1, keepdim=True, correction=1) + eps)


def win_rates(rewards: torch.Tensor) -> torch.Tensor:
    """SPPO's estimate of each response's probability of beating the policy that sampled it, (G, n) → (G, n):
    ``P(y_i ≻ π_t) ≈ mean_{j≠i} σ(r_i − r_j)``, the Bradley-Terry preference of a reward model between it and each
    other response of its group (Wu et al. 2024, §4: the win rate against the other samples, estimated with a
    preference model; with a reward model's scores, Bradley-Terry). The rewards' scale matters: ``σ`` reads them as
    log-odds. Raises for n < 2."""
    n = _groups(rewards)
    r = rewards.detach()
    pairwise = torch.sigmoid(r.unsqueeze(-1) - r.unsqueeze(-2))  # [.., i, j] = σ(r_i − r_j); the diagonal is 1/2
    return (pairwise.sum(dim=-1) - 0.5) / (n - 1)


def decoupled_group_norm(rewards: torch.Tensor, groups: torch.Tensor, weights: torch.Tensor,
                         eps: float = 1e-4) -> torch.Tensor:
    """GDPO (Liu et al. 2026, arXiv 2601.05242): several rewards, each normalised within its group before they are
    summed, then the sum normalised over the batch. ``rewards`` (N, K): K reward sources for N samples; ``groups``
    (N,): each sample's group; ``weights`` (K,). Per source ``(r_k − group mean_k) / (group std_k + eps)`` (unbiased
    std, as :func:`group_norm`), the weighted sum over k, then ``(s − mean(s)) / (std(s) + eps)`` over all N. As
    TRL's ``multi_objective_aggregation="normalize_then_sum"`` (``GRPOTrainer._generate_and_score_completions``).
    A group of one sample contributes 0 for every source (it has no group to be compared with)."""
    if rewards.dim() != 2 or groups.shape != rewards.shape[:1] or weights.shape != rewards.shape[1:]:
        raise ValueError(f"rewards must be (N, K), groups (N,), weights (K,); got {tuple(rewards.shape)}, "
                         f"{tuple(groups.shape)}, {tuple(weights.shape)}")
    r = rewards.detach()
    normed = torch.zeros_like(r)
    for g in groups.unique():
        where = groups == g
        if int(where.sum()) < 2:
            continue
        block = r[where]
        normed[where] = (block - block.mean(dim=0)) / (block.std(dim=0, correction=1) + eps)
    summed = (normed * weights.to(r.dtype)).sum(dim=-1)
    if summed.numel() < 2:
        return summed - summed
    return (summed - summed.mean()) / (summed.std(correction=1) + eps)


ROLLOUT_CORRECTIONS = ("none", "tis", "mask", "sequence_mask")


def rollout_correction(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights (B, T) that correct for the sampler and the trainer disagreeing on the sampled tokens'
    log-probs (different kernels and precision, top-k/top-p truncation), from ``w = exp(trainer − sampler)``, the
    ratio π_old/π_sampler of the trainer's recomputation of the sampling policy to the sampler's own numbers:

    - ``tis``: truncated importance sampling, ``min(w, cap)`` (TRL's ``vllm_importance_sampling_mode`` "token_truncate";
      verl's token-level ``rollout_is``);
    - ``mask``: 1 where ``1/cap ≤ w ≤ cap``, else 0 (IcePop, arXiv 2510.18855; TRL's "token_mask");
    - ``sequence_mask``: 1 for every token of a sequence whose geometric-mean ratio ``exp(mean_t log w)`` is within
      ``[1/cap, cap]``, else 0 (DeepSeek-V3.2's sequence masking; verl's ``rollout_rs="geometric"``);
    - ``none``: 1.

    A token whose sampler log-prob is unknown (NaN) gets weight 1 and counts as unknown. Padding gets 0. Also returns
    metrics: ``kl_sampler``, the mean over tokens of the k3 estimate of KL(sampler ‖ trainer), ``w − 1 − log w``;
    ``corrected_fraction``, the fraction of tokens truncated or masked; ``weight_mean``; ``unknown_fraction``.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"mode must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    if not cap > 1.0:
        raise ValueError(f"cap must be > 1, got {cap}")
    m = _token_mask(mask, trainer_logp)
    known = m & ~torch.isnan(sampler_logp)
    log_w = torch.where(known, trainer_logp.detach() - torch.nan_to_num(sampler_logp), 0)
    w = torch.exp(log_w)
    ones = torch.ones_like(w)
    if mode == "tis":
        weights, corrected = w.clamp(max=cap), known & (w > cap)
    elif mode == "mask":
        inside = (w >= 1.0 / cap) & (w <= cap)
        weights, corrected = torch.where(inside, ones, 0), known & ~inside
    elif mode == "sequence_mask":
        count = known.sum(dim=-1).clamp(min=1)
        geometric = torch.exp(log_w.sum(dim=-1) / count)  # (B,)
        inside = ((geometric >= 1.0 / cap) & (geometric <= cap)).unsqueeze(-1).expand_as(w)
        weights, corrected = torch.where(inside, ones, 0), m & ~inside
    else:
        weights, corrected = ones, torch.zeros_like(m)
    weights = torch.where(known, weights, ones)
    if mode == "sequence_mask":  # the whole sequence goes, its unknown tokens with it
        weights = torch.where(corrected, 0, weights)
    weights = torch.where(m, weights, 0)
    n = m.sum().clamp(min=1)
    metrics = {
        "kl_sampler": float(torch.where(known, torch.expm1(log_w) - log_w, 0).sum() / known.sum().clamp(min=1)),
        "corrected_fraction": float(corrected.sum() / n),
        "weight_mean": float(torch.where(m, weights, 0).sum() / n),
        "unknown_fraction": float((m & ~known).sum() / n),
    }
    return weights, metrics


def reinforce_pp_returns(rewards: torch.Tensor, gamma: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Discounted returns-to-go ``G_t = r_t + γ·G_{t+1}`` per sequence, (B, T) → (B, T), 0 at masked positions.

    Equals GAE with V = 0 and λ = 1. OpenRLHF's ``get_cumulative_returns`` (its ``reinforce`` estimator) computes
    the same for right-padded masks.
    """
    _unit_interval("gamma", gamma)
    _per_token("rewards", rewards)
    m = _token_mask(mask, rewards)
    r = torch.where(m, rewards.detach(), 0)
    returns = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        real = m[:, t]
        candidate = r[:, t] + gamma * running
        returns[:, t] = torch.where(real, candidate, 0)
        running = torch.where(real, candidate, running)
    return returns


def reinforce_pp(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++ (Hu 2025) advantages: discounted returns-to-go, whitened over the WHOLE batch; (B, T) → (B, T).

    ``A = masked_whiten(reinforce_pp_returns(rewards, gamma, mask), mask)``: one mean and one population variance
    over every real token of every sequence passed in (OpenRLHF's ``reinforce`` estimator: ``get_cumulative_returns``
    then the global advantage normalisation, which divides the variance by the token count). Pass the whole rollout
    batch, not a micro-batch: the statistics are those of what is passed. ``rewards`` are per-token, usually the
    sequence reward on the last real token minus β·KL per token (``losses.kl_k1``). 0 at masked positions.
    """
    returns = reinforce_pp_returns(rewards, gamma=gamma, mask=mask)
    return masked_whiten(returns, mask, eps=eps, unbiased=False)
