"""The group family, the PPO family on groups (n responses per prompt): :class:`GroupAlgorithm` (what an entry
declares: its baseline, its advantages, its policy loss), the rollout pass, the advantages, :class:`GroupTask` (the
training task), :class:`GroupOptions` (the family's ``rlhf train`` options), :func:`train` (the family's recipe) and
the registry entries: PPO with a critic and GAE, GRPO, RLOO, REINFORCE++, DAPO, Dr. GRPO and GSPO.

Offline, like the rest of the pipeline: the responses were sampled by the policy this run starts from, so "the
rollout" is the groups dataset, and training runs ``--epochs`` passes (PPO's K epochs) over it in minibatches of
``batch_size × gradient_accumulation_steps × processes`` samples. Before the first update one batched pass
computes, for every sample and every response token:

- ``old_logps``: the sampling policy's log-probs (the model as loaded, at the sampling temperature): ρ's denominator;
- ``ref_logps``: the reference model's log-probs, for the KL control (``--ref-model``; by default the starting
  policy itself, whose log-probs are ``old_logps``: then a KL penalty in the reward is zero and only
  ``--kl-mode loss`` keeps the policy near where it started; ``rlhf iterate`` passes the iteration-0 model);
- ``old_values`` (PPO): the critic's values, the critic being initialised from a reward model;

then the advantages, per algorithm (``r`` is the sequence reward from ``rlhf score``, optionally standardised over
the batch with ``--normalize-rewards``):

=============  ==========================================================================================
ppo            token rewards = r on the last token − β·KL_t on every token; GAE(γ = --discount, λ) with the critic's
               values; advantages whitened over the batch; the critic regresses on the returns.
grpo           (r − group mean) / group std on every token (minus the KL returns-to-go with --kl-mode reward).
rloo           r − mean of the other samples of its group on every token (likewise).
reinforce_pp   token rewards = r on the last token − β·KL_t; returns-to-go (γ); whitened over the batch.
dapo           as grpo (clip-higher, the token mean over the step, no KL; the filter drops equal-reward groups).
dr_grpo        (r − group mean) on every token, no std (token sums over the generation's token limit).
gspo           as grpo (one clipped ratio per sample, its tokens' mean log-ratio; no KL).
=============  ==========================================================================================

KL control: ``--kl-mode reward`` puts ``−β·KL_t`` (estimator ``--kl-estimator``, k1 by default) into the token
rewards before the advantages; ``--kl-mode loss`` adds ``β·mean KL_t`` (k3 by default, as GRPO does) to the loss,
computed with the current policy. These inputs are kept in ``OUTPUT/rollout`` so a resumed run uses the same ones.

Loss: the clipped surrogate (``losses.ppo_policy_loss``) plus the KL term, aggregated over tokens as
``--loss-aggregation`` says (by default averaged over each sample's tokens, then over the samples; see
:class:`GroupTask`), plus for PPO ``vf_coef ×`` the clipped value loss averaged per sample. Every aggregation gives
the same update for any micro-batch or process split of an optimizer step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Optional, Sequence

from rlhf_pipeline.algorithms.registry import (ALGORITHMS, GROUPS, Family, register, register_family, resolve,
                                               with_defaults)
from rlhf_pipeline.config import option
from rlhf_pipeline.contracts import GROUP_COLUMNS, SAMPLER_LOGPROBS, SCORED_KINDS, require_columns, require_types
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import CRITIC, METRIC_WEIGHT, ROLLOUT_CACHE
from rlhf_pipeline.modeling import SAFE_WEIGHTS, enable_activation_checkpointing, peel

log = logging.getLogger(__name__)


@dataclass
class RLParams:
    algo: str
    clip: float = 0.2
    kl_coef: float = 0.05
    kl_mode: str = "reward"  # reward | loss
    kl_estimator: str = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.5
    value_clip: float | None = 0.2
    normalize_rewards: bool = False
    clip_high: float | None = None  # ε_high of the ratio clip (None: ``clip``); DAPO's clip-higher
    importance: str = "token"  # token | sequence (GSPO)
    loss_aggregation: str = "sequence"  # sequence | token | sequence_sum_norm (see GroupTask)
    max_tokens: int | None = None  # sequence_sum_norm's constant: the generation's token limit
    group_std: bool = True  # GRPO's group baseline divides by the group's std (False: Dr. GRPO)
    eta: float = 1.0  # SPPO: the target log-ratio is eta * (P(win) - 1/2)
    sapo_temperature_pos: float = 1.0  # SAPO: the gate's temperature where A > 0
    sapo_temperature_neg: float = 1.05  # SAPO: where A <= 0
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss); 0 = logged only
    reward_weights: tuple[float, ...] | None = None  # GDPO: one weight per reward source, in the data's order
    rollout_correction: str = "none"  # none | tis | mask | sequence_mask (advantages.rollout_correction)
    rollout_correction_cap: float = 2.0


def clipped_surrogate(logp, old, advantages, mask, params: RLParams, reduction: str):
    """The PPO family's default policy loss: ``losses.ppo_policy_loss``, the clipped surrogate of the ratio to the
    sampling policy (per token or, with ``params.importance == "sequence"``, per sequence), reduced as asked."""
    from rlhf_pipeline.losses import ppo_policy_loss

    return ppo_policy_loss(logp, old, advantages, mask, clip=params.clip, clip_high=params.clip_high,
                           importance=params.importance, reduction=reduction, max_tokens=params.max_tokens)


def _cispo(logp, old, advantages, mask, params: RLParams, reduction: str):
    """CISPO's policy loss (``losses.cispo_policy_loss``): the importance weight is capped at ``1 + clip_high``."""
    from rlhf_pipeline.losses import cispo_policy_loss

    return cispo_policy_loss(logp, old, advantages, mask, max_weight=1.0 + params.clip_high, reduction=reduction,
                             max_tokens=params.max_tokens)


def _sapo(logp, old, advantages, mask, params: RLParams, reduction: str):
    """SAPO's policy loss (``losses.sapo_policy_loss``), its gate's temperatures from ``params``."""
    from rlhf_pipeline.losses import sapo_policy_loss

    return sapo_policy_loss(logp, old, advantages, mask, params.sapo_temperature_pos, params.sapo_temperature_neg,
                            reduction=reduction, max_tokens=params.max_tokens)


def _sppo(logp, old, advantages, mask, params: RLParams, reduction: str):
    """SPPO's regression (``losses.sppo_loss``): the advantages carry each response's target η(P − 1/2)."""
    from rlhf_pipeline.losses import sppo_loss

    if reduction != "sequence":
        raise ValueError("SPPO's loss is one squared error per response: --loss-aggregation must be sequence")
    return sppo_loss(logp, old, advantages, mask)


