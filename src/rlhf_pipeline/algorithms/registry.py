"""Every algorithm ``rlhf train`` runs, in one registry: each list, choice, default and dispatch is derived from it.

An algorithm trains on pairs (``rlhf filter --mode pairs``: REBEL and the DPO family), on groups (``--mode
groups``: the PPO family), on unpaired responses (``--mode unpaired``: KTO) or on each prompt's best response
(``--mode best``: rejection sampling). Its entry says what the trainer computes for it:

- :class:`PairAlgorithm`: the pair loss (a pure function of sequence log-probs, see ``losses.py``), whether it needs
  reference log-probs (the once-per-dataset pass), the rewards or the response lengths, at which temperature
  log-probs are taken, and its default hyperparameters;
- :class:`GroupAlgorithm`: the group baseline applied to each prompt's rewards (or none), how per-token advantages
  come from the token rewards (``advantages.py``), and whether it trains a critic.
- :class:`UnpairedAlgorithm`: the loss on labelled single responses, given the reference point z0 that the trainer
  estimates per optimizer step from mismatched (prompt, response) pairs (``unpaired.py``).
- :class:`SupervisedAlgorithm`: supervised fine-tuning on selected responses' sampled token ids
  (``supervised.py``): RAFT / rejection-sampling fine-tuning.

Each carries the options that make ``rlhf demo`` learn with it. ``rlhf train --algo``, ``rlhf iterate`` and
``rlhf demo`` take their choices from :data:`ALGORITHMS`, the filter mode from :attr:`data`, and the trainer
dispatches on the entry, so a new algorithm is one entry here (plus its pure function and its test):

    register(PairAlgorithm(name="my_loss", loss=my_pair_terms, needs_reference=True, help="..."))

Imports nothing heavy: the loss and advantage functions are named by module attribute and resolved on first use, so
reading the registry (a stage's ``--help``) does not import torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

PAIRS, GROUPS = "pairs", "groups"
UNPAIRED = "unpaired"  # single responses labelled desirable / undesirable (KTO)
BEST = "best"  # each prompt's best response, as SFT data (rejection sampling)


def _resolve(fn: Callable | str) -> Callable:
    """A function, or ``"module:attribute"`` imported now."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class PairAlgorithm:
    """A loss on (chosen, rejected) pairs.

    ``loss(params, policy_chosen, policy_rejected, **inputs) -> (loss (B,), margin (B,), chosen (B,), rejected (B,))``
    receives the inputs its flags ask for: ``ref_chosen_logps``/``ref_rejected_logps`` (``needs_reference``),
    ``chosen_rewards``/``rejected_rewards`` (``uses_rewards``), ``chosen_lengths``/``rejected_lengths``
    (``length_normalized``). ``margin`` is the implicit reward margin its ``reward/*_margin`` and ``*_accuracy``
    metrics report; ``chosen``/``rejected`` are the log-ratios (or what stands for them) logged as ``logp/*``.
    """

    name: str
    loss: Callable | str
    help: str
    needs_reference: bool = True
    uses_rewards: bool = False
    length_normalized: bool = False
    logp_at_sampling_temperature: bool = False  # REBEL's code takes log-probs at the sampling temperature
    defaults: dict[str, Any] = field(default_factory=dict)  # PairLossParams fields that differ from its defaults
    demo: dict[str, Any] = field(default_factory=dict)  # rlhf train options that make rlhf demo learn
    filter: dict[str, Any] = field(default_factory=dict)  # rlhf filter options that iterate and demo pass
    # params -> factor on the gradient only (the logged loss keeps its value); REBEL backpropagates its code's form
    gradient_scale: Callable | str | None = None
    data: str = PAIRS
    uses_critic = False  # (not a field) pair losses train the policy alone

    def loss_fn(self) -> Callable:
        return _resolve(self.loss)

    def gradient_scale_fn(self) -> Callable:
        return _resolve(self.gradient_scale)


