"""Pairwise preference losses (REBEL, DPO, cDPO, IPO, SimPO, ORPO, CPO) and KTO's unpaired loss as pure functions of
tensors.
Imports torch, and ``advantages`` (torch only too) for its masked mean.

Conventions shared by every function here:

- Every ``*_logps`` is a SEQUENCE log-prob: the sum of per-token log-probs over the response tokens, shape (B,).
  ``*_lengths`` are response token counts, shape (B,); ``*_rewards`` are scalar rewards, shape (B,).
- Every loss returns a per-example loss of shape (B,); the trainer takes the mean (or a weighted sum).
- Gradients flow to the policy log-probs only. Reference log-probs, rewards and lengths are constants: they are
  detached here, so passing a tensor that still has a graph cannot leak gradient into the reference model.
- The dtype follows torch's promotion rules: float64 in gives float64 out; nothing is cast down.

Δ below always means ``(πc − refc) − (πr − refr)``: the chosen log-ratio minus the rejected log-ratio.

The PPO-family section at the end (``ppo_policy_loss``, ``value_loss``, the KL estimators) works on PER-TOKEN
tensors instead, with a token mask; its conventions are stated at the top of that section.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The one masked mean (selects out padding, 0 for an empty selection); advantages imports only torch, so no cycle.
from rlhf_pipeline.advantages import masked_mean


def _logratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected) -> tuple[torch.Tensor, torch.Tensor]:
    return policy_chosen - ref_chosen.detach(), policy_rejected - ref_rejected.detach()


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def rebel_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
               chosen_rewards, rejected_rewards, eta: float) -> torch.Tensor:
    """REBEL (Gao et al. 2024, §3): regress the scaled log-ratio gap onto the reward gap, per pair (B,).

    ``loss = (Δ/eta − (rc − rr))²``. Here "ref" is π_t, the policy that generated the pairs.
    REBEL's repo (``ultrafeedback_largebatch/rebel.py``) multiplies through by eta and minimises
    ``(Δ − eta·(rc − rr))²`` with eta=1e6; that equals eta² times this loss, i.e. the same minimiser with a
    gradient eta² larger. This function returns the paper's 1/eta form, so logged values have the paper's meaning;
    the trainer (``pairs.PairTask``) backpropagates REBEL's form, because Adam is invariant to the constant
    only while gradients stay well above its eps: with eta=1e6 the paper form's gradients are ~1e-8 per parameter,
    the size of eps, and the updates would shrink.
    """
    _positive("eta", eta)
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    reward_gap = chosen_rewards.detach() - rejected_rewards.detach()
    return ((chosen - rejected) / eta - reward_gap) ** 2


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
             beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7) and conservative DPO (cDPO, Mitchell 2023), per pair (B,).

    ``loss = −(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)``: ε=0 is DPO; ε>0 assumes each label is flipped with probability ε.
    OpenRLHF's ``DPOLoss`` computes exactly this, as TRL's ``CPOTrainer`` does and TRL's DPO ``sigmoid`` did before
    its 2026 rewrite (trl#3906), which ignores ``label_smoothing``; TRL's ``robust`` uses it differently:
    ``[−(1−ε)logσ(βΔ) + ε·logσ(−βΔ)]/(1−2ε)``. logsigmoid keeps large |βΔ| finite.
    """
    _positive("beta", beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    logits = beta * (chosen - rejected)
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def dpo_norm_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_lengths,
                  rejected_lengths, beta: float) -> torch.Tensor:
    """Length-normalised DPO (Tulu 3, Lambert et al. 2024, §5.1.2, eq. 6; open-instruct's ``dpo_norm``), per pair
    (B,): ``−log σ(β·(Δc/|yc| − Δr/|yr|))`` with Δ = logπθ − logπref of each response, so each log-ratio is a mean
    over its tokens (policy and reference alike) and a long response weighs no more than a short one. β is on that
    per-token scale: Tulu 3 trains with β = 5 where DPO on sums takes 0.1."""
    _positive("beta", beta)
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    chosen = chosen / chosen_lengths.detach().to(chosen.dtype)
    rejected = rejected / rejected_lengths.detach().to(rejected.dtype)
    return -F.logsigmoid(beta * (chosen - rejected))