@dataclass(frozen=True)
class GroupAlgorithm:
    """A policy-gradient algorithm on groups of n responses per prompt.

    ``baseline(rewards (1, G), params) -> scores (1, G)`` turns one prompt's rewards into the scores its responses
    are credited with (None: the reward itself). ``advantages(token_rewards (B, T), mask, values, params) ->
    (advantages, returns or None)`` turns the token rewards (the score on the last token, minus the KL penalty per
    token when it is in the reward) into per-token advantages; ``values`` are the critic's when ``uses_critic``.
    ``policy_loss(logp, old_logp, advantages, mask (B, T), params, reduction) -> (loss, metrics)`` is the policy's
    loss over the response tokens (:func:`clipped_surrogate` by default), where ``reduction`` is ``"sequence"``,
    ``"sum"`` (the task scales it for DAPO's token mean over the step) or ``"sequence_sum_norm"``, and ``metrics``
    are detached scalars (``clip_fraction``, ...) logged under ``policy/``. ``params`` is :class:`RLParams`;
    ``defaults`` are its fields that differ for this algorithm (``rlhf train`` options left unset take them);
    ``filter`` are ``rlhf filter`` options that ``rlhf iterate`` and ``rlhf demo`` pass for it (DAPO's removal of
    groups with equal rewards, say). ``scales_by_std`` declares a baseline that divides by the group's std, which
    ``--scale-rewards`` switches. ``reward_sources`` declares scores made from each reward source's own column
    (GDPO: ``rlhf score`` with several sources), by :func:`rlhf_pipeline.advantages.decoupled_group_norm`.
    """

    name: str
    advantages: Callable | str
    help: str
    baseline: Callable | str | None = None
    policy_loss: Callable | str = clipped_surrogate
    uses_critic: bool = False
    scales_by_std: bool = False
    reward_sources: bool = False
    regression: bool = False  # the loss regresses log-ratios onto targets scaled by --eta (SPPO)
    defaults: dict[str, Any] = field(default_factory=dict)
    filter: dict[str, Any] = field(default_factory=dict)
    demo: dict[str, Any] = field(default_factory=dict)
    data: str = GROUPS
    # rlhf iterate --overlap 1 trains on samples of the policy one behind: a reason why this algorithm cannot (refused
    # then), or "" (it can: the stored sampler log-probs are the behaviour policy of --rollout-correction)
    refuses_stale_sampler: str = ""
    logp_at_sampling_temperature: ClassVar[bool] = True  # the ratio's denominator is the sampling policy's
    needs_reference: ClassVar[bool] = True  # the KL's reference (--ref-model; default the starting policy)

    def advantages_fn(self) -> Callable:
        return resolve(self.advantages)

    def baseline_fn(self) -> Callable | None:
        return None if self.baseline is None else resolve(self.baseline)

    @property
    def compares_within_group(self) -> bool:
        """Whether a response is credited against the others of its prompt (a group baseline, GDPO's per-group
        normalisation): a group of one response, or of equal rewards, then teaches nothing."""
        return self.baseline is not None or self.reward_sources

    def policy_loss_fn(self) -> Callable:
        return resolve(self.policy_loss)


def group_params(algorithm: GroupAlgorithm, **given: Any) -> RLParams:
    """:class:`RLParams` from the options given (None = unset), the algorithm's defaults filling the rest."""
    if algorithm.data != GROUPS:
        raise ValueError(f"--algo {algorithm.name} trains on {algorithm.data}, not groups")
    return with_defaults(RLParams, algorithm.defaults, algo=algorithm.name, **given)


# ----------------------------------------------------------------------------------------------------------------
# The policy and its critic, trained as one module


def policy_and_critic(policy, critic):
    """One ``nn.Module`` holding both, so one optimizer, one DeepSpeed engine and one checkpoint cover them; it saves
    as the policy's ``save_pretrained`` directory with the critic's beside it in ``critic/``."""
    import torch

    class PolicyAndCritic(torch.nn.Module):
        def __init__(self, policy, critic):
            super().__init__()
            self.policy, self.critic = policy, critic
            self.config = policy.config  # what the trainer reads (use_cache, name) is the policy's

        def gradient_checkpointing_enable(self, **kwargs):  # modeling.enable_activation_checkpointing's fallback
            enable_activation_checkpointing(self.policy)
            enable_activation_checkpointing(self.critic)

        def save_pretrained(self, path, state_dict=None, safe_serialization=True):
            state_dict = state_dict if state_dict is not None else self.state_dict()
            for name, module, where in (("policy", self.policy, Path(path)), ("critic", self.critic,
                                                                                Path(path) / CRITIC)):
                part = {k[len(name) + 1:]: v for k, v in state_dict.items() if k.startswith(name + ".")}
                peel(module).save_pretrained(where, state_dict=part, safe_serialization=safe_serialization)

    return PolicyAndCritic(policy, critic)