@dataclass(frozen=True)
class GroupAlgorithm:
    """A policy-gradient algorithm on groups of n responses per prompt (the PPO family's clipped surrogate).

    ``baseline(rewards (1, G), params) -> scores (1, G)`` turns one prompt's rewards into the scores its responses
    are credited with (None: the reward itself). ``advantages(token_rewards (B, T), mask, values, params) ->
    (advantages, returns or None)`` turns the token rewards (the score on the last token, minus the KL penalty per
    token when it is in the reward) into per-token advantages; ``values`` are the critic's when ``uses_critic``.
    ``params`` is ``groups.RLParams``. ``defaults`` are the ``RLParams`` fields that differ for this algorithm
    (``rlhf train`` options left unset take them); ``filter`` are ``rlhf filter`` options that ``rlhf iterate`` and
    ``rlhf demo`` pass for it (DAPO's removal of groups with equal rewards, say).
    """

    name: str
    advantages: Callable | str
    help: str
    baseline: Callable | str | None = None
    uses_critic: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)
    filter: dict[str, Any] = field(default_factory=dict)
    demo: dict[str, Any] = field(default_factory=dict)
    data: str = GROUPS

    def advantages_fn(self) -> Callable:
        return _resolve(self.advantages)

    def baseline_fn(self) -> Callable | None:
        return None if self.baseline is None else _resolve(self.baseline)


@dataclass(frozen=True)
class UnpairedAlgorithm:
    """A loss on single responses labelled desirable or undesirable (``rlhf filter --mode unpaired``): KTO.

    ``loss(params, policy_logps, ref_logps, desirable, reference_point) -> (loss (B,), margin (B,), logratio (B,))``
    takes the responses' sequence log-probs, their reference log-probs (the once-per-dataset pass, as for DPO), the
    labels and the reference point z0, which the trainer estimates once per optimizer step from the step's mismatched
    (prompt, response) pairs (``unpaired.UnpairedTask``). ``params`` is ``losses.UnpairedLossParams``; ``defaults``
    are its fields that differ for this algorithm.
    """

    name: str
    loss: Callable | str
    help: str
    defaults: dict[str, Any] = field(default_factory=dict)
    demo: dict[str, Any] = field(default_factory=dict)
    filter: dict[str, Any] = field(default_factory=dict)
    data: str = UNPAIRED
    needs_reference = True  # (not fields) the log-ratios need the reference pass; no rewards, no critic
    uses_rewards = False
    uses_critic = False
    logp_at_sampling_temperature = False  # 1.0, as the DPO family

    def loss_fn(self) -> Callable:
        return _resolve(self.loss)


@dataclass(frozen=True)
class SupervisedAlgorithm:
    """Supervised fine-tuning on selected responses (``rlhf filter --mode best``: each prompt's highest-reward
    response), the mean NLL of their sampled token ids (``supervised.SFTTask``): rejection-sampling fine-tuning."""

    name: str
    help: str
    demo: dict[str, Any] = field(default_factory=dict)
    filter: dict[str, Any] = field(default_factory=dict)
    data: str = BEST
    needs_reference = False  # (not fields) no reference pass, no rewards in the loss, no critic
    uses_rewards = False
    uses_critic = False
    logp_at_sampling_temperature = False


