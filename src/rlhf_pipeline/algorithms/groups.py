"""The PPO family on groups (n responses per prompt): the rollout pass, the advantages and the training task shared by
PPO with a critic and GAE, GRPO, RLOO and REINFORCE++ (each a ``GroupAlgorithm`` of ``algorithms.py``); the stage
body is ``rlhf train`` (``stages/train.py``).

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

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rlhf_pipeline.contracts import GROUP_COLUMNS, SCORED_KINDS, require_columns, require_types
from rlhf_pipeline.layout import CRITIC
from rlhf_pipeline.modeling import peel


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

        def gradient_checkpointing_enable(self, **kwargs):
            self.policy.gradient_checkpointing_enable(**kwargs)
            self.critic.gradient_checkpointing_enable(**kwargs)

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


def flatten_groups(ds, source: str) -> dict[str, list]:
    """One sample per response: ``group`` (row of ``ds``), ``prompt_token_ids``, ``response_token_ids``, ``reward``."""
    from rlhf_pipeline.errors import PipelineError

    out: dict[str, list] = {"group": [], "prompt_token_ids": [], "response_token_ids": [], "reward": []}
    for g, (prompt, responses, rewards) in enumerate(zip(ds["prompt_token_ids"], ds["response_token_ids"],
                                                         ds["rewards"])):
        if len(responses) != len(rewards):
            raise PipelineError(f"{source}: row {g} has {len(responses)} responses but {len(rewards)} rewards")
        for response, reward in zip(responses, rewards):
            if reward is None or not math.isfinite(reward):
                raise PipelineError(f"{source}: row {g} has a reward of {reward}; rescore it (rlhf score)")
            out["group"].append(g)
            out["prompt_token_ids"].append(list(prompt))
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

    from rlhf_pipeline.algorithms import get
    from rlhf_pipeline.losses import kl_estimate

    algo = get(params.algo)
    rewards = torch.tensor(samples["reward"], dtype=torch.float64)
    if params.normalize_rewards and rewards.numel() > 1:
        rewards = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    groups = torch.tensor(samples["group"])
    baseline = algo.baseline_fn()
    if baseline is not None:  # the group baseline, group by group (filtering can leave groups uneven)
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
        self.params, self.temperature, self.pad_id, self.pack_ratio = params, temperature, pad_id, pack_ratio
        if params.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {LOSS_AGGREGATIONS}, got {params.loss_aggregation!r}")
        # "token": (samples, response tokens) of what the mean is over, the optimizer step or the evaluated split
        self.totals: tuple[int, int] | None = None

    def begin_step(self, accelerator, model, rows, micro_batches: int) -> None:
        """Before each optimizer step (``trainer.TrainTask``): the step's samples and tokens, for ``token``."""
        self.totals = None if rows is None else _totals(rows)

    def begin_eval(self, ds) -> None:
        """Before an evaluation (``trainer.evaluate``): the split's samples and tokens, for ``token``."""
        self.totals = _totals(ds)

    def token_scale(self, batch_rows: int, mask) -> float:
        """What a batch's token sum is multiplied by so that the trainer's example-weighted mean of the batches'
        losses (and its average of gradients over micro-batches and processes) is the mean over all N samples' T
        tokens: N / (batch rows · T). In training every micro-batch has the same rows, so this is (micro-batches per
        step) / T. Without totals, the batch's own token mean."""
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

        from rlhf_pipeline.logprobs import build_batch, token_logps, token_values
        from rlhf_pipeline.losses import kl_estimate, ppo_policy_loss, value_loss

        p = self.params
        policy, critic = parts(model)
        device = next(policy.parameters()).device
        batch = build_batch([r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows],
                            self.pad_id, self.pack_ratio).to(device)
        logps, seq = token_logps(policy, batch, temperature=self.temperature)
        dtype = logps.dtype

        def column(name):
            values, mask = padded([r[name] for r in rows], dtype=dtype)
            return values.to(device), mask.to(device)

        old, mask = column("old_logps")
        ref, _ = column("ref_logps")

        def rollout_layout(flat, seq_index):  # per-token values ordered by sequence -> (B, T) like the columns
            return torch.zeros_like(old).index_put((seq_index, _positions(seq_index)), flat.to(dtype))

        logp = rollout_layout(logps, seq)
        advantages, _ = column("advantages")
        aggregation = p.loss_aggregation
        if aggregation == "token":
            scale, reduction = self.token_scale(len(rows), mask), "sum"
        else:
            scale, reduction = 1.0, aggregation
        loss, metrics = ppo_policy_loss(logp, old, advantages, mask, clip=p.clip, clip_high=p.clip_high,
                                        importance=p.importance, reduction=reduction, max_tokens=p.max_tokens)
        loss = loss * scale
        per_sample_count = mask.sum(dim=1).clamp(min=1)
        out = {"policy_loss": loss.detach().expand(len(rows))}
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
            vloss, _ = value_loss(values, old_values, returns, mask, clip=p.value_clip, reduction="sequence")
            loss = loss + p.vf_coef * vloss
            out["value_loss"] = vloss.detach().expand(len(rows))
        with torch.no_grad():
            out["kl_to_ref"] = torch.where(mask, logp - ref, 0).sum(dim=1)  # k1 summed over the response
            for k, v in metrics.items():
                out[k] = v.expand(len(rows))
        return loss, out, (batch.num_real_tokens, batch.num_real_tokens + batch.num_padded_tokens)


def _totals(rows) -> tuple[int, int]:
    return rows.num_rows, sum(len(ids) for ids in rows["response_token_ids"])


def _positions(seq_index):
    """Position of each token within its sequence, for tokens ordered by sequence then position."""
    import torch

    starts = torch.zeros_like(seq_index)
    if seq_index.numel():
        change = torch.ones_like(seq_index, dtype=torch.bool)
        change[1:] = seq_index[1:] != seq_index[:-1]
        first = torch.nonzero(change).squeeze(-1)
        counts = torch.diff(torch.cat([first, first.new_tensor([seq_index.numel()])]))
        starts = torch.repeat_interleave(first, counts)
    return torch.arange(seq_index.numel(), device=seq_index.device) - starts