def parts(model) -> tuple[Any, Any | None]:
    """(policy, critic or None) of a model from :func:`policy_and_critic` or a plain policy, unwrapped."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "critic") and hasattr(inner, "policy"):
        return inner.policy, inner.critic
    return model, None


# ----------------------------------------------------------------------------------------------------------------
# The rollout: flatten groups, one batched pass, advantages


def check_groups(ds, source: str) -> None:
    hint = "the PPO family trains on groups: make them with rlhf filter --mode groups"
    require_columns(ds, GROUP_COLUMNS, source, hint)
    require_types(ds, SCORED_KINDS, source, hint)


def check_group_rows(ds, source: str, source_columns: Sequence[str] = ()) -> None:
    """Each group row's rewards and lengths, before a run starts and before :func:`flatten_groups`, without decoding
    a token list (Arrow's list lengths; the rewards are read as they are): one reward per response in ``rewards``
    and each source's column, each finite, and one sampler log-prob per response token."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")
    counts = pc.list_value_length(table["response_token_ids"]).to_pylist()
    for column in ("rewards", *source_columns):
        for g, (n, m) in enumerate(zip(counts, pc.list_value_length(table[column]).to_pylist())):
            if n != m:
                where = "" if column == "rewards" else f" in {column}"
                raise PipelineError(f"{source}: row {g} has {n} responses but {m} rewards{where}")
    for g, rewards in enumerate(ds["rewards"]):
        for reward in rewards:
            if reward is None or not math.isfinite(reward):
                raise PipelineError(f"{source}: row {g} has a reward of {reward}; rescore it (rlhf score)")
    if SAMPLER_LOGPROBS in ds.column_names:
        tokens = pc.list_value_length(pc.list_flatten(table["response_token_ids"])).to_pylist()
        logps = pc.list_value_length(pc.list_flatten(table[SAMPLER_LOGPROBS])).to_pylist()
        bad = next((k for k, (a, b) in enumerate(zip(tokens, logps)) if a != b), None)
        if bad is not None:
            g = next(g for g, end in enumerate(itertools.accumulate(counts)) if bad < end)
            raise PipelineError(f"{source}: row {g} has a response of {tokens[bad]} tokens but {logps[bad]} sampler "
                                f"log-probs in {SAMPLER_LOGPROBS}")


def check_learning_signal(ds, source: str, algorithm: GroupAlgorithm, warn: bool = True) -> None:
    """Refuse training data in which every group holds a single response (generate --n 1): ``algorithm`` credits
    each response against the others of its prompt, so the reward would have no say in the update, and the run
    would end near the policy it started from, saying nothing. Warn when some groups hold one response, and when
    every group's rewards are equal (but for GDPO, whose sources may differ where their sum does not): an iteration
    whose prompts the policy all solves, or all fails, is legitimate, but a reward that never tells responses apart
    is the usual mistake of a verifiable reward without its ground truth."""
    if not algorithm.compares_within_group or ds.num_rows == 0:
        return
    rewards = ds["rewards"]
    lone = sum(len(r) < 2 for r in rewards)
    if lone == len(rewards):
        raise PipelineError(
            f"{source}: every group holds a single response ({lone} groups): --algo {algorithm.name} credits each "
            "response against the others of its prompt, so the reward would have no say in the update; sample "
            "several responses a prompt (rlhf generate --n 4 or more), or train with --algo ppo or reinforce_pp"
        )
    if not warn:  # another process of the launch: the main process warns
        return
    if lone:
        log.warning("%s: %d of %d groups hold a single response, which --algo %s cannot credit against others: "
                    "they teach nothing (sample with rlhf generate --n 2 or more)", source, lone, len(rewards),
                    algorithm.name)
    if not algorithm.reward_sources and all(len(set(r)) == 1 for r in rewards if len(r) >= 2):
        log.warning("%s: every group's rewards are equal: --algo %s credits each response against the others of its "
                    "prompt, so the reward has no say in this update. If the reward never tells responses apart, "
                    "check it (rlhf score prints its mean and std; a verifiable reward needs the prompts' answers, "
                    "--reference-column)", source, algorithm.name)


def flatten_groups(ds, source: str, source_columns: Sequence[str] = ()) -> dict[str, list]:
    """One sample per response: ``group`` (row of ``ds``), ``prompt_token_ids``, ``response_token_ids``, ``reward``;
    with ``source_columns`` (each reward source's ``rewards_<key>``), ``source_rewards``: the sample's reward from
    each, in that order. The rows are checked first (:func:`check_group_rows`)."""
    check_group_rows(ds, source, source_columns)
    out: dict[str, list] = {"group": [], "prompt_token_ids": [], "response_token_ids": [], "reward": []}
    sampler = ds[SAMPLER_LOGPROBS] if SAMPLER_LOGPROBS in ds.column_names else None
    if sampler is not None:
        out["sampler_logps"] = []
    if source_columns:
        out["source_rewards"] = []
        per_source = [ds[c] for c in source_columns]
    for g, (prompt, responses, rewards) in enumerate(zip(ds["prompt_token_ids"], ds["response_token_ids"],
                                                         ds["rewards"])):
        if source_columns:
            out["source_rewards"].extend(map(list, zip(*(values[g] for values in per_source))))
        for j, (response, reward) in enumerate(zip(responses, rewards)):
            out["group"].append(g)
            out["prompt_token_ids"].append(list(prompt))
            if sampler is not None:
                out["sampler_logps"].append([float("nan") if x is None else float(x) for x in sampler[g][j]])
            out["response_token_ids"].append(list(response))
            out["reward"].append(float(reward))
    return out


def sample_lengths(samples) -> list[int]:
    return [len(p) + len(r) for p, r in zip(samples["prompt_token_ids"], samples["response_token_ids"])]


def rollout_pass(accelerator, model, samples, pad_id: int, temperature: float, batch_size: int, pack_ratio: float,
                 values: bool) -> dict[str, list]:
    """Token log-probs (and, with ``values``, the critic's token values) of every sample, in length-sorted batches
    shared over the processes; ``model`` is a policy or a :func:`policy_and_critic` (possibly a DeepSpeed engine)."""
    from rlhf_pipeline.logprobs import build_batch, split_by_sequence, token_logps, token_values
    from rlhf_pipeline.distributed import sharded_inference

    policy, critic = parts(model)
    prompts, responses = samples["prompt_token_ids"], samples["response_token_ids"]
    device = next(policy.parameters()).device

    def compute(ids: list[int]) -> list[tuple[list[float], list[float] | None]]:
        batch = build_batch([prompts[i] for i in ids], [responses[i] for i in ids], pad_id, pack_ratio).to(device)
        logps, seq = token_logps(policy, batch, temperature=temperature)
        per_logps = split_by_sequence(logps, seq, len(ids))
        if not values:
            return [(lp, None) for lp in per_logps]
        vals, vseq = token_values(critic, batch)
        return list(zip(per_logps, split_by_sequence(vals, vseq, len(ids))))

    out = sharded_inference(accelerator, model, sample_lengths(samples), batch_size, compute, "rollout log-probs")
    return {"logps": [lp for lp, _ in out], "values": [v for _, v in out]}


def padded(rows: Sequence[Sequence[float]], dtype=None):
    """Lists of per-token values (ragged) → (B, T) tensor right-padded with 0, and its (B, T) bool mask."""
    import torch

    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=dtype or torch.float64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=out.dtype)
        mask[i, : len(r)] = True
    return out, mask


def unpadded(values, mask) -> list[list[float]]:
    return [row[m].tolist() for row, m in zip(values, mask)]


def compute_advantages(samples: dict[str, list], params: RLParams) -> dict[str, list]:
    """Per-token ``advantages`` (and ``returns`` for PPO) of every sample, from its reward, the rollout's
    ``old_logps``, ``ref_logps`` and (PPO) ``old_values``; see the module docstring."""
    import torch

    from rlhf_pipeline.algorithms.registry import get
    from rlhf_pipeline.losses import kl_estimate

    algo = get(params.algo)
    rewards = torch.tensor(samples["reward"], dtype=torch.float64)
    if params.normalize_rewards and rewards.numel() > 1:
        rewards = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    groups = torch.tensor(samples["group"])
    baseline = algo.baseline_fn()
    if getattr(algo, "reward_sources", False):  # GDPO: each source normalised in its group, summed, normalised
        from rlhf_pipeline.advantages import decoupled_group_norm

        scores = decoupled_group_norm(torch.tensor(samples["source_rewards"], dtype=torch.float64), groups,
                                      torch.tensor(params.reward_weights, dtype=torch.float64))
    elif baseline is not None:  # the group baseline, group by group (filtering can leave groups uneven)
        scores = torch.empty_like(rewards)
        for g in groups.unique():
            where = groups == g
            if int(where.sum()) < 2:
                scores[where] = 0.0  # a lone sample has no baseline: it teaches nothing
                continue
            scores[where] = baseline(rewards[where].unsqueeze(0), params).squeeze(0)
    else:
        scores = rewards
    old, mask = padded(samples["old_logps"])
    ref, _ = padded(samples["ref_logps"])
    lengths = mask.sum(dim=1)
    token_rewards = torch.zeros_like(old)
    if params.kl_mode == "reward" and params.kl_coef:
        token_rewards -= params.kl_coef * torch.where(mask, kl_estimate(old, ref, kind=params.kl_estimator), 0)
    last = (lengths - 1).clamp(min=0)
    has_tokens = lengths > 0
    token_rewards[has_tokens, last[has_tokens]] += scores[has_tokens]

    out: dict[str, list] = {}
    values = padded(samples["old_values"])[0] if algo.uses_critic else None
    advantages, returns = algo.advantages_fn()(token_rewards, mask, values, params)
    if returns is not None:
        out["returns"] = unpadded(returns, mask)
    out["advantages"] = unpadded(advantages, mask)
    out["score"] = scores.tolist()
    return out