Algorithm = Union[PairAlgorithm, GroupAlgorithm, UnpairedAlgorithm, SupervisedAlgorithm]
ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add an algorithm (a name may be registered once)."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Algorithm:
    """The algorithm called ``name``, or a ValueError that lists them."""
    if name not in ALGORITHMS:
        raise ValueError(f"--algo {name}: unknown algorithm; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def names(data: str | None = None) -> tuple[str, ...]:
    """Registered names, all or those training on ``data`` (PAIRS or GROUPS), in registration order."""
    return tuple(n for n, a in ALGORITHMS.items() if data is None or a.data == data)


def help_text() -> str:
    """One line per algorithm, for ``--algo``'s help."""
    return "; ".join(f"{a.name} ({a.data}): {a.help}" for a in ALGORITHMS.values())


# ----------------------------------------------------------------------------------------------------------------
# Pair losses: dispatch and input checks


def compute_pair_loss(algorithm: PairAlgorithm | str, params, policy_chosen_logps, policy_rejected_logps,
                      ref_chosen_logps=None, ref_rejected_logps=None, chosen_rewards=None, rejected_rewards=None,
                      chosen_lengths=None, rejected_lengths=None):
    """Per-example loss (B,) and detached per-example metrics (B,) for one batch of pairs.

    Metrics: ``margin`` is the implicit reward margin (β·Δ for DPO/cDPO/IPO; Δ/eta for REBEL, the quantity
    regressed onto rc − rr; β·(logπc/|yc| − logπr/|yr|) for SimPO); ``accuracy`` is 1.0 where margin > 0
    (REBEL's "sign_align"); ``chosen_logratio``/``rejected_logratio`` are π − ref (SimPO: length-normalised logps).

    ``params.nll_coef`` α > 0 adds α·(−logπθ(chosen)/|chosen|) to each pair's loss (RPO, Pang et al. 2024, eq. 2:
    the chosen response's NLL normalised by its length), with metric ``nll``; it needs ``chosen_lengths``. TRL's
    ``rpo_alpha`` takes the cross-entropy over all chosen tokens of the micro-batch instead (a token mean, so long
    responses weigh more, and the value depends on how a batch is cut); OpenRLHF's ``nll_loss_coef`` is the same
    idea. Per pair, as here, the loss is the same whatever the batch size and accumulation.
    """
    algo = get(algorithm) if isinstance(algorithm, str) else algorithm
    if algo.data != PAIRS:
        raise ValueError(f"--algo {algo.name} trains on {algo.data} and has no pair loss")
    given = dict(ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
                 chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
                 chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    nll_coef = getattr(params, "nll_coef", 0.0)
    needed = ((["ref_chosen_logps", "ref_rejected_logps"] if algo.needs_reference else [])
              + (["chosen_rewards", "rejected_rewards"] if algo.uses_rewards else [])
              + (["chosen_lengths", "rejected_lengths"] if algo.length_normalized or nll_coef else []))
    missing = [name for name in needed if given[name] is None]
    if missing:
        raise ValueError(f"loss_type '{algo.name}' needs {', '.join(missing)}, but got None")
    shape = policy_chosen_logps.shape
    for name, t in [("policy_rejected_logps", policy_rejected_logps)] + [(n, given[n]) for n in needed]:
        if policy_chosen_logps.dim() != 1 or t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; every input must be 1-D sequence-level, "
                             f"shape (B,) like policy_chosen_logps {tuple(shape)}")
    inputs = {name: given[name] for name in needed if algo.length_normalized or not name.endswith("_lengths")}
    loss, margin, chosen, rejected = algo.loss_fn()(params, policy_chosen_logps, policy_rejected_logps, **inputs)
    margin = margin.detach()
    metrics = {"margin": margin, "accuracy": (margin > 0).to(margin.dtype),
               "chosen_logratio": chosen.detach(), "rejected_logratio": rejected.detach()}
    if nll_coef:
        nll = -policy_chosen_logps / chosen_lengths.detach().to(policy_chosen_logps.dtype)
        loss = loss + nll_coef * nll
        metrics["nll"] = nll.detach()
    return loss, metrics


def compute_unpaired_loss(algorithm: UnpairedAlgorithm | str, params, policy_logps, ref_logps, desirable,
                          reference_point):
    """Per-example loss (B,) and detached per-example metrics (B,) for one batch of unpaired responses.

    Metrics: ``margin`` is β·(r − z0) signed by the label (> 0 where the response sits on the side of z0 its label
    asks for), ``accuracy`` the share where it does, ``kl`` the reference point z0 the batch was trained against,
    ``logratio`` r = logπθ − logπref.
    """
    import torch

    algo = get(algorithm) if isinstance(algorithm, str) else algorithm
    if algo.data != UNPAIRED:
        raise ValueError(f"--algo {algo.name} trains on {algo.data} and has no unpaired loss")
    for name, t in [("ref_logps", ref_logps), ("desirable", desirable)]:
        if policy_logps.dim() != 1 or t is None or t.shape != policy_logps.shape:
            raise ValueError(f"{name} must be 1-D sequence-level, shape (B,) like policy_logps "
                             f"{tuple(policy_logps.shape)}; got {None if t is None else tuple(t.shape)}")
    loss, margin, logratio = algo.loss_fn()(params, policy_logps, ref_logps, desirable, reference_point)
    margin = margin.detach()
    z0 = torch.as_tensor(reference_point, dtype=margin.dtype, device=margin.device).detach().expand_as(margin)
    metrics = {"margin": margin, "accuracy": (margin > 0).to(margin.dtype), "kl": z0, "logratio": logratio.detach()}
    return loss, metrics


def unpaired_loss_params(algorithm: UnpairedAlgorithm, **given: Any):
    """``losses.UnpairedLossParams`` from the options given (None = unset), the algorithm's defaults for the rest."""
    from rlhf_pipeline.losses import UnpairedLossParams

    values = {**algorithm.defaults, **{k: v for k, v in given.items() if v is not None}}
    return UnpairedLossParams(**values)


def pair_loss_params(algorithm: PairAlgorithm, **given: Any):
    """``losses.PairLossParams`` from the options given (None = unset), the algorithm's defaults filling the rest."""
    from rlhf_pipeline.losses import PairLossParams

    values = {**algorithm.defaults, **{k: v for k, v in given.items() if v is not None}}
    return PairLossParams(**values)


def group_params(algorithm: GroupAlgorithm, **given: Any):
    """``groups.RLParams`` from the options given (None = unset), the algorithm's defaults filling the rest."""
    from rlhf_pipeline.algorithms.groups import RLParams

    if algorithm.data != GROUPS:
        raise ValueError(f"--algo {algorithm.name} trains on {algorithm.data}, not groups")
    values = {**algorithm.defaults, **{k: v for k, v in given.items() if v is not None}}
    return RLParams(algo=algorithm.name, **values)


def resolve_temperature(requested: float | None, sampling: dict | None, source: str, default: float | None) -> float:
    """The log-prob temperature: asked for, else ``default``, else the recorded sampling temperature."""
    from rlhf_pipeline.errors import PipelineError

    if requested is not None:
        return requested
    if default is not None:
        return default
    if sampling is None or sampling.get("temperature") is None:
        raise PipelineError(
            f"{source}: no sampling temperature recorded upstream (no generate manifest in its lineage); "
            "pass --temperature with the temperature the responses were sampled at"
        )
    if sampling["temperature"] == 0:
        raise PipelineError(f"{source}: the data was sampled greedily (temperature 0); pass --temperature")
    return float(sampling["temperature"])


def logp_temperature(algorithm: Algorithm, requested: float | None, sampling: dict | None, source: str) -> float:
    """The temperature policy and reference log-probs are taken at: ``--temperature`` when given, else the sampling
    temperature (from the data's lineage) for REBEL and the PPO family, else 1.0 (the DPO family)."""
    at_sampling = algorithm.data == GROUPS or algorithm.logp_at_sampling_temperature
    return resolve_temperature(requested, sampling, source, None if at_sampling else 1.0)


# ----------------------------------------------------------------------------------------------------------------
# Group algorithms: advantages from token rewards


def _gae_whitened(token_rewards, mask, values, params):
    """PPO: GAE(γ, λ) with the critic's values, advantages whitened over the batch; the critic's targets."""
    from rlhf_pipeline.advantages import gae, masked_whiten

    advantages, returns = gae(token_rewards, values, gamma=params.gamma, lam=params.lam, mask=mask)
    return masked_whiten(advantages, mask), returns


def _reinforce_pp(token_rewards, mask, values, params):
    """REINFORCE++: returns-to-go (γ), whitened over the batch."""
    from rlhf_pipeline.advantages import reinforce_pp

    return reinforce_pp(token_rewards, mask, gamma=params.gamma), None


def _group_norm(rewards, params):
    """GRPO's group baseline: (r − mean) / (std + eps) in the group; without the std when ``params.group_std`` is
    off (Dr. GRPO)."""
    from rlhf_pipeline.advantages import group_norm

    return group_norm(rewards, scale=params.group_std)


def scales_by_group_std(algorithm: Algorithm) -> bool:
    """Whether the algorithm's baseline is GRPO's group normalisation (which ``--scale-rewards`` switches)."""
    return getattr(algorithm, "baseline", None) is _group_norm


def _rloo(rewards, params):
    from rlhf_pipeline.advantages import rloo

    return rloo(rewards)


def _undiscounted_returns(token_rewards, mask, values, params):
    """GRPO / RLOO: every token gets the group-relative score (and the KL returns-to-go), undiscounted."""
    from rlhf_pipeline.advantages import reinforce_pp_returns

    return reinforce_pp_returns(token_rewards, gamma=1.0, mask=mask), None


# ----------------------------------------------------------------------------------------------------------------
# The registry. The demo options make the tiny model learn within the time budget (see the README's numbers); the
# PPO family's KL goes to the SFT policy, GRPO keeping it in the loss (k3), the others in the reward (k1).

register(PairAlgorithm(
    "rebel", "rlhf_pipeline.losses:rebel_terms", "regress the log-ratio gap / eta onto the reward gap",
    uses_rewards=True, logp_at_sampling_temperature=True, gradient_scale="rlhf_pipeline.losses:rebel_gradient_scale",
    demo={"learning_rate": 3e-4, "eta": 1.0}))
register(PairAlgorithm(
    "dpo", "rlhf_pipeline.losses:dpo_terms", "-log sigmoid(beta x log-ratio gap)",
    demo={"learning_rate": 3e-4, "beta": 0.1}))
register(PairAlgorithm(
    "cdpo", "rlhf_pipeline.losses:cdpo_terms", "DPO with label smoothing",
    defaults={"label_smoothing": 0.1}, demo={"learning_rate": 3e-4, "beta": 0.1}))
register(PairAlgorithm(
    "ipo", "rlhf_pipeline.losses:ipo_terms", "(log-ratio gap - 1/(2 beta))^2",
    demo={"learning_rate": 3e-4, "beta": 0.1}))
register(PairAlgorithm(
    "simpo", "rlhf_pipeline.losses:simpo_terms", "reference-free, length-normalised, target margin gamma",
    needs_reference=False, length_normalized=True, defaults={"beta": 2.0}, demo={"learning_rate": 3e-4}))
register(UnpairedAlgorithm(
    "kto", "rlhf_pipeline.losses:kto_terms", "unpaired desirable/undesirable responses, "
    "1 - sigmoid(beta (log-ratio - z0)) with z0 the KL from mismatched pairs",
    demo={"learning_rate": 3e-4, "beta": 0.1}))
register(GroupAlgorithm(
    "ppo", _gae_whitened, "clipped surrogate, GAE with a critic started from the reward model", uses_critic=True,
    demo={"learning_rate": 2e-4, "kl_coef": 0.02, "critic_learning_rate": 1e-3}))
register(GroupAlgorithm(
    "grpo", _undiscounted_returns, "group mean/std baseline", baseline=_group_norm,
    demo={"learning_rate": 2e-4, "kl_mode": "loss", "kl_coef": 0.02}))
register(GroupAlgorithm(
    "rloo", _undiscounted_returns, "leave-one-out baseline", baseline=_rloo,
    demo={"learning_rate": 2e-4, "kl_coef": 0.02}))
register(GroupAlgorithm(
    "reinforce_pp", _reinforce_pp, "returns-to-go whitened over the batch",
    demo={"learning_rate": 2e-4, "kl_coef": 0.02}))

register(SupervisedAlgorithm(
    "raft", "rejection sampling: SFT on each prompt's best of n responses (RAFT, best-of-n fine-tuning)",
    demo={"learning_rate": 3e-4}))
register(GroupAlgorithm(
    "dapo", _undiscounted_returns, "GRPO with clip-higher, a token-level loss over the step, no groups of equal "
    "rewards (and the soft overlong penalty when the filter is given --overlong-buffer)", baseline=_group_norm,
    defaults={"clip_high": 0.28, "loss_aggregation": "token", "kl_coef": 0.0}, filter={"drop_uniform_groups": True},
    demo={"learning_rate": 2e-4}))
register(GroupAlgorithm(
    "dr_grpo", _undiscounted_returns, "GRPO without the std division, token sums over a fixed length",
    baseline=_group_norm, defaults={"group_std": False, "loss_aggregation": "sequence_sum_norm"},
    demo={"learning_rate": 2e-4, "kl_mode": "loss", "kl_coef": 0.02}))
register(GroupAlgorithm(
    "gspo", _undiscounted_returns, "GRPO with one clipped importance ratio per sequence", baseline=_group_norm,
    defaults={"importance": "sequence", "clip": 3e-4, "clip_high": 4e-4, "kl_coef": 0.0},
    demo={"learning_rate": 2e-4}))

# The algorithms registered here, as a type for the stage configs (their --algo choices).
AlgoName = Literal[tuple(ALGORITHMS)]  # type: ignore[valid-type]
