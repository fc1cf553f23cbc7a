"""Preference pairs: their token columns, the sequence log-probs of chosen and rejected in one forward, the reference
pass that stores the sampling policy's log-probs once per dataset, and the training task of the pair losses.

Used by ``rlhf ref-logps`` (the reference pass as its own stage), ``rlhf train`` on pairs (the pass when the data has
no reference columns, then :class:`PairTask`), and the trainer benchmark.
"""

from __future__ import annotations

from typing import Any

from rlhf_pipeline.contracts import PAIR_TOKEN_COLUMNS, REF_LOGP_COLUMNS, require_columns, require_types


def check_pairs(ds, source: str) -> None:
    hint = "pass pairs made by rlhf filter --mode pairs"
    require_columns(ds, PAIR_TOKEN_COLUMNS, source, hint)
    require_types(ds, {**{c: "list of int" for c in PAIR_TOKEN_COLUMNS}, **{c: "number" for c in REF_LOGP_COLUMNS},
                       "chosen_reward": "number", "rejected_reward": "number"}, source, hint)


def pair_lengths(ds) -> list[int]:
    """Tokens in one pair's forward: the prompt twice plus both responses."""
    return [
        2 * len(p) + len(c) + len(r)
        for p, c, r in zip(ds["prompt_token_ids"], ds["chosen_token_ids"], ds["rejected_token_ids"])
    ]


def pair_logps(model, rows: list[dict[str, Any]], pad_id: int, temperature: float, pack_ratio: float = 0.0):
    """Sequence log-probs of the chosen and rejected responses of ``rows``: one forward over 2B sequences, padded or
    packed (``pack_ratio``; see ``logprobs.build_batch``)."""
    from rlhf_pipeline.logprobs import build_batch, sequence_logps

    prompts = [r["prompt_token_ids"] for r in rows]
    batch = build_batch(
        prompts + prompts, [r["chosen_token_ids"] for r in rows] + [r["rejected_token_ids"] for r in rows], pad_id,
        pack_ratio=pack_ratio,
    )
    batch = batch.to(next(model.parameters()).device)
    logps = sequence_logps(model, batch, temperature=temperature)  # (2B,)
    return logps[: len(rows)], logps[len(rows) :], batch


def compute_ref_logps(
    accelerator, model, ds, pad_id: int, temperature: float, batch_size: int, pack_ratio: float = 0.0
) -> tuple[list, list]:
    """Reference log-probs of every pair in ``ds``, computed in length-sorted batches shared over processes."""
    from rlhf_pipeline.distributed import sharded_inference

    def compute(ids: list[int]) -> list[tuple[float, float]]:
        chosen, rejected, _ = pair_logps(model, ds.select(ids).to_list(), pad_id, temperature, pack_ratio)
        return list(zip(chosen.tolist(), rejected.tolist()))

    values = sharded_inference(accelerator, model, pair_lengths(ds), batch_size, compute, "reference log-probs")
    return [c for c, _ in values], [r for _, r in values]


def add_ref_columns(dd, values: dict[str, tuple[list, list]]):
    from datasets import Value

    out = {}
    for split, ds in dd.items():
        chosen, rejected = values[split]
        ds = ds.remove_columns([c for c in REF_LOGP_COLUMNS if c in ds.column_names])
        ds = ds.add_column("chosen_ref_logp", chosen, feature=Value("float64"))
        out[split] = ds.add_column("rejected_ref_logp", rejected, feature=Value("float64"))
    return type(dd)(out)


def scale_reward_gaps(dd, source: str):
    """REBEL's ``--reward-gap-scale rms``: every split's ``chosen_reward`` and ``rejected_reward`` divided by the root
    mean square of the train split's gaps (chosen − rejected), so the gaps REBEL regresses onto have RMS 1 whatever
    the reward's scale, and ``--eta`` means the same on every task. The gaps are divided, never centred: their sign is
    the preference. Returns the scaled splits and the RMS (recorded in the manifest)."""
    import math

    from rlhf_pipeline.errors import PipelineError

    train = dd["train"]
    gaps = [c - r for c, r in zip(train["chosen_reward"], train["rejected_reward"])]
    rms = math.sqrt(sum(g * g for g in gaps) / max(len(gaps), 1))
    if not rms > 0:
        raise PipelineError(f"{source}: every pair has chosen_reward == rejected_reward, so there is no reward gap to "
                            "scale; leave out --reward-gap-scale")

    def scale(batch):
        return {"chosen_reward": [x / rms for x in batch["chosen_reward"]],
                "rejected_reward": [x / rms for x in batch["rejected_reward"]]}

    return dd.map(scale, batched=True, keep_in_memory=True, desc="scale reward gaps"), rms


class PairTask:
    """Chosen and rejected of a micro-batch in one forward; the loss from ``algorithms.compute_pair_loss``."""

    def __init__(self, algorithm, params, temperature: float, pad_id: int, pack_ratio: float = 0.0):
        from rlhf_pipeline.algorithms import get

        self.algorithm = get(algorithm) if isinstance(algorithm, str) else algorithm
        self.params, self.temperature, self.pad_id, self.pack_ratio = params, temperature, pad_id, pack_ratio

    def lengths(self, ds) -> list[int]:
        return pair_lengths(ds)

    def collate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return rows  # tensors are built in loss(), by logprobs.build_batch, packed or padded per micro-batch

    def loss(self, model, rows):
        import torch

        from rlhf_pipeline.algorithms import compute_pair_loss
        from rlhf_pipeline.logprobs import response_lengths

        chosen, rejected, batch = pair_logps(model, rows, self.pad_id, self.temperature, self.pack_ratio)
        device, dtype = chosen.device, chosen.dtype

        def column(name):
            return torch.tensor([r[name] for r in rows], dtype=dtype, device=device)

        lengths = response_lengths(batch).to(dtype).clamp(min=1)  # an empty response must not divide by zero
        algo = self.algorithm
        needs_ref = algo.needs_reference
        losses, metrics = compute_pair_loss(
            algo,
            self.params,
            chosen,
            rejected,
            ref_chosen_logps=column("chosen_ref_logp") if needs_ref else None,
            ref_rejected_logps=column("rejected_ref_logp") if needs_ref else None,
            chosen_rewards=column("chosen_reward") if algo.uses_rewards else None,
            rejected_rewards=column("rejected_reward") if algo.uses_rewards else None,
            chosen_lengths=lengths[: len(rows)],
            rejected_lengths=lengths[len(rows) :],
        )
        loss = losses.mean()
        scale = algo.gradient_scale_fn()(self.params) if algo.gradient_scale is not None else 1.0
        if scale != 1.0:  # the logged value is the loss's, the gradient is scaled (REBEL: see losses.rebel_loss)
            loss = loss.detach() + (loss - loss.detach()) * scale
        return loss, metrics, (batch.num_real_tokens, batch.num_real_tokens + batch.num_padded_tokens)