def correction_weights(samples: dict[str, list], params: RLParams) -> tuple[list[list[float]], dict[str, float]]:
    """The rollout correction's per-token weights of every sample (``advantages.rollout_correction`` of the trainer's
    ``old_logps`` against the sampler's ``sampler_logps``) and its metrics over them."""
    from rlhf_pipeline.advantages import rollout_correction

    old, mask = padded(samples["old_logps"])
    sampler, _ = padded(samples["sampler_logps"])
    weights, metrics = rollout_correction(old, sampler, mask, params.rollout_correction,
                                          params.rollout_correction_cap)
    return unpadded(weights, mask), metrics


# ----------------------------------------------------------------------------------------------------------------
# The loss


LOSS_AGGREGATIONS = ("sequence", "token", "sequence_sum_norm")


class GroupTask:
    """A micro-batch of samples: clipped surrogate + KL term (+ value loss for PPO).

    How the policy loss and a KL term in the loss are aggregated over tokens (``params.loss_aggregation``):

    - ``sequence`` (default): the mean over each sample's tokens, then over the samples (the GRPO paper; TRL
      ``loss_type="grpo"``). Every sample weighs the same, so a long response's tokens weigh less each.
    - ``token``: the mean over every real token of the optimizer step, across micro-batches and processes (DAPO's
      token-level loss, §3.3; TRL ``loss_type="dapo"``, which normalises by the accumulated batch's token count).
      The step's token count comes from ``begin_step``; each micro-batch's sum is scaled so that the accumulated,
      process-averaged gradient is that of the step's token mean, whatever the batch size and accumulation.
    - ``sequence_sum_norm``: each sample's token sum over the constant ``params.max_tokens``, then the mean over the
      samples (Dr. GRPO, §3.1; TRL ``loss_type="dr_grpo"``): no length normalisation bias.

    The value loss (PPO) stays a per-sample mean.
    """

    def __init__(self, params: RLParams, temperature: float, pad_id: int, pack_ratio: float):
        from rlhf_pipeline.algorithms.registry import get

        self.params, self.temperature, self.pad_id, self.pack_ratio = params, temperature, pad_id, pack_ratio
        self.policy_loss = get(params.algo).policy_loss_fn()
        if params.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {LOSS_AGGREGATIONS}, got {params.loss_aggregation!r}")
        # "token": (samples, response tokens) of what the mean is over, the optimizer step or the evaluated split
        self.totals: tuple[int, int] | None = None

    def begin_step(self, accelerator, model, rows) -> None:
        """Before each optimizer step (``training.loop.TrainTask``): the step's samples and tokens, for ``token``."""
        self.totals = None if rows is None else _totals(rows)

    def begin_eval(self, ds) -> None:
        """Before an evaluation (``training.loop.evaluate``): the split's samples and tokens, for ``token``."""
        self.totals = _totals(ds)

    def token_scale(self, batch_rows: int, mask) -> float:
        """What a batch's token sum is multiplied by so that the trainer's example-weighted mean of the batches'
        losses (and its weighted average of gradients over micro-batches and processes) is the mean over all N
        samples' T tokens: N / (batch rows · T). Cut by count every micro-batch has the same rows, so this is
        (micro-batches per step) / T; cut by --max-tokens-per-micro-batch the rows differ, and the trainer weighs
        each micro-batch by its rows. Without totals, the batch's own token mean."""
        if self.totals is None:
            return 1.0 / float(mask.sum().clamp(min=1))
        samples, tokens = self.totals
        return samples / (batch_rows * max(tokens, 1))

    def lengths(self, ds) -> list[int]:
        return sample_lengths(ds)

    def collate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return rows

    def loss(self, model, rows):
        import torch

        from rlhf_pipeline.logprobs import (build_batch, positions_processed, response_positions, to_device,
                                            token_logps_and_entropy, token_values)
        from rlhf_pipeline.losses import TOKEN_MEAN_METRICS, kl_estimate, value_loss

        p = self.params
        policy, critic = parts(model)
        device = next(policy.parameters()).device
        batch = build_batch([r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows],
                            self.pad_id, self.pack_ratio).to(device)
        logps, seq, entropies = token_logps_and_entropy(policy, batch, temperature=self.temperature)
        dtype = logps.dtype

        def column(name):  # made on the host, copied without waiting for the forward
            values, mask = padded([r[name] for r in rows], dtype=dtype)
            return to_device(values, device), to_device(mask, device)

        old, mask = column("old_logps")
        ref, _ = column("ref_logps")
        positions = response_positions(batch)  # where each token of a pass goes in its row: worked out on the host

        def rollout_layout(flat, seq_index):  # per-token values ordered by sequence -> (B, T) like the columns
            return torch.zeros_like(old).index_put((seq_index, positions), flat.to(dtype))

        logp = rollout_layout(logps, seq)
        advantages, _ = column("advantages")
        if "correction" in rows[0]:  # the rollout correction weighs each token's policy-gradient term
            advantages = advantages * column("correction")[0]
        aggregation = p.loss_aggregation
        if aggregation == "token":
            scale, reduction = self.token_scale(len(rows), mask), "sum"
        else:
            scale, reduction = 1.0, aggregation
        loss, metrics = self.policy_loss(logp, old, advantages, mask, p, reduction)
        loss = loss * scale
        per_sample_count = mask.sum(dim=1).clamp(min=1)
        tokens = mask.sum(dim=1).to(dtype)  # each sample's response tokens: the weight of its token means
        out = {"policy_loss": loss.detach().expand(len(rows))}
        entropy = rollout_layout(entropies if p.entropy_coef else entropies.detach(), seq)
        per_token_entropy = torch.where(mask, entropy, 0)
        if p.entropy_coef:  # the bonus, aggregated as the policy loss is (sequence, token, or sum over max_tokens)
            if aggregation == "sequence":
                bonus = (per_token_entropy.sum(dim=1) / per_sample_count).mean()
            elif aggregation == "token":
                bonus = per_token_entropy.sum() * scale
            else:
                bonus = (per_token_entropy.sum(dim=1) / p.max_tokens).mean()
            loss = loss - p.entropy_coef * bonus
        out["entropy"] = (per_token_entropy.sum(dim=1) / per_sample_count).detach()
        if p.kl_mode == "loss" and p.kl_coef:
            per_token_kl = torch.where(mask, kl_estimate(logp, ref, kind=p.kl_estimator), 0)
            kl = per_token_kl.sum(dim=1) / per_sample_count
            if aggregation == "sequence":
                kl_term = kl.mean()
            elif aggregation == "token":
                kl_term = per_token_kl.sum() * scale
            else:
                kl_term = (per_token_kl.sum(dim=1) / p.max_tokens).mean()
            loss = loss + p.kl_coef * kl_term
            out["kl"] = kl.detach()
        if critic is not None:
            vals, vseq = token_values(critic, batch)
            values = rollout_layout(vals, vseq)
            old_values, _ = column("old_values")
            returns, _ = column("returns")
            vloss, vmetrics = value_loss(values, old_values, returns, mask, clip=p.value_clip, reduction="sequence")
            loss = loss + p.vf_coef * vloss
            out["value_loss"] = vloss.detach().expand(len(rows))
            # the critic's clip fraction (the micro-batch's token mean), values and targets: means over the tokens
            out["value_clip_frac"] = vmetrics["clip_frac"] * tokens
            for name, per_token in (("value_mean", values), ("return_mean", returns)):
                out[name] = torch.where(mask, per_token.detach(), 0).sum(dim=1)
            for name in ("value_clip_frac", "value_mean", "return_mean"):
                out[name + METRIC_WEIGHT] = tokens
        with torch.no_grad():
            out["kl_to_ref"] = torch.where(mask, logp - ref, 0).sum(dim=1)  # k1 summed over the response
            if "sampler_logps" in rows[0]:  # how far the sampler's numbers are from the trainer's, per response
                sampler, _ = column("sampler_logps")
                known = mask & ~torch.isnan(sampler)
                log_w = torch.where(known, old - torch.nan_to_num(sampler), 0)
                out["kl_sampler"] = (torch.expm1(log_w) - log_w).sum(dim=1) / known.sum(dim=1).clamp(min=1)
                if "correction" in rows[0]:
                    weights, _ = column("correction")
                    out["correction_weight"] = weights.sum(dim=1) / per_sample_count
                    corrected = (known & (log_w.exp() > p.rollout_correction_cap) if p.rollout_correction == "tis"
                                 else mask & (weights == 0))
                    out["corrected_fraction"] = corrected.sum(dim=1) / per_sample_count
            out["response_length"] = tokens
            if "reward" in rows[0]:
                out["reward"] = torch.tensor([float(r["reward"]) for r in rows])
            for k, v in metrics.items():
                if k in TOKEN_MEAN_METRICS:  # the micro-batch's token mean: weighed by tokens
                    out[k], out[k + METRIC_WEIGHT] = v * tokens, tokens
                else:
                    out[k] = v.expand(len(rows))
        return loss, out, (batch.num_real_tokens, positions_processed(model, batch))