def ipo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
             beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17) on sequence log-ratios: ``(Δ − 1/(2β))²`` per pair (B,), as OpenRLHF.

    TRL length-normalises Δ (each log-ratio divided by its response length); we do not. For TRL's variant pass
    per-token-averaged log-probs (policy and reference alike).
    """
    _positive("beta", beta)
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return (chosen - rejected - 1.0 / (2.0 * beta)) ** 2


def simpo_loss(policy_chosen_logps, policy_rejected_logps, chosen_lengths, rejected_lengths,
               beta: float, gamma: float) -> torch.Tensor:
    """SimPO (Meng et al. 2024, eq. 6): reference-free, length-normalised, with a target margin γ; (B,).

    ``loss = −logσ(β·logπ(yw)/|yw| − β·logπ(yl)/|yl| − γ)``. The SimPO repo configures ``gamma_beta_ratio``
    instead, with γ = gamma_beta_ratio·β; here γ is passed directly.
    """
    _positive("beta", beta)
    chosen = policy_chosen_logps / chosen_lengths.detach().to(policy_chosen_logps.dtype)
    rejected = policy_rejected_logps / rejected_lengths.detach().to(policy_rejected_logps.dtype)
    return -F.logsigmoid(beta * (chosen - rejected) - gamma)


@dataclass(frozen=True)
class PairLossParams:
    """Hyperparameters of the pair losses (``algorithms.pairs.compute_pair_loss``); each loss reads only its own fields."""

    eta: float = 1.0  # REBEL: paper's η (Δ/η regressed onto the reward gap)
    beta: float = 0.1  # DPO/cDPO/IPO/SimPO β
    label_smoothing: float = 0.0  # cDPO ε in (0, 0.5); must be 0 for plain DPO
    gamma: float = 0.5  # SimPO target margin γ
    nll_coef: float = 0.0  # DPO family: α of the NLL term on the chosen response (RPO); 0 = none
    sft_coef: float = 1.0  # ORPO / CPO: weight of their own NLL term on the chosen response (CPO's α, ORPO's 1)


# The pair terms: (params, policy_chosen, policy_rejected, **the inputs the algorithm needs) -> (loss (B,), margin (B,),
# chosen log-ratio (B,), rejected log-ratio (B,)); ``algorithms/pairs.py`` registers each and dispatches on it.
def rebel_terms(p, pc, pr, ref_chosen_logps, ref_rejected_logps, chosen_rewards, rejected_rewards):
    c, r = _logratios(pc, pr, ref_chosen_logps, ref_rejected_logps)
    loss = rebel_loss(pc, pr, ref_chosen_logps, ref_rejected_logps, chosen_rewards, rejected_rewards, p.eta)
    return loss, (c - r) / p.eta, c, r


def rebel_gradient_scale(p) -> float:
    """REBEL's code minimises eta² times the paper's loss (see :func:`rebel_loss`): the trainer logs the paper's value
    and backpropagates this factor times its gradient."""
    return p.eta**2


def dpo_terms(p, pc, pr, ref_chosen_logps, ref_rejected_logps):
    if p.label_smoothing != 0.0:
        raise ValueError(f"loss_type 'dpo' got label_smoothing={p.label_smoothing}; use loss_type 'cdpo' for "
                         "label smoothing, or set label_smoothing=0")
    return _dpo_family(p, pc, pr, ref_chosen_logps, ref_rejected_logps, 0.0)


def cdpo_terms(p, pc, pr, ref_chosen_logps, ref_rejected_logps):
    if p.label_smoothing == 0.0:
        raise ValueError("loss_type 'cdpo' needs label_smoothing > 0 (e.g. 0.1); with 0 it is plain 'dpo'")
    return _dpo_family(p, pc, pr, ref_chosen_logps, ref_rejected_logps, p.label_smoothing)


def _dpo_family(p, pc, pr, ref_c, ref_r, eps):
    c, r = _logratios(pc, pr, ref_c, ref_r)
    return dpo_loss(pc, pr, ref_c, ref_r, p.beta, eps), p.beta * (c - r), c, r


def dpo_norm_terms(p, pc, pr, ref_chosen_logps, ref_rejected_logps, chosen_lengths, rejected_lengths):
    c, r = _logratios(pc, pr, ref_chosen_logps, ref_rejected_logps)
    c, r = c / chosen_lengths.detach().to(c.dtype), r / rejected_lengths.detach().to(r.dtype)
    loss = dpo_norm_loss(pc, pr, ref_chosen_logps, ref_rejected_logps, chosen_lengths, rejected_lengths, p.beta)
    return loss, p.beta * (c - r), c, r  # the per-token log-ratios, as open-instruct logs its rewards


def ipo_terms(p, pc, pr, ref_chosen_logps, ref_rejected_logps):
    c, r = _logratios(pc, pr, ref_chosen_logps, ref_rejected_logps)
    return ipo_loss(pc, pr, ref_chosen_logps, ref_rejected_logps, p.beta), p.beta * (c - r), c, r


def simpo_terms(p, pc, pr, chosen_lengths, rejected_lengths):
    c = pc / chosen_lengths.detach().to(pc.dtype)
    r = pr / rejected_lengths.detach().to(pr.dtype)
    return simpo_loss(pc, pr, chosen_lengths, rejected_lengths, p.beta, p.gamma), p.beta * (c - r), c, r


def orpo_loss(policy_chosen_logps, policy_rejected_logps, chosen_lengths, rejected_lengths, beta: float,
              sft_coef: float = 1.0) -> torch.Tensor:
    """ORPO (Hong et al. 2024, eq. 6-7), reference-free: the chosen response's NLL plus λ times the odds-ratio term,
    ``sft_coef · (−logπc/|yc|) − β · log σ(log odds(yc) − log odds(yr))``, where each response's probability is its
    mean token probability ``P = exp(logπ/|y|)`` and ``log odds = log P − log(1 − P)``. β is the paper's λ (TRL's
    ``ORPOConfig.beta``, default 0.1). As TRL's ``ORPOTrainer.odds_ratio_loss`` (``trl/experimental/orpo``), which
    subtracts ``β · mean(log σ(...))`` from the chosen cross-entropy; here per pair (the NLL normalised by the pair's
    own length), so the value does not depend on how a batch is cut."""
    _positive("beta", beta)
    c = policy_chosen_logps / chosen_lengths.detach().to(policy_chosen_logps.dtype)
    r = policy_rejected_logps / rejected_lengths.detach().to(policy_rejected_logps.dtype)
    # log(1 − exp(x)) for x < 0, accurate near 0. A mean log-prob of exactly 0 (an empty response, or one the model is
    # sure of) would give log 0 = −inf and a NaN gradient: x is kept below 0 by the dtype's smallest normal number,
    # so the odds are huge but finite (log odds ≈ 87 in float32), as is the gradient.
    tiny = torch.finfo(c.dtype).tiny
    log_odds = (c - r) - (torch.log(-torch.expm1(c.clamp(max=-tiny))) - torch.log(-torch.expm1(r.clamp(max=-tiny))))
    return sft_coef * -c - beta * F.logsigmoid(log_odds)


def cpo_loss(policy_chosen_logps, policy_rejected_logps, chosen_lengths, beta: float,
             sft_coef: float = 1.0) -> torch.Tensor:
    """CPO (Xu et al. 2024, eq. 3-5), reference-free: ``−log σ(β(logπc − logπr)) + sft_coef · (−logπc/|yc|)``, DPO's
    sigmoid on the policy's own sequence log-probs plus a behaviour-cloning NLL on the chosen response. As TRL's
    ``CPOTrainer`` with ``loss_type="sigmoid"`` and ``cpo_alpha`` (default 1.0; its NLL is the cross-entropy over the
    micro-batch's chosen tokens, here per pair)."""
    _positive("beta", beta)
    nll = -policy_chosen_logps / chosen_lengths.detach().to(policy_chosen_logps.dtype)
    return -F.logsigmoid(beta * (policy_chosen_logps - policy_rejected_logps)) + sft_coef * nll


def orpo_terms(p, pc, pr, chosen_lengths, rejected_lengths):
    c = pc / chosen_lengths.detach().to(pc.dtype)
    r = pr / rejected_lengths.detach().to(pr.dtype)
    loss = orpo_loss(pc, pr, chosen_lengths, rejected_lengths, p.beta, p.sft_coef)
    return loss, p.beta * (c - r), c, r  # the implicit rewards TRL logs: β · mean token log-prob


def cpo_terms(p, pc, pr, chosen_lengths, rejected_lengths):
    return cpo_loss(pc, pr, chosen_lengths, p.beta, p.sft_coef), p.beta * (pc - pr), pc, pr


# ---------------------------------------------------------------------------------------------------- KTO (unpaired)
#
# KTO trains on single responses, each labelled desirable or undesirable (``rlhf filter --mode unpaired``), not on
# pairs. Inputs are sequence log-probs (B,) as above, a bool ``desirable`` (B,), and the reference point z0, a scalar
# computed by :func:`kto_reference_point` over the mismatched (prompt, response) pairs of the whole optimizer step.


@dataclass(frozen=True)
class UnpairedLossParams:
    """Hyperparameters of the unpaired losses (``algorithms.unpaired.compute_unpaired_loss``)."""

    beta: float = 0.1  # KTO β (TRL's default)
    desirable_weight: float = 1.0  # λ_D
    undesirable_weight: float = 1.0  # λ_U


def kto_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0 (Ethayarajh et al. 2024, §4.1): ``max(0, mean_j(logπθ(y'_j|x_j) − logπref(y'_j|x_j)))``
    over mismatched pairs (x_j, y'_j), the response y'_j sampled for another prompt; a 0-dim tensor, detached.

    The paper's estimate of KL(πθ ‖ πref) on the batch, clamped at 0 and not backpropagated through; TRL computes the
    same (``trl/trainer/kto_trainer.py``, ``KTOTrainer._compute_loss``: ``(KL_logps − ref_KL_logps).mean()``,
    averaged over processes, ``.clamp(min=0)``, detached). Where TRL averages over each process's micro-batch, the
    caller here passes every mismatched pair of the optimizer step (``unpaired.UnpairedTask.begin_step``), so z0
    does not depend on how the step is cut into micro-batches or processes.
    """
    if policy_kl_logps.shape != ref_kl_logps.shape or policy_kl_logps.dim() != 1 or policy_kl_logps.numel() == 0:
        raise ValueError(f"policy_kl_logps {tuple(policy_kl_logps.shape)} and ref_kl_logps "
                         f"{tuple(ref_kl_logps.shape)} must be the same non-empty (N,) sequence log-probs")
    return (policy_kl_logps.detach() - ref_kl_logps.detach()).mean().clamp(min=0)


def kto_loss(policy_logps, ref_logps, desirable, reference_point, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 7-8) per response (B,), with r = logπθ(y|x) − logπref(y|x) and z0 given::

        desirable:    λ_D · (1 − σ(β·(r − z0)))
        undesirable:  λ_U · (1 − σ(β·(z0 − r)))

    the paper's ``λ_y − v(x, y)`` and TRL's per-example losses (``trl/trainer/kto_trainer.py``,
    ``KTOTrainer._compute_loss``, ``loss_type="kto"``; up to TRL 0.2x the method ``KTOTrainer.kto_loss``), whose mean
    over the batch, both classes together, is the loss (TRL's ``losses.nanmean()``). ``1 − σ(x)`` is computed as
    ``σ(−x)``, the same number without the cancellation near 1. z0 (``reference_point``, from
    :func:`kto_reference_point`) is a constant: no gradient flows through it or the reference log-probs.
    """
    _positive("beta", beta)
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(f"desirable_weight and undesirable_weight must be >= 0, got {desirable_weight} and "
                         f"{undesirable_weight}")
    if desirable.shape != policy_logps.shape or ref_logps.shape != policy_logps.shape:
        raise ValueError(f"desirable {tuple(desirable.shape)} and ref_logps {tuple(ref_logps.shape)} must have the "
                         f"shape of policy_logps {tuple(policy_logps.shape)}")
    logratio = policy_logps - ref_logps.detach()
    z0 = torch.as_tensor(reference_point, dtype=logratio.dtype, device=logratio.device).detach()
    if z0.dim() != 0:
        raise ValueError(f"reference_point must be a scalar (one z0 per optimizer step), got shape {tuple(z0.shape)}")
    chosen = desirable_weight * torch.sigmoid(-beta * (logratio - z0))
    rejected = undesirable_weight * torch.sigmoid(-beta * (z0 - logratio))
    return torch.where(desirable.bool(), chosen, rejected)


# The unpaired terms: (params, policy_logps, ref_logps, desirable, reference_point) -> (loss (B,), margin (B,),
# log-ratio (B,)); the margin is β·(r − z0) on the side the label asks for (> 0: the response is where KTO wants it).
def kto_terms(p, policy_logps, ref_logps, desirable, reference_point):
    loss = kto_loss(policy_logps, ref_logps, desirable, reference_point, p.beta, p.desirable_weight,
                    p.undesirable_weight)
    logratio = policy_logps - ref_logps.detach()
    sign = torch.where(desirable.bool(), 1.0, -1.0).to(logratio.dtype)
    return loss, sign * p.beta * (logratio - reference_point), logratio


# ---------------------------------------------------------------------------------------------------- PPO family
#
# Conventions for this section (they differ from the pairwise losses above):
#
# - Inputs are PER-TOKEN tensors over response tokens: (B, T) right-padded, or flat (N,) (e.g. packed). ``mask`` has
#   the same shape, bool or 0/1 (any non-zero entry counts as a real token). Masked positions never reach a result:
#   they are selected out with ``torch.where`` before any arithmetic, so padding may hold anything (TRL fills it
#   with ``INVALID_LOGPROB = 1.0``; NaN is fine too) and gets exactly zero gradient.
# - Each loss returns ``(scalar loss, dict of detached scalar metrics)``. Metrics are always means over the real
#   tokens of the batch, whatever the reduction of the loss.
# - ``reduction="token"`` (default): mean over all real tokens of the batch (OpenRLHF ``token_level_loss=True``,
#   TRL GRPO ``loss_type="bnpo"``). ``reduction="sequence"``: mean over each sequence's real tokens, then over the
#   sequences (the GRPO paper's 1/G Σ_i 1/|o_i| Σ_t; TRL ``loss_type="grpo"``, OpenRLHF ``token_level_loss=False``);
#   (B, T) only. A sequence with no real token counts as a 0-loss row of that mean, as in TRL, so that the mean over
#   a step's rows is the same however they are split into micro-batches. An all-masked batch gives loss 0, not NaN.
#   ``"sequence_sum_norm"`` (Dr. GRPO) and ``"sum"`` (for a caller's own normaliser): see ``ppo_policy_loss``.
# - Old log-probs, advantages, old values, returns and reference log-probs are constants: detached here.


_REDUCTIONS = ("token", "sequence", "sequence_sum_norm", "sum")
_IMPORTANCE_LEVELS = ("token", "sequence")


def _ppo_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but the per-token inputs have {tuple(like.shape)}; "
                         "pass one mask entry per token")
    return mask if mask.dtype == torch.bool else mask != 0


def _same_shape(like: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.shape != like.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; every per-token input must have shape "
                             f"{tuple(like.shape)}")


def _reduce(per_token: torch.Tensor, m: torch.Tensor, reduction: str, max_tokens: int | None = None) -> torch.Tensor:
    if reduction == "token":
        return masked_mean(per_token, m)
    if reduction == "sum":
        return torch.where(m, per_token, 0).sum()
    if reduction in ("sequence", "sequence_sum_norm"):
        if per_token.dim() != 2:
            raise ValueError(f"reduction={reduction!r} needs (B, T) inputs, got shape {tuple(per_token.shape)}; "
                             "use reduction='token' for flat (N,) tokens")
        if reduction == "sequence":
            per_sequence = masked_mean(per_token, m, dim=-1)  # (B,)
        else:
            if max_tokens is None or max_tokens < 1:
                raise ValueError(f"reduction='sequence_sum_norm' needs max_tokens >= 1, got {max_tokens}")
            per_sequence = torch.where(m, per_token, 0).sum(dim=-1) / max_tokens
        # a sequence with no real token is a 0-loss row of the mean (masked_mean gave it 0), as in TRL: the trainer
        # weighs a micro-batch by its rows, so leaving it out would make the update depend on how the step is split
        return per_sequence.sum() / max(per_sequence.numel(), 1)
    raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


# The metrics the policy and value losses below return as means over the real tokens of their input (a micro-batch):
# a trainer weighs them by each micro-batch's tokens when it averages over a step (``layout.METRIC_WEIGHT``).
TOKEN_MEAN_METRICS = frozenset({"clip_frac", "approx_kl", "ratio_mean", "gate_mean"})


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip: float, reduction: str = "token", *, clip_high: float | None = None,
                    importance: str = "token", max_tokens: int | None = None,
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise; used by PPO, GRPO, RLOO,
    REINFORCE++, and with the options below by DAPO, Dr. GRPO and GSPO.

    Per token, with ``ρ = exp(logp − old_logp)``: ``max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))``, then reduced over
    the real tokens. ``clip`` is ε_low; ``clip_high`` is ε_high (default ``clip``: symmetric). DAPO's clip-higher
    (Yu et al. 2025, §3.1) raises ε_high (0.28 against ε_low 0.2) so that low-probability tokens with A > 0 can grow;
    as TRL's ``epsilon``/``epsilon_high`` (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``) and
    OpenRLHF's ``PolicyLoss(clip_eps_low, clip_eps_high)`` (``openrlhf/models/loss.py``).

    ``importance="sequence"`` is GSPO (Zheng et al. 2025, eq. 5-7): one ratio per sequence,
    ``s = exp(mean_t(logp − old_logp))`` over its real tokens, clipped as above and given to every token of the
    sequence (its gradient spreads 1/|y| over the tokens' log-probs). Same as TRL's
    ``importance_sampling_level="sequence"`` (a (B, 1) log-weight broadcast over the tokens); (B, T) only.

    Reductions (see the section conventions): ``"token"`` mean over the real tokens of the input; ``"sequence"``
    mean over each sequence's tokens, then over the sequences (the GRPO paper; TRL ``loss_type="grpo"``);
    ``"sequence_sum_norm"`` each sequence's token sum over the constant ``max_tokens`` (the generation's token limit),
    then the mean over the sequences: Dr. GRPO (Liu et al. 2025, §3.1), TRL ``loss_type="dr_grpo"``, which divides
    the batch's token sum by ``B · max_completion_length``; ``"sum"`` the plain token sum, for a caller that
    divides by a count over more than this input (DAPO's token mean over the whole step, TRL ``loss_type="dapo"``).

    ``logp`` (B, T) or (N,) are the current policy's token log-probs (the gradient flows into them); ``old_logp``
    are the sampling policy's, same shape; ``advantages`` are per token, same shape, or per sequence (B,) for (B, T)
    inputs (GRPO/RLOO), broadcast over the tokens.

    Where the clipped branch is strictly larger (A > 0 and ρ > 1+ε_high, or A < 0 and ρ < 1−ε_low) the token's
    gradient is 0. On-policy (ρ = 1) the gradient is ``−A·∇logp`` per token (over the token count for ``"token"``).

    Metrics (detached scalars, means over real tokens): ``clip_frac``, the fraction of tokens where the clipped
    branch is strictly larger (TRL's ``clip_ratio/region_mean``; OpenRLHF's ``surr2 < surr1``); ``approx_kl``, the
    k3 estimate of KL(old ‖ new) from the sampled tokens' own ratios, ``ρ − 1 − log ρ`` (≥ 0; see ``kl_k3``);
    ``ratio_mean``, the mean of the ratio the loss used (per sequence for GSPO, counted once per token).
    """
    _positive("clip", clip)
    clip_high = clip if clip_high is None else clip_high
    _positive("clip_high", clip_high)
    if importance not in _IMPORTANCE_LEVELS:
        raise ValueError(f"importance must be one of {_IMPORTANCE_LEVELS}, got {importance!r}")
    m = _ppo_mask(mask, logp)
    _same_shape(logp, old_logp=old_logp)
    advantages = advantages.detach()
    if advantages.shape != logp.shape:
        if logp.dim() == 2 and advantages.shape == logp.shape[:1]:
            advantages = advantages.unsqueeze(-1).expand_as(logp)  # one advantage per sequence → every token
        else:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected per-token "
                             f"{tuple(logp.shape)} or, for (B, T) inputs, per-sequence ({logp.shape[0]},)")
    token_log_ratio = torch.where(m, logp - old_logp.detach(), 0)  # padding → ρ = 1, finite whatever it held
    if importance == "sequence":
        if logp.dim() != 2:
            raise ValueError(f"importance='sequence' needs (B, T) inputs, got shape {tuple(logp.shape)}")
        log_ratio = masked_mean(token_log_ratio, m, dim=-1).unsqueeze(-1).expand_as(logp)
    else:
        log_ratio = token_log_ratio
    adv = torch.where(m, advantages, 0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = _reduce(per_token, m, reduction, max_tokens)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).to(per_token.dtype), m),
            # k3 of KL(old‖new) per token: ρ − 1 − log ρ
            "approx_kl": masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, m),
            "ratio_mean": masked_mean(ratio, m),
        }
    return loss, metrics


def _per_token_advantages(advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    advantages = advantages.detach()
    if advantages.shape == logp.shape:
        return advantages
    if logp.dim() == 2 and advantages.shape == logp.shape[:1]:
        return advantages.unsqueeze(-1).expand_as(logp)  # one advantage per sequence → every token
    raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected per-token {tuple(logp.shape)} or, for "
                     f"(B, T) inputs, per-sequence ({logp.shape[0]},)")


def _token_ratios(logp, old_logp, advantages, mask):
    """(mask as bool, per-token advantages (0 on padding), log ρ (0 on padding), ρ) of a per-token policy loss."""
    m = _ppo_mask(mask, logp)
    _same_shape(logp, old_logp=old_logp)
    adv = torch.where(m, _per_token_advantages(advantages, logp), 0)
    token_log_ratio = torch.where(m, logp - old_logp.detach(), 0)  # padding → ρ = 1, finite whatever it held
    return m, adv, token_log_ratio, torch.exp(token_log_ratio)


def _ratio_metrics(m, token_log_ratio, ratio) -> dict[str, torch.Tensor]:
    """``approx_kl`` (k3 of KL(old ‖ new) from the sampled tokens' ratios, ρ − 1 − log ρ) and ``ratio_mean``."""
    return {"approx_kl": masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, m),
            "ratio_mean": masked_mean(ratio, m)}


def cispo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      max_weight: float, reduction: str = "token", *, max_tokens: int | None = None,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5): REINFORCE weighted by the clipped importance ratio with its
    gradient stopped, ``−sg(min(ρ, max_weight)) · A · logp`` per token. Unlike the clipped surrogate no token's
    gradient is dropped: a clipped ratio only caps the token's weight. As TRL's ``loss_type="cispo"``
    (``clamp(coef_1, max=epsilon_high).detach() · advantages · per_token_logps``, ``epsilon_high`` being the cap
    itself, 5.0 recommended after ScaleRL). Metrics: ``clip_frac`` (tokens whose weight was capped), ``approx_kl``,
    ``ratio_mean``, as :func:`ppo_policy_loss`."""
    _positive("max_weight", max_weight)
    m, adv, token_log_ratio, ratio = _token_ratios(logp, old_logp, advantages, mask)
    weight = ratio.clamp(max=max_weight).detach()
    per_token = -weight * adv * torch.where(m, logp, 0)
    loss = _reduce(per_token, m, reduction, max_tokens)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((ratio > max_weight).to(per_token.dtype), m),
                   **_ratio_metrics(m, token_log_ratio, ratio)}
    return loss, metrics


def sapo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     temperature_pos: float, temperature_neg: float, reduction: str = "token", *,
                     max_tokens: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft gate instead of the hard clip, per token
    ``−A · σ(τ(ρ − 1)) · 4/τ`` with ``τ = temperature_pos`` where A > 0, ``temperature_neg`` elsewhere. At ρ = 1 its
    gradient is the plain policy gradient ``−A·∇logp``; away from 1 it fades smoothly (``4σ(1−σ)·ρ`` times it)
    instead of dropping to 0. As TRL's ``loss_type="sapo"`` (``sapo_temperature_pos`` 1.0, ``sapo_temperature_neg``
    1.05). Metrics: ``gate_mean`` (the mean of ``4σ(1−σ)``, the gate's factor on each token's gradient, which ρ
    multiplies: 1 on-policy), ``approx_kl``, ``ratio_mean``."""
    _positive("temperature_pos", temperature_pos)
    _positive("temperature_neg", temperature_neg)
    m, adv, token_log_ratio, ratio = _token_ratios(logp, old_logp, advantages, mask)
    tau = torch.where(adv > 0, adv.new_tensor(temperature_pos), adv.new_tensor(temperature_neg))
    gate = torch.sigmoid(tau * (ratio - 1))
    per_token = -adv * gate * 4 / tau
    loss = _reduce(per_token, m, reduction, max_tokens)
    with torch.no_grad():
        metrics = {"gate_mean": masked_mean(4 * gate * (1 - gate), m), **_ratio_metrics(m, token_log_ratio, ratio)}
    return loss, metrics


def sppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              reduction: str = "sequence", *, max_tokens: int | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SPPO (Wu et al. 2024, eq. 3.5 / Algorithm 1): regress each response's sequence log-ratio to the policy it was
    sampled from onto its target, ``(log π(y|x) − log π_t(y|x) − η(P(y ≻ π_t | x) − 1/2))²``; the caller puts
    ``η(P − 1/2)`` in ``targets`` (per sequence (B,), or per token with the same value on every token of a sequence,
    of which the first is read). One squared error per sequence, whatever ``reduction`` (they are averaged over the
    sequences, an empty response counting as 0; ``"sum"`` sums them for a caller that divides by a count over more
    than this input). Metrics: ``logratio_mean`` (the mean sequence log-ratio), ``target_mean``."""
    m = _ppo_mask(mask, logp)
    _same_shape(logp, old_logp=old_logp)
    if logp.dim() != 2:
        raise ValueError(f"sppo_loss needs (B, T) inputs, got shape {tuple(logp.shape)}")
    targets = targets.detach()
    if targets.shape == logp.shape:  # per token: the first of each row (none in a batch of empty responses)
        targets = targets[:, 0] if logp.shape[1] else targets.new_zeros(logp.shape[:1])
    if targets.shape != logp.shape[:1]:
        raise ValueError(f"targets has shape {tuple(targets.shape)}; expected ({logp.shape[0]},) or {tuple(logp.shape)}")
    logratio = torch.where(m, logp - old_logp.detach(), 0).sum(dim=-1)  # (B,)
    per_sequence = (logratio - targets) ** 2
    has_tokens = m.any(dim=-1)
    loss = torch.where(has_tokens, per_sequence, 0).sum()  # an empty response: a 0-loss row, as in _reduce
    if reduction != "sum":
        loss = loss / max(per_sequence.numel(), 1)
    with torch.no_grad():
        metrics = {"logratio_mean": masked_mean(logratio, has_tokens), "target_mean": masked_mean(targets, has_tokens)}
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = None, reduction: str = "token") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO critic loss: ``0.5·max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²)`` reduced over real tokens.

    ``values`` (B, T) or (N,) are the critic's current predictions (the gradient flows into them); ``old_values``
    are its predictions at rollout time and ``returns`` the targets (``advantages.gae``'s second output), same
    shape. ``clip=None`` gives the plain ``0.5·(V − R)²``. Same as OpenRLHF's ``ValueLoss`` (which writes the clip
    as ``V_old + clamp(V − V_old, −ε, ε)``, the same number) and TRL's PPO value loss.

    Where the clipped term is strictly larger the token's gradient is 0: the critic is not pushed further than ε
    from its rollout-time value in one update. Metric: ``clip_frac``, the fraction of real tokens where that
    happens (TRL's ``vf_clipfrac``; 0 when unclipped).
    """
    m = _ppo_mask(mask, values)
    _same_shape(values, old_values=old_values, returns=returns)
    v = torch.where(m, values, 0)
    old = torch.where(m, old_values.detach(), 0)
    target = torch.where(m, returns.detach(), 0)
    unclipped = (v - target) ** 2
    if clip is None:
        per_token = unclipped
        clip_active = torch.zeros_like(m)
    else:
        _positive("clip", clip)
        v_clipped = old + (v - old).clamp(-clip, clip)
        clipped = (v_clipped - target) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = 0.5 * _reduce(per_token, m, reduction)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean(clip_active.to(per_token.dtype), m)}
    return loss, metrics


