"""Pairwise preference losses (REBEL, DPO, cDPO, IPO, SimPO) as pure functions of tensors. Imports torch only.

Conventions shared by every function here:

- Every ``*_logps`` is a SEQUENCE log-prob: the sum of per-token log-probs over the response tokens, shape (B,).
  ``*_lengths`` are response token counts, shape (B,); ``*_rewards`` are scalar rewards, shape (B,).
- Every loss returns a per-example loss of shape (B,); the trainer takes the mean (or a weighted sum).
- Gradients flow to the policy log-probs only. Reference log-probs, rewards and lengths are constants: they are
  detached here, so passing a tensor that still has a graph cannot leak gradient into the reference model.
- The dtype follows torch's promotion rules: float64 in gives float64 out; nothing is cast down.

Δ below always means ``(πc − refc) − (πr − refr)``: the chosen log-ratio minus the rejected log-ratio.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    the trainer (``stages.train.PairTask``) backpropagates REBEL's form, because Adam is invariant to the constant
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
    OpenRLHF's ``DPOLoss`` computes exactly this. TRL's ``sigmoid`` ignores ``label_smoothing``, and TRL's
    ``robust`` uses it differently: ``[−(1−ε)logσ(βΔ) + ε·logσ(−βΔ)]/(1−2ε)``. logsigmoid keeps large |βΔ| finite.
    """
    _positive("beta", beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    logits = beta * (chosen - rejected)
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


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


class LossType(str, enum.Enum):
    """Which pairwise loss to train with; the properties decide what the trainer computes and passes."""

    REBEL = "rebel"
    DPO = "dpo"
    CDPO = "cdpo"
    IPO = "ipo"
    SIMPO = "simpo"

    @property
    def needs_reference(self) -> bool:
        """Whether reference (REBEL: generating-policy π_t) log-probs are needed; SimPO is reference-free."""
        return self is not LossType.SIMPO

    @property
    def uses_rewards(self) -> bool:
        """Whether scalar rewards enter the loss (REBEL regresses onto the reward gap; DPO-family uses labels only)."""
        return self is LossType.REBEL

    @property
    def length_normalized(self) -> bool:
        """Whether the loss divides log-probs by response length (needs ``*_lengths``)."""
        return self is LossType.SIMPO

    @property
    def default_logp_temperature_is_sampling(self) -> bool:
        """REBEL's code computes policy and π_t log-probs at the sampling temperature (logits / 0.8);
        the DPO family scores at temperature 1.0."""
        return self is LossType.REBEL


@dataclass(frozen=True)
class PairLossParams:
    """Hyperparameters for ``compute_pair_loss``; each loss reads only its own fields."""

    eta: float = 1.0  # REBEL: paper's η (Δ/η regressed onto the reward gap)
    beta: float = 0.1  # DPO/cDPO/IPO/SimPO β
    label_smoothing: float = 0.0  # cDPO ε in (0, 0.5); must be 0 for plain DPO
    gamma: float = 0.5  # SimPO target margin γ


# Each entry: (params, policy_chosen, policy_rejected, **needed inputs) -> (loss, margin, chosen_lr, rejected_lr).
def _rebel(p, pc, pr, ref_chosen_logps, ref_rejected_logps, chosen_rewards, rejected_rewards):
    c, r = _logratios(pc, pr, ref_chosen_logps, ref_rejected_logps)
    loss = rebel_loss(pc, pr, ref_chosen_logps, ref_rejected_logps, chosen_rewards, rejected_rewards, p.eta)
    return loss, (c - r) / p.eta, c, r


def _dpo(p, pc, pr, ref_chosen_logps, ref_rejected_logps):
    if p.label_smoothing != 0.0:
        raise ValueError(f"loss_type 'dpo' got label_smoothing={p.label_smoothing}; use loss_type 'cdpo' for "
                         "label smoothing, or set label_smoothing=0")
    return _dpo_family(p, pc, pr, ref_chosen_logps, ref_rejected_logps, 0.0)


def _cdpo(p, pc, pr, ref_chosen_logps, ref_rejected_logps):
    if p.label_smoothing == 0.0:
        raise ValueError("loss_type 'cdpo' needs label_smoothing > 0 (e.g. 0.1); with 0 it is plain 'dpo'")
    return _dpo_family(p, pc, pr, ref_chosen_logps, ref_rejected_logps, p.label_smoothing)


def _dpo_family(p, pc, pr, ref_c, ref_r, eps):
    c, r = _logratios(pc, pr, ref_c, ref_r)
    return dpo_loss(pc, pr, ref_c, ref_r, p.beta, eps), p.beta * (c - r), c, r


def _ipo(p, pc, pr, ref_chosen_logps, ref_rejected_logps):
    c, r = _logratios(pc, pr, ref_chosen_logps, ref_rejected_logps)
    return ipo_loss(pc, pr, ref_chosen_logps, ref_rejected_logps, p.beta), p.beta * (c - r), c, r


def _simpo(p, pc, pr, chosen_lengths, rejected_lengths):
    c = pc / chosen_lengths.detach().to(pc.dtype)
    r = pr / rejected_lengths.detach().to(pr.dtype)
    return simpo_loss(pc, pr, chosen_lengths, rejected_lengths, p.beta, p.gamma), p.beta * (c - r), c, r


_DISPATCH = {LossType.REBEL: _rebel, LossType.DPO: _dpo, LossType.CDPO: _cdpo, LossType.IPO: _ipo,
             LossType.SIMPO: _simpo}


def compute_pair_loss(loss_type: LossType | str, params: PairLossParams, policy_chosen_logps: torch.Tensor,
                      policy_rejected_logps: torch.Tensor, ref_chosen_logps=None, ref_rejected_logps=None,
                      chosen_rewards=None, rejected_rewards=None, chosen_lengths=None,
                      rejected_lengths=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-example loss (B,) and detached per-example metrics (B,) for one batch of pairs.

    Metrics: ``margin`` is the implicit reward margin (β·Δ for DPO/cDPO/IPO; Δ/eta for REBEL, the quantity
    regressed onto rc − rr; β·(logπc/|yc| − logπr/|yr|) for SimPO); ``accuracy`` is 1.0 where margin > 0
    (REBEL's "sign_align"); ``chosen_logratio``/``rejected_logratio`` are π − ref (SimPO: length-normalised logps).
    """
    loss_type = LossType(loss_type)
    given = dict(ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
                 chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
                 chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    needed = ((["ref_chosen_logps", "ref_rejected_logps"] if loss_type.needs_reference else [])
              + (["chosen_rewards", "rejected_rewards"] if loss_type.uses_rewards else [])
              + (["chosen_lengths", "rejected_lengths"] if loss_type.length_normalized else []))
    missing = [name for name in needed if given[name] is None]
    if missing:
        raise ValueError(f"loss_type '{loss_type.value}' needs {', '.join(missing)}, but got None")
    shape = policy_chosen_logps.shape
    for name, t in [("policy_rejected_logps", policy_rejected_logps)] + [(n, given[n]) for n in needed]:
        if policy_chosen_logps.dim() != 1 or t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; every input must be 1-D sequence-level, "
                             f"shape (B,) like policy_chosen_logps {tuple(shape)}")
    loss, margin, chosen, rejected = _DISPATCH[loss_type](
        params, policy_chosen_logps, policy_rejected_logps, **{name: given[name] for name in needed})
    margin = margin.detach()
    metrics = {"margin": margin, "accuracy": (margin > 0).to(margin.dtype),
               "chosen_logratio": chosen.detach(), "rejected_logratio": rejected.detach()}
    return loss, metrics