def _totals(rows) -> tuple[int, int]:
    return rows.num_rows, sum(len(ids) for ids in rows["response_token_ids"])


# ----------------------------------------------------------------------------------------------------------------
# Advantages from token rewards, and baselines: what the entries below plug in


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


def _sppo_targets(rewards, params):
    """SPPO's target for each response: η(P(y ≻ π_t) − 1/2), P its Bradley-Terry win rate against its group."""
    from rlhf_pipeline.advantages import win_rates

    return params.eta * (win_rates(rewards) - 0.5)


def _rloo(rewards, params):
    from rlhf_pipeline.advantages import rloo

    return rloo(rewards)


def _undiscounted_returns(token_rewards, mask, values, params):
    """GRPO / RLOO: every token gets the group-relative score (and the KL returns-to-go), undiscounted."""
    from rlhf_pipeline.advantages import reinforce_pp_returns

    return reinforce_pp_returns(token_rewards, gamma=1.0, mask=mask), None


def scales_by_group_std(algorithm) -> bool:
    """Whether ``--scale-rewards`` applies: the algorithm declares a baseline that divides by the group's std."""
    return getattr(algorithm, "scales_by_std", False)


# Which algorithms read each group option (its ``reads``; ``registry.check_reads`` refuses it for the others).
def _in_groups(algorithm) -> bool:
    return algorithm.data == GROUPS


def _uses_critic(algorithm) -> bool:
    return algorithm.uses_critic


def _discounts(algorithm) -> bool:
    """PPO's GAE and REINFORCE++'s returns-to-go discount; GRPO-style scores are undiscounted."""
    return algorithm.data == GROUPS and algorithm.advantages in (_gae_whitened, _reinforce_pp)


def _sapo_gate(algorithm) -> bool:
    return getattr(algorithm, "policy_loss", None) is _sapo


def _clips_the_ratio(algorithm) -> bool:
    """PPO's clipped surrogate (:func:`clipped_surrogate`): both sides of its clip and its importance level. CISPO
    caps its weight with --clip-high alone; SAPO gates instead of clipping; SPPO regresses."""
    return algorithm.data == GROUPS and getattr(algorithm, "policy_loss", None) is clipped_surrogate


def _caps_the_ratio(algorithm) -> bool:
    """The upper side of the clip: PPO's surrogate, and CISPO's cap on its weight, 1 + --clip-high."""
    return _clips_the_ratio(algorithm) or getattr(algorithm, "policy_loss", None) is _cispo


def _aggregates(algorithm) -> bool:
    """The policy loss's aggregation over tokens: SPPO's is one squared error per response, no choice."""
    return algorithm.data == GROUPS and getattr(algorithm, "policy_loss", None) is not _sppo


def _one_reward(algorithm) -> bool:
    """--normalize-rewards standardises the rewards column; GDPO normalises each source's column itself."""
    return algorithm.data == GROUPS and not getattr(algorithm, "reward_sources", False)


# ----------------------------------------------------------------------------------------------------------------
# The family's options and recipe


def _defaults_help(name: str, text: str, unset: str = "") -> Callable[[], str]:
    """The help of the option that sets ``RLParams.name``: ``text``, the family's default (``unset`` names what
    stands for a default of None), then every group algorithm's own, read from the registry when the help is shown."""

    def help_text() -> str:
        (base,) = [f.default for f in fields(RLParams) if f.name == name]
        own: dict[Any, list[str]] = {}
        for algorithm in ALGORITHMS.values():
            value = algorithm.defaults.get(name, base) if algorithm.data == GROUPS else base
            if value != base:
                own.setdefault(value, []).append(algorithm.name)
        shown = [f"{unset or base}"] + [f"{', '.join(names)}: {value:g}" for value, names in own.items()]
        return f"{text} (default {'; '.join(shown)})."

    return help_text