# KL estimators (Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html), per token.
#
# With tokens sampled from π (the policy whose log-probs are ``logp``) and log_ratio = logp − ref_logp, each is an
# estimator of KL(π ‖ ref) = E_π[log π − log ref]:
#   k1 = log_ratio                            unbiased; any sign (one token can be negative)
#   k2 = log_ratio² / 2                       biased (exact to second order for nearby policies); always ≥ 0
#   k3 = exp(−log_ratio) − 1 + log_ratio      unbiased; always ≥ 0. (= (r − 1) − log r with r = ref/π; computed
#                                             with expm1 so tiny ratios stay ≥ 0 instead of cancelling to −1e−17)
# For nearby π and ref, k2 and k3 have far lower variance than k1 (second order in the log-ratio, k1 first order).
# Far apart, k3 can have the HIGHER variance: r is large on tokens ref likes much more than π does.
# Unbiasedness needs tokens sampled from π itself: with tokens from another policy (e.g. the rollout policy after
# some updates) each needs the importance weight π/π_old.
# Used as a LOSS and differentiated through logp (GRPO adds β·k3 to the per-token loss), their on-policy expected
# gradients differ from their values: E_π[∇k1] = 0, E_π[∇k2] = ∇KL(π ‖ ref), E_π[∇k3] = ∇KL(ref ‖ π) (the
# forward KL). As a reward penalty (PPO, RLOO, REINFORCE++) no gradient goes through them.
# Peers: OpenRLHF ``compute_approx_kl`` (k1/k2/k3 as here); TRL GRPO uses k3 in the loss; TRL RLOO and PPO use k1
# in the reward (PPO optionally k3).


def _kl_log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp has shape {tuple(ref_logp.shape)} but logp has {tuple(logp.shape)}; both are "
                         "per-token log-probs of the same tokens")
    return logp - ref_logp.detach()


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp − ref_logp per token: unbiased estimate of KL(π ‖ ref) under π's samples; can be negative."""
    return _kl_log_ratio(logp, ref_logp)


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (logp − ref_logp)²/2 per token: biased estimate of KL(π ‖ ref), always ≥ 0."""
    return _kl_log_ratio(logp, ref_logp) ** 2 / 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp − logp) − 1 + (logp − ref_logp) per token: unbiased estimate of KL(π ‖ ref), always ≥ 0."""
    log_ratio = _kl_log_ratio(logp, ref_logp)
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL(π ‖ ref) estimate of the given ``kind`` ("k1", "k2" or "k3"); see ``kl_k1``/``kl_k2``/``kl_k3``."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kind must be one of {sorted(KL_ESTIMATORS)}, got {kind!r}")
    return KL_ESTIMATORS[kind](logp, ref_logp)
