"""Train a policy: on preference pairs with REBEL or the DPO family (DPO, cDPO, IPO, SimPO), or on groups of n
responses per prompt with the PPO family (PPO with a critic and GAE, GRPO, RLOO, REINFORCE++; see rlhf_pipeline.rl).

    rlhf train --algo rebel --model runs/iter_0/policy --data runs/iter_0/filter --output runs/iter_0/train
    rlhf train --algo grpo --model runs/iter_0/policy --data runs/iter_0/groups --output runs/iter_0/train
    rlhf train --algo ppo --critic-model runs/rm --model runs/iter_0/policy --data runs/iter_0/groups --output OUT
    accelerate launch --config_file accelerate_cfgs/zero3.yaml -m rlhf_pipeline.stages.train \\
        --algo rebel --model meta-llama/Meta-Llama-3-8B-Instruct --data runs/iter_0/filter --output runs/iter_0/train \\
        --batch-size 1 --gradient-accumulation-steps 16 --learning-rate 3e-7 --bf16

Reference log-probs (``chosen_ref_logp`` / ``rejected_ref_logp``) come from the data when ``rlhf ref-logps`` made
them, or are computed here once, with ``--model`` before its first update, and kept in ``OUTPUT/ref_logps`` so a
resumed run does not redo them. Policy and reference log-probs are taken at one temperature: the sampling
temperature for REBEL (as REBEL's code does; read from the generate manifest), 1.0 for the DPO family unless
``--temperature`` says otherwise. Stored columns made at another temperature are an error, never silently redone.

The output directory is a ``save_pretrained`` model that the next iteration's vLLM loads; see
``rlhf_pipeline.trainer`` for checkpoints, metrics and resume.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.config import option
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.stages.ref_logps import REF_COLUMNS, check_pairs, pair_lengths, pair_logps, resolve_temperature
from rlhf_pipeline.trainer import TrainOptions

METRIC_GROUPS = {"margin": "reward", "accuracy": "reward", "chosen_logratio": "logp", "rejected_logratio": "logp"}


@dataclass(kw_only=True)
class TrainConfig(TrainOptions):
    """Train a policy on pairs (REBEL, DPO family) or on groups (PPO family)."""

    algo: Literal["rebel", "dpo", "cdpo", "ipo", "simpo", "ppo", "grpo", "rloo", "reinforce_pp"] = option(
        "rebel", help="The loss: rebel/dpo/cdpo/ipo/simpo train on pairs; ppo/grpo/rloo/reinforce_pp on groups."
    )
    eta: float = option(
        1.0, help="REBEL: scale of the log-ratio regression, ((logratio_c - logratio_r)/eta - (r_c - r_r))^2. "
        "REBEL's UltraFeedback runs use 1e6."
    )
    beta: Optional[float] = option(None, help="DPO/cDPO/IPO/SimPO strength (default 0.1; 2.0 for SimPO).")
    label_smoothing: Optional[float] = option(None, help="cDPO: probability that a label is flipped (default 0.1).")
    gamma: float = option(0.5, help="SimPO: target reward margin.")
    temperature: Optional[float] = option(
        None, help="Temperature of policy and reference log-probs (default: the sampling temperature for REBEL and "
        "the PPO family, 1.0 for the DPO family)."
    )
    # The PPO family
    clip: float = option(0.2, help="PPO family: clip range epsilon of the ratio to the sampling policy.")
    kl_coef: float = option(0.05, help="PPO family: weight beta of the KL to the reference model (0 = none).")
    kl_mode: Literal["reward", "loss"] = option(
        "reward", help="PPO family: KL as a per-token reward penalty (reward) or as a term of the loss (loss)."
    )
    kl_estimator: Optional[Literal["k1", "k2", "k3"]] = option(
        None, help="PPO family: KL estimator (default k1 in the reward, k3 in the loss)."
    )
    ref_model: Optional[str] = option(
        None, help="PPO family: the KL reference (e.g. the SFT model); default: the starting policy (--model)."
    )
    normalize_rewards: bool = option(False, help="PPO family: standardise the rewards over the dataset first.")
    discount: float = option(1.0, help="PPO / REINFORCE++: discount gamma of the token rewards (GRPO and RLOO "
                             "give every token the group-relative score undiscounted).")
    lam: float = option(0.95, help="PPO: GAE lambda.")
    critic_model: Optional[str] = option(
        None, help="PPO: the critic's starting point, a reward model (default: the reward model of rlhf score)."
    )
    critic_learning_rate: Optional[float] = option(None, help="PPO: the critic's peak learning rate "
                                                   "(default: --learning-rate).")
    vf_coef: float = option(0.5, help="PPO: weight of the value loss.")
    value_clip: Optional[float] = option(0.2, help="PPO: clip range of the values around the old values.")

    @property
    def is_group_algo(self) -> bool:
        from rlhf_pipeline.rl import PPO_ALGOS

        return self.algo in PPO_ALGOS

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.discount <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError("--discount and --lam must be in [0, 1]")

    def rl_params(self):
        from rlhf_pipeline.rl import RLParams

        estimator = self.kl_estimator or ("k1" if self.kl_mode == "reward" else "k3")
        return RLParams(algo=self.algo, clip=self.clip, kl_coef=self.kl_coef, kl_mode=self.kl_mode,
                        kl_estimator=estimator, gamma=self.discount, lam=self.lam, vf_coef=self.vf_coef,
                        value_clip=self.value_clip, normalize_rewards=self.normalize_rewards)

    def loss_params(self):
        from rlhf_pipeline.losses import LossType, PairLossParams

        if self.is_group_algo:
            raise ValueError(f"--algo {self.algo} trains on groups and has no pair loss")
        loss_type = LossType(self.algo)
        beta = self.beta if self.beta is not None else (2.0 if loss_type is LossType.SIMPO else 0.1)
        smoothing = self.label_smoothing if self.label_smoothing is not None else (
            0.1 if loss_type is LossType.CDPO else 0.0
        )
        return loss_type, PairLossParams(eta=self.eta, beta=beta, label_smoothing=smoothing, gamma=self.gamma)


class PairTask:
    """Chosen and rejected of a micro-batch in one forward; the loss from ``losses.compute_pair_loss``."""

    def __init__(self, loss_type, params, temperature: float, pad_id: int, pack_ratio: float = 0.0):
        self.loss_type, self.params, self.temperature, self.pad_id = loss_type, params, temperature, pad_id
        self.pack_ratio = pack_ratio

    def lengths(self, ds) -> list[int]:
        return pair_lengths(ds)

    def collate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return rows  # tensors are built in loss(), by logprobs.build_batch, packed or padded per micro-batch

    def loss(self, model, rows):
        import torch

        from rlhf_pipeline.logprobs import response_lengths
        from rlhf_pipeline.losses import LossType, compute_pair_loss

        chosen, rejected, batch = pair_logps(model, rows, self.pad_id, self.temperature, self.pack_ratio)
        device, dtype = chosen.device, chosen.dtype

        def column(name):
            return torch.tensor([r[name] for r in rows], dtype=dtype, device=device)

        lengths = response_lengths(batch).to(dtype).clamp(min=1)  # an empty response must not divide by zero
        needs_ref = self.loss_type.needs_reference
        losses, metrics = compute_pair_loss(
            self.loss_type,
            self.params,
            chosen,
            rejected,
            ref_chosen_logps=column("chosen_ref_logp") if needs_ref else None,
            ref_rejected_logps=column("rejected_ref_logp") if needs_ref else None,
            chosen_rewards=column("chosen_reward") if self.loss_type.uses_rewards else None,
            rejected_rewards=column("rejected_reward") if self.loss_type.uses_rewards else None,
            chosen_lengths=lengths[: len(rows)],
            rejected_lengths=lengths[len(rows) :],
        )
        loss = losses.mean()
        if self.loss_type is LossType.REBEL and self.params.eta != 1.0:
            # The value of the paper's loss, the gradient of REBEL's code (eta² larger; see losses.rebel_loss).
            loss = loss.detach() + (loss - loss.detach()) * self.params.eta**2
        return loss, metrics, (batch.num_real_tokens, batch.num_real_tokens + batch.num_padded_tokens)


def train_names(values: dict[str, float]) -> dict[str, float]:
    return {("loss/train" if k == "loss" else f"{METRIC_GROUPS.get(k, 'train')}/train_{k}"): v for k, v in values.items()}


def eval_names(values: dict[str, float]) -> dict[str, float]:
    return {("loss/eval" if k == "loss" else f"{METRIC_GROUPS.get(k, 'eval')}/{k}"): v for k, v in values.items()}


def _reference_columns(accelerator, setup_model, dd, config, temperature, pad_id, record, output: Path):
    """The splits with reference log-prob columns: from the data, from OUTPUT/ref_logps, or computed now."""
    from datasets import load_from_disk

    from rlhf_pipeline.datasets_io import atomic_directory
    from rlhf_pipeline.stages.ref_logps import add_ref_columns, compute_ref_logps

    if all(c in ds.column_names for ds in dd.values() for c in REF_COLUMNS):
        if record is not None and record.get("temperature") != temperature:
            raise PipelineError(
                f"{config.data}: its reference log-probs were computed at temperature {record.get('temperature')}, "
                f"but this run takes log-probs at {temperature}; pass --temperature {record.get('temperature')} or "
                "recompute them with rlhf ref-logps --temperature"
            )
        return dd
    cache = output / "ref_logps"
    if (cache / "dataset_dict.json").exists():
        return load_from_disk(str(cache))
    values = {
        split: compute_ref_logps(
            accelerator, setup_model, ds, pad_id, temperature, config.eval_batch_size, config.pack_ratio
        )
        for split, ds in dd.items()
    }
    dd = add_ref_columns(dd, values)
    if accelerator.is_main_process:
        with atomic_directory(cache) as tmp:
            dd.save_to_disk(str(tmp))
    accelerator.wait_for_everyone()
    return dd


def main(config: TrainConfig) -> Path:
    from rlhf_pipeline.datasets_io import parse_ref
    from rlhf_pipeline.trainer import run_training_stage

    ref = parse_ref(config.data)
    if config.is_group_algo:
        from rlhf_pipeline.rl import train_groups

        return run_training_stage("train", config, [ref],
                                  lambda accelerator, out: train_groups(config, ref, accelerator, out))
    try:
        config.loss_params()
    except ValueError as e:
        raise PipelineError(str(e)) from None
    return run_training_stage("train", config, [ref], lambda accelerator, out: _train(config, ref, accelerator, out))


def _train(config: TrainConfig, ref, accelerator, out):
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict
    from rlhf_pipeline.trainer import StageRun, load_trainable, prepare, train, training_summary

    loss_type, params = config.loss_params()
    dd = load_dataset_dict(ref, required=("train",))
    for split, ds in dd.items():
        check_pairs(ds, f"{ref}:{split}")
    sampling = find_in_lineage([ref], "sampling")
    temperature = resolve_temperature(
        config.temperature, sampling, str(ref), None if loss_type.default_logp_temperature_is_sampling else 1.0
    )
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    pad = pad_id(tokenizer)
    model = load_trainable(config, AutoModelForCausalLM.from_pretrained)
    setup = prepare(config, accelerator, model, dd["train"].num_rows)
    if loss_type.needs_reference:
        dd = _reference_columns(
            accelerator, setup.model, dd, config, temperature, pad, find_in_lineage([ref], "ref_logps"), out.path
        )
    task = PairTask(loss_type, params, temperature, pad, config.pack_ratio)
    result = train(
        config, accelerator, setup, tokenizer, task, dd["train"], dd.get("test"),
        train_names=train_names, eval_names=eval_names,
    )
    training = {"algo": loss_type.value, "loss_params": vars(params), "logp_temperature": temperature,
                **training_summary(result)}
    return StageRun(
        result=result,
        rows_in=sum(ds.num_rows for ds in dd.values()),
        extra={"sampling": sampling, "training": training},
        summary=f"{loss_type.value}: {result.steps} steps, loss {result.first_loss:.4f} -> {result.last_loss:.4f}",
    )


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(TrainConfig, main, "rlhf train", argv)


if __name__ == "__main__":
    sys.exit(cli())