@dataclass(kw_only=True)
class GroupOptions:
    """``rlhf train`` options of the PPO family."""

    options_group: ClassVar[str] = "group options (the PPO family)"

    clip: Optional[float] = option(
        None, help=_defaults_help("clip", "PPO family: clip range epsilon of the ratio to the sampling policy, both "
                                  "sides"), reads=_clips_the_ratio,
    )
    kl_coef: Optional[float] = option(
        None, help=_defaults_help("kl_coef", "PPO family: weight beta of the KL to the reference model, 0 = none"),
        reads=_in_groups,
    )
    kl_mode: Literal["reward", "loss"] = option(
        "reward", help="PPO family: KL as a per-token reward penalty (reward) or as a term of the loss (loss).",
        reads=_in_groups,
    )
    kl_estimator: Optional[Literal["k1", "k2", "k3"]] = option(
        None, help="PPO family: KL estimator (default k1 in the reward, k3 in the loss).", reads=_in_groups,
    )
    normalize_rewards: bool = option(False, help="PPO family: standardise the rewards over the dataset first.",
                                     reads=_one_reward)
    discount: float = option(1.0, help="PPO / REINFORCE++: discount gamma of the token rewards (GRPO and RLOO "
                             "give every token the group-relative score undiscounted).", reads=_discounts)
    lam: float = option(0.95, help="PPO: GAE lambda.", reads=_uses_critic)
    critic_model: Optional[str] = option(
        None, help="PPO: the critic's starting point (default: the reward model of rlhf score; with a python reward "
        "function, or several sources, or one with a reward head of its own code (ArmoRM) without --trust-remote-code, "
        "the policy --model with a new value head). It needs a `score` head of one label: a model with its own head "
        "code is refused unless --trust-remote-code allows it and its head is one.", reads=_uses_critic,
    )
    critic_learning_rate: Optional[float] = option(None, help="PPO: the critic's peak learning rate "
                                                   "(default: --learning-rate).", reads=_uses_critic)
    vf_coef: float = option(0.5, help="PPO: weight of the value loss.", reads=_uses_critic)
    value_clip: Optional[float] = option(0.2, help="PPO: clip range of the values around the old values.",
                                         reads=_uses_critic)
    clip_low: Optional[float] = option(None, help="PPO family: epsilon below 1 only (default: --clip).",
                                       reads=_clips_the_ratio)
    clip_high: Optional[float] = option(
        None, help=_defaults_help("clip_high", "PPO family: epsilon above 1 only, DAPO's clip-higher; CISPO's weight "
                                  "cap is 1 + it", unset="the clip's"),
        reads=_caps_the_ratio,
    )
    importance_level: Optional[Literal["token", "sequence"]] = option(
        None, help="PPO family: one importance ratio per token (default) or per sequence, its tokens' mean log-ratio "
        "(GSPO's default).", reads=_clips_the_ratio,
    )
    loss_aggregation: Optional[Literal["sequence", "token", "sequence_sum_norm"]] = option(
        None, help="PPO family: sequence = mean over each response's tokens, then over responses (default, the "
        "GRPO paper); token = mean over every token of the optimizer step (DAPO's default); sequence_sum_norm = each "
        "response's token sum over the generation's --max-new-tokens, mean over responses (Dr. GRPO's default).",
        reads=_aggregates,
    )
    scale_rewards: Optional[Literal["group", "none"]] = option(
        None, help="GRPO-style group baseline: (r - group mean) divided by the group's std (group, default) or not "
        "(none, Dr. GRPO's default).", reads=scales_by_group_std,
    )
    entropy_coef: float = option(
        0.0, help="PPO family: weight of an entropy bonus, the policy's mean token entropy subtracted from the loss "
        "(aggregated as the policy loss is); 0 = none. The entropy is logged (policy/train_entropy) either way.",
        reads=_in_groups,
    )
    sapo_temperature_pos: Optional[float] = option(
        None, help="SAPO: temperature of the soft gate on tokens with a positive advantage (default 1.0, TRL's).",
        reads=_sapo_gate,
    )
    sapo_temperature_neg: Optional[float] = option(
        None, help="SAPO: temperature of the soft gate on the other tokens (default 1.05, TRL's).", reads=_sapo_gate,
    )
    rollout_correction: Optional[Literal["none", "tis", "mask", "sequence_mask"]] = option(
        None, help="PPO family: correct for the sampler's log-probs differing from the trainer's, w = pi_old/"
        "pi_sampler per token: tis = min(w, cap); mask = drop tokens with w outside [1/cap, cap]; sequence_mask = drop "
        "responses whose geometric-mean w is outside it; none. Default: tis when the data carries the sampler's "
        "log-probs (rlhf generate writes them), else none.", reads=_in_groups,
    )
    rollout_correction_cap: float = option(2.0, help="PPO family: the cap C of --rollout-correction (> 1).",
                                           reads=_in_groups)

    def check_options(self, algorithm) -> None:
        """The group options' ranges, and SPPO's refusal of a rollout correction. (An option this algorithm does not
        read: ``registry.check_reads``, from each option's ``reads``.)"""
        if not 0.0 <= self.discount <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError("--discount and --lam must be in [0, 1]")
        for name in ("clip", "clip_low", "clip_high"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.clip_low is not None and self.clip_low >= 1:
            raise ValueError("--clip-low must be below 1 (the ratio is clipped at 1 - clip-low)")
        for name in ("kl_coef", "vf_coef"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.critic_learning_rate is not None and self.critic_learning_rate <= 0:
            raise ValueError("--critic-learning-rate must be > 0")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError("--value-clip must be > 0")
        if self.entropy_coef < 0:
            raise ValueError("--entropy-coef must be >= 0")
        if not self.rollout_correction_cap > 1:
            raise ValueError("--rollout-correction-cap must be > 1")
        if self.rollout_correction not in (None, "none") and getattr(algorithm, "policy_loss", None) is _sppo:
            raise ValueError("--rollout-correction weighs policy-gradient terms; SPPO regresses log-ratios onto "
                             "targets, so leave it out for --algo sppo")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")

    def rl_params(self, sampling: dict | None = None, longest_response: Callable[[], int] = lambda: 1) -> RLParams:
        """``groups.RLParams`` from the options given, the algorithm's defaults for those left unset. ``--clip``
        sets both sides, ``--clip-low``/``--clip-high`` one side each; explicit options win over the algorithm's
        defaults. ``sequence_sum_norm``'s constant is the generation's --max-new-tokens (from ``sampling``, the data's
        lineage), else ``longest_response()`` (the longest response in the data)."""
        algorithm = self.algorithm
        algo_defaults = algorithm.defaults
        default_clip = algo_defaults.get("clip", RLParams.clip)
        sides = {  # each side: its own flag, else --clip, else the algorithm's default for it, else its clip
            "clip": next(v for v in (self.clip_low, self.clip, default_clip) if v is not None),
            "clip_high": next(v for v in (self.clip_high, self.clip, algo_defaults.get("clip_high"), default_clip)
                              if v is not None),
        }
        params = group_params(
            algorithm, kl_coef=self.kl_coef, kl_mode=self.kl_mode,
            kl_estimator=self.kl_estimator or ("k1" if self.kl_mode == "reward" else "k3"), gamma=self.discount,
            lam=self.lam, vf_coef=self.vf_coef, value_clip=self.value_clip, normalize_rewards=self.normalize_rewards,
            importance=self.importance_level, loss_aggregation=self.loss_aggregation,
            group_std=None if self.scale_rewards is None else self.scale_rewards == "group",
            eta=getattr(self, "eta", None), entropy_coef=self.entropy_coef,
            sapo_temperature_pos=self.sapo_temperature_pos, sapo_temperature_neg=self.sapo_temperature_neg, **sides,
        )
        if params.loss_aggregation == "sequence_sum_norm":
            params.max_tokens = int((sampling or {}).get("max_new_tokens") or longest_response())
        return params


def _critic_source(config, ref) -> tuple[str, str]:
    """The model PPO's critic starts from, and how errors name it. ``--critic-model`` was checked with ``--model``
    (``modeling.check_critic_model``)."""
    from rlhf_pipeline.datasets_io import find_in_lineage
    from rlhf_pipeline.modeling import check_model_ref, own_reward_head

    if config.critic_model:
        return config.critic_model, "--critic-model"
    reward = find_in_lineage([ref], "reward") or {}
    scorer = reward.get("reward_model")
    if scorer:
        flag = "the critic (the reward model that scored the data)"
        check_model_ref(flag, scorer, tokenizer=False)
        remote = own_reward_head(scorer)
        if remote is None or config.trust_remote_code:  # allowed code: its head is checked once loaded (check_critic)
            return scorer, flag
        # Its code is not allowed to run, and without it the model loads as a standard classifier with a new, random
        # head in place of its own (ArmoRM's llama type), or not at all (a model_type of its own).
        log.warning("%s: --algo %s: the reward model that scored the data, %s, has a reward head of its own code (%s), "
                    "which is not run without --trust-remote-code; the critic starts from the policy %s with a new "
                    "value head (--critic-model sets another start; PPO's critic needs a `score` head of one label, "
                    "which ArmoRM's gating head is not)", config.data, config.algo, scorer, remote, config.model)
        return config.model, "the critic (the policy)"
    # No one reward model to start from (a python reward function, or several sources): the policy itself, with a
    # new value head. It reads the policy's tokens by construction; the head starts near 0 and is fitted by the value
    # loss from the first step.
    why = "several reward sources" if reward.get("sources") else "no reward model"
    log.info("%s: --algo %s: the data was scored with %s, so the critic starts from the policy %s with a new value "
             "head (--critic-model sets another start)", config.data, config.algo, why, config.model)
    return config.model, "the critic (the policy)"


def _rollout_correction(config, dd, ref) -> tuple[str, float]:
    """--rollout-correction as asked, or its default: tis where every split carries the sampler's log-probs (and
    the algorithm's loss is a policy gradient), else none. Asked for on data without them: one line."""
    has_sampler = all(SAMPLER_LOGPROBS in ds.column_names for ds in dd.values())
    asked = config.rollout_correction
    if asked not in (None, "none") and not has_sampler:
        raise PipelineError(f"{ref}: --rollout-correction {asked} needs the sampler's log-probs ({SAMPLER_LOGPROBS}), "
                            "which this data does not carry (it was generated before rlhf generate kept them, or "
                            "elsewhere); generate it again, or leave out --rollout-correction")
    if asked is None:
        asked = "tis" if has_sampler and getattr(config.algorithm, "policy_loss", None) is not _sppo else "none"
    return asked, config.rollout_correction_cap


def _correction_record(train, params: RLParams) -> dict[str, Any] | None:
    """The manifest's record of the rollout correction: its mode and cap, and over the train split how far the
    sampler's log-probs were from the trainer's and what the correction did (None: no sampler log-probs)."""
    if "sampler_logps" not in train.column_names:
        return None
    samples = {"old_logps": train["old_logps"], "sampler_logps": train["sampler_logps"]}
    mode = params.rollout_correction if params.rollout_correction != "none" else "tis"  # "none": measured as tis
    _, metrics = correction_weights(samples, dataclasses.replace(params, rollout_correction=mode))
    return {"mode": params.rollout_correction, "cap": params.rollout_correction_cap,
            "kl_sampler": metrics["kl_sampler"], "unknown_fraction": metrics["unknown_fraction"],
            **({"corrected_fraction": metrics["corrected_fraction"], "weight_mean": metrics["weight_mean"]}
               if params.rollout_correction != "none" else {})}


def _reward_sources(dd, ref) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """GDPO's inputs: each reward source's column and weight, as ``rlhf score`` recorded them in the data's lineage."""
    from rlhf_pipeline.datasets_io import find_in_lineage

    sources = (find_in_lineage([ref], "reward") or {}).get("sources") or []
    if len(sources) < 2:
        raise PipelineError(f"{ref}: --algo gdpo normalises each reward source within its group, and this data was "
                            "scored with one source; score it with several (rlhf score --reward-model ... --reward-fn "
                            "..., or --reward-fn twice)")
    columns = tuple(s["column"] for s in sources)
    for split, ds in dd.items():
        missing = [c for c in columns if c not in ds.column_names]
        if missing:
            raise PipelineError(f"{ref}:{split}: missing column(s) {', '.join(missing)}, the rewards of each source "
                                "that rlhf score wrote; filter the scored data with rlhf filter --mode groups")
    return columns, tuple(float(s.get("weight", 1.0)) for s in sources)


def _rollout(config, params, accelerator, setup_model, dd, temperature, pad, output: Path, source_columns=()):
    """The flattened samples of each split with old_logps, ref_logps, (old_values,) advantages (, returns): from
    OUTPUT/rollout when an interrupted run made them, else computed now and kept there."""
    import datasets

    from rlhf_pipeline.algorithms.reference import load_reference
    from rlhf_pipeline.training.stage import cached_splits

    def compute():
        uses_critic = config.algorithm.uses_critic
        samples = {split: flatten_groups(ds, f"{config.data}:{split}", source_columns)
                   for split, ds in dd.items()}
        # the KL's reference, when it weighs anything and is not the policy as loaded (the rollout's own log-probs)
        reference = load_reference(config, accelerator) if params.kl_coef else None
        for split, s in samples.items():
            batch = config.eval_batch_size
            passed = rollout_pass(accelerator, setup_model, s, pad, temperature, batch, config.pack_ratio,
                                  values=uses_critic)
            s["old_logps"] = passed["logps"]
            if uses_critic:
                s["old_values"] = passed["values"]
            s["ref_logps"] = (rollout_pass(accelerator, reference, s, pad, temperature, batch, config.pack_ratio,
                                           values=False)["logps"] if reference is not None else s["old_logps"])
            s.update(compute_advantages(s, params))
            if params.rollout_correction != "none":
                s["correction"] = correction_weights(s, params)[0]
        del reference
        return datasets.DatasetDict({split: datasets.Dataset.from_dict(s) for split, s in samples.items()})

    return cached_splits(accelerator, output / ROLLOUT_CACHE, compute)


def train(config) -> Path:
    """``rlhf train`` for the PPO family: the rollout pass (old and reference log-probs, the critic's values, the
    advantages; kept in OUTPUT/rollout), then :class:`GroupTask` over ``--epochs`` of minibatches."""
    import statistics

    from transformers import AutoModelForSequenceClassification

    from rlhf_pipeline.algorithms.registry import logp_temperature
    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.distributed import on_main_process
    from rlhf_pipeline.modeling import check_critic, check_critic_model, check_model_ref
    from rlhf_pipeline.training.stage import TrainingJob, causal_lm, run_training, training_record, training_summary

    check_model_ref("--model", config.model)
    if config.ref_model:
        check_model_ref("--ref-model", config.ref_model, tokenizer=False)
    if config.critic_model:
        check_critic_model("--critic-model", config.critic_model, config.trust_remote_code)
    ref = parse_ref(config.data)

    def read(run) -> TrainingJob:
        dd = load_dataset_dict(ref, required=("train",))
        for split, ds in dd.items():
            check_groups(ds, f"{ref}:{split}")
        sampling = find_in_lineage([ref], "sampling")
        params = config.rl_params(sampling, lambda: max(
            (len(r) for ds in dd.values() for rs in ds["response_token_ids"] for r in rs), default=1))
        kl_is_zero = params.kl_coef > 0 and params.kl_mode == "reward" and not config.ref_model
        if kl_is_zero and run.accelerator.is_main_process:
            log.warning("--algo %s: a KL penalty of %g in the reward is 0 on every token here: without --ref-model the "
                        "reference is --model itself, whose log-probs are also the ratio's old ones; pass --ref-model "
                        "(rlhf iterate passes the starting model) or --kl-mode loss", config.algo, params.kl_coef)
        source_columns = ()
        if config.algorithm.reward_sources:
            source_columns, params.reward_weights = _reward_sources(dd, ref)
        params.rollout_correction, params.rollout_correction_cap = _rollout_correction(config, dd, ref)
        for split, ds in dd.items():  # every row's rewards and lengths checked before anything is written
            check_group_rows(ds, f"{config.data}:{split}", source_columns)
        check_learning_signal(dd["train"], f"{config.data}:train", config.algorithm,
                              warn=run.accelerator.is_main_process)
        temperature = logp_temperature(config.algorithm, config.temperature, sampling, str(ref))
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        pad = pad_id(tokenizer)
        critic_path, critic_flag = _critic_source(config, ref) if config.algorithm.uses_critic else (None, None)

        def loader(path, trust_remote_code, **kwargs):
            policy = causal_lm(path, trust_remote_code, **kwargs)
            if critic_path is None:
                return policy
            critic = AutoModelForSequenceClassification.from_pretrained(critic_path, num_labels=1,
                                                                        trust_remote_code=trust_remote_code, **kwargs,
                                                                        **SAFE_WEIGHTS)
            check_critic(critic_flag, critic_path, critic, from_policy=critic_path == config.model)
            if critic.config.vocab_size < policy.config.vocab_size:
                raise PipelineError(
                    f"critic {critic_path} has a vocabulary of {critic.config.vocab_size}, the policy "
                    f"{policy.config.vocab_size}: the critic reads the policy's tokens, so it must share its "
                    "tokenizer; pass --critic-model with a reward model trained on the policy's tokenizer"
                )
            critic.config.use_cache = False
            critic.config.pad_token_id = pad
            return policy_and_critic(policy, critic)

        num_train = sum(len(r) for r in dd["train"]["rewards"])
        critic_lr = config.learning_rate if config.critic_learning_rate is None else config.critic_learning_rate
        rollout = {}

        def task(run, setup):
            rollout["data"] = data = _rollout(config, params, run.accelerator, setup.model, dd, temperature, pad,
                                              run.path, source_columns)
            return GroupTask(params, temperature, pad, config.pack_ratio), data["train"], data.get("test")

        def record(run, result):
            if critic_path is not None:
                on_main_process(run.accelerator, lambda: tokenizer.save_pretrained(run.path / CRITIC))
            data = rollout["data"]
            rewards = data["train"]["reward"]
            training = {
                "algo": params.algo, "rl_params": vars(params), "logp_temperature": temperature,
                "ref_model": config.ref_model or config.model, "critic_model": critic_path,
                "samples": {split: data[split].num_rows for split in data},
                "mean_reward": statistics.fmean(rewards) if rewards else None,
                "rollout_correction": _correction_record(data["train"], params),
                **training_summary(result),
            }
            return training_record(params.algo, result, dd, sampling, training, config.model,
                                   summary=f"{params.algo}: {result.steps} steps over {num_train} samples, loss "
                                   f"{result.first_loss:.4f} -> {result.last_loss:.4f}")

        return TrainingJob(tokenizer, num_train, task, record, loader=loader, data=dd,
                           learning_rate=lambda name: critic_lr if name.startswith("critic.") else config.learning_rate)

    return run_training("train", config, [ref], read)


register_family(Family(GROUPS, GroupOptions, train, "groups of n responses per prompt (rlhf filter --mode groups)"))

# The demo options make the tiny model learn within the demo's time (docs/algorithms.md has the numbers); the KL goes
# to the SFT policy, GRPO keeping it in the loss (k3), the others in the reward (k1).
register(GroupAlgorithm(
    "ppo", _gae_whitened, "clipped surrogate, GAE with a critic started from the reward model", uses_critic=True,
    demo={"learning_rate": 2e-4, "kl_coef": 0.02, "critic_learning_rate": 1e-3}))
register(GroupAlgorithm(
    "grpo", _undiscounted_returns, "group mean/std baseline", baseline=_group_norm, scales_by_std=True,
    demo={"learning_rate": 2e-4, "kl_mode": "loss", "kl_coef": 0.02}))
register(GroupAlgorithm(
    "rloo", _undiscounted_returns, "leave-one-out baseline", baseline=_rloo,
    demo={"learning_rate": 2e-4, "kl_coef": 0.02}))
register(GroupAlgorithm(
    "reinforce_pp", _reinforce_pp, "returns-to-go whitened over the batch",
    demo={"learning_rate": 2e-4, "kl_coef": 0.02}))
register(GroupAlgorithm(
    "dapo", _undiscounted_returns, "GRPO with clip-higher, a token-level loss over the step, no groups of equal "
    "rewards (and the soft overlong penalty when the filter is given --overlong-buffer)", baseline=_group_norm,
    scales_by_std=True, defaults={"clip_high": 0.28, "loss_aggregation": "token", "kl_coef": 0.0},
    filter={"drop_uniform_groups": True}, demo={"learning_rate": 2e-4}))
register(GroupAlgorithm(
    "dr_grpo", _undiscounted_returns, "GRPO without the std division, token sums over a fixed length",
    baseline=_group_norm, scales_by_std=True, defaults={"group_std": False, "loss_aggregation": "sequence_sum_norm"},
    demo={"learning_rate": 2e-4, "kl_mode": "loss", "kl_coef": 0.02}))
register(GroupAlgorithm(
    "gspo", _undiscounted_returns, "GRPO with one clipped importance ratio per sequence", baseline=_group_norm,
    scales_by_std=True, defaults={"importance": "sequence", "clip": 0.03, "clip_high": 0.04, "kl_coef": 0.0},
    demo={"learning_rate": 2e-4}))
register(GroupAlgorithm(
    "cispo", _undiscounted_returns, "GRPO's baseline; REINFORCE weighted by the importance ratio capped at "
    "1 + clip-high, its gradient stopped (no token dropped)", baseline=_group_norm, scales_by_std=True,
    policy_loss=_cispo, defaults={"clip_high": 4.0, "loss_aggregation": "token", "kl_coef": 0.0},
    demo={"learning_rate": 2e-4}))
register(GroupAlgorithm(
    "sapo", _undiscounted_returns, "GRPO with a soft, temperature-controlled gate on the ratio instead of the clip",
    baseline=_group_norm, scales_by_std=True, policy_loss=_sapo,
    demo={"learning_rate": 2e-4, "kl_mode": "loss", "kl_coef": 0.02}))
register(GroupAlgorithm(
    "gdpo", _undiscounted_returns, "GRPO on several rewards, each normalised within its group, summed, then "
    "normalised over the batch", reward_sources=True,
    demo={"learning_rate": 2e-4, "kl_mode": "loss", "kl_coef": 0.02}))
register(GroupAlgorithm(
    "sppo", _undiscounted_returns, "self-play: regress each response's log-ratio onto eta x (its win rate "
    "against its group - 1/2)", baseline=_sppo_targets, policy_loss=_sppo, regression=True,
    defaults={"kl_coef": 0.0, "eta": 100.0}, demo={"learning_rate": 2e-4},
    refuses_stale_sampler="its targets are win rates among the samples of the policy it regresses from"))
