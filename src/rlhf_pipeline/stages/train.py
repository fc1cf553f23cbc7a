"""Train a policy: on preference pairs with REBEL or the DPO family (DPO, cDPO, IPO, SimPO), on groups of n
responses per prompt with the PPO family (PPO with a critic and GAE, GRPO, RLOO, REINFORCE++; see rlhf_pipeline.algorithms.groups),
or on unpaired desirable/undesirable responses with KTO (see rlhf_pipeline.algorithms.unpaired).
The algorithms and what each needs come from ``rlhf_pipeline.algorithms``.

    rlhf train --algo rebel --model runs/iter_0/policy --data runs/iter_0/filter --output runs/iter_0/train
    rlhf train --algo grpo --model runs/iter_0/policy --data runs/iter_0/groups --output runs/iter_0/train
    rlhf train --algo ppo --critic-model runs/rm --model runs/iter_0/policy --data runs/iter_0/groups --output OUT
    rlhf train --algo kto --model runs/iter_0/policy --data runs/iter_0/unpaired --output runs/iter_0/train
    accelerate launch --config_file accelerate_cfgs/zero3.yaml -m rlhf_pipeline.stages.train \\
        --algo rebel --model meta-llama/Meta-Llama-3-8B-Instruct --data runs/iter_0/filter --output runs/iter_0/train \\
        --batch-size 1 --gradient-accumulation-steps 16 --learning-rate 3e-7 --bf16

Reference log-probs (``chosen_ref_logp`` / ``rejected_ref_logp``) come from the data when ``rlhf ref-logps`` made
them, or are computed here once, with ``--model`` before its first update, and kept in ``OUTPUT/ref_logps`` so a
resumed run does not redo them. Policy and reference log-probs are taken at one temperature: the sampling
temperature for REBEL (as REBEL's code does; read from the generate manifest), 1.0 for the DPO family unless
``--temperature`` says otherwise. Stored columns made at another temperature are an error, never silently redone.

The output directory is a ``save_pretrained`` model that the next iteration's vLLM loads; see
``rlhf_pipeline.training.loop`` for checkpoints, metrics and resume.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence

from rlhf_pipeline.algorithms import BEST, GROUPS, PAIRS, UNPAIRED, AlgoName, get, help_text, scales_by_group_std
from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import option
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import CRITIC, REF_LOGPS_CACHE, ROLLOUT_CACHE
from rlhf_pipeline.algorithms.pairs import check_pairs, scale_reward_gaps
from rlhf_pipeline.training.loop import TrainOptions

@dataclass(kw_only=True)
class TrainConfig(TrainOptions):
    """Train a policy on pairs (REBEL, DPO family) or on groups (PPO family)."""

    algo: AlgoName = option("rebel", help=f"The algorithm: {help_text()}.")
    eta: float = option(
        1.0, help="REBEL: scale of the log-ratio regression, ((logratio_c - logratio_r)/eta - (r_c - r_r))^2. "
        "REBEL's UltraFeedback runs use 1e6."
    )
    reward_gap_scale: Literal["none", "rms"] = option(
        "none", help="REBEL: rms divides the reward gaps (chosen - rejected) by their root mean square over the train "
        "split, so that --eta does not depend on the reward's scale (then eta 1 regresses the log-ratio gap onto gaps "
        "of typical size 1); recorded in the manifest."
    )
    beta: Optional[float] = option(None, help="DPO/cDPO/IPO/SimPO/KTO strength (default 0.1; 2.0 for SimPO).")
    nll_coef: float = option(
        0.0, help="DPO family: weight alpha of an NLL term on the chosen response, alpha * (-log pi(chosen) / "
        "|chosen|) per pair (RPO; TRL's rpo_alpha, OpenRLHF's nll_loss_coef); 0 = none."
    )
    label_smoothing: Optional[float] = option(None, help="cDPO: probability that a label is flipped (default 0.1).")
    gamma: float = option(0.5, help="SimPO: target reward margin.")
    desirable_weight: Optional[float] = option(
        None, help="KTO: weight lambda_D of the desirable responses' losses (default 1.0)."
    )
    undesirable_weight: Optional[float] = option(
        None, help="KTO: weight lambda_U of the undesirable responses' losses (default 1.0); the paper advises "
        "lambda_D n_D / (lambda_U n_U) in [1, 4/3], and training warns outside it."
    )
    temperature: Optional[float] = option(
        None, help="Temperature of policy and reference log-probs (default: the sampling temperature for REBEL and "
        "the PPO family, 1.0 for the DPO family)."
    )
    # The PPO family
    clip: Optional[float] = option(
        None, help="PPO family: clip range epsilon of the ratio to the sampling policy, both sides (default 0.2; "
        "GSPO 3e-4 below, 4e-4 above)."
    )
    kl_coef: Optional[float] = option(
        None, help="PPO family: weight beta of the KL to the reference model, 0 = none (default 0.05; DAPO and GSPO 0)."
    )
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
    clip_low: Optional[float] = option(None, help="PPO family: epsilon below 1 only (default: --clip).")
    clip_high: Optional[float] = option(
        None, help="PPO family: epsilon above 1 only (default: --clip; DAPO's clip-higher: 0.28)."
    )
    importance_level: Optional[Literal["token", "sequence"]] = option(
        None, help="PPO family: one importance ratio per token (default) or per sequence, its tokens' mean log-ratio "
        "(GSPO's default)."
    )
    loss_aggregation: Optional[Literal["sequence", "token", "sequence_sum_norm"]] = option(
        None, help="PPO family: sequence = mean over each response's tokens, then over responses (default, the "
        "GRPO paper); token = mean over every token of the optimizer step (DAPO's default); sequence_sum_norm = each "
        "response's token sum over the generation's --max-new-tokens, mean over responses (Dr. GRPO's default)."
    )
    scale_rewards: Optional[Literal["group", "none"]] = option(
        None, help="GRPO-style group baseline: (r - group mean) divided by the group's std (group, default) or not "
        "(none, Dr. GRPO's default)."
    )

    @property
    def algorithm(self):
        return get(self.algo)

    @property
    def is_group_algo(self) -> bool:
        return self.algorithm.data == GROUPS

    def __post_init__(self) -> None:
        super().__post_init__()
        get(self.algo)  # an unknown name fails here, with the list of algorithms
        if not 0.0 <= self.discount <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError("--discount and --lam must be in [0, 1]")
        # The losses check these too (losses.py), but only at the first step, after the model is loaded.
        if self.eta <= 0:
            raise ValueError("--eta must be > 0 (REBEL divides the log-ratio gap by it)")
        if self.nll_coef < 0:
            raise ValueError("--nll-coef must be >= 0")
        if self.nll_coef and (self.algorithm.data != PAIRS or self.algorithm.uses_rewards):
            raise ValueError(f"--nll-coef is for the DPO family (an NLL term beside a preference loss), not --algo "
                             f"{self.algo}")
        if self.reward_gap_scale != "none" and not getattr(self.algorithm, "uses_rewards", False):
            raise ValueError(f"--reward-gap-scale is for the algorithms that regress on reward gaps (REBEL), not "
                             f"--algo {self.algo}")
        if self.beta is not None and self.beta <= 0:
            raise ValueError("--beta must be > 0")
        if self.label_smoothing is not None:
            if not 0 <= self.label_smoothing < 0.5:
                raise ValueError("--label-smoothing must be in [0, 0.5)")
            if self.algo == "cdpo" and self.label_smoothing == 0:
                raise ValueError("--algo cdpo needs --label-smoothing > 0 (e.g. 0.1); with 0 it is --algo dpo")
            if self.algo != "cdpo" and self.label_smoothing > 0:
                raise ValueError(
                    f"--label-smoothing is cDPO's; use --algo cdpo, or leave it out for --algo {self.algo}"
                )
        if self.gamma < 0:
            raise ValueError("--gamma must be >= 0")
        for name in ("desirable_weight", "undesirable_weight"):
            value, flag = getattr(self, name), "--" + name.replace("_", "-")
            if value is not None and self.algorithm.data != UNPAIRED:
                raise ValueError(f"{flag} is KTO's (--algo kto), not --algo {self.algo}'s")
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0")
        if self.desirable_weight == 0 and self.undesirable_weight == 0:
            raise ValueError("--desirable-weight and --undesirable-weight are both 0: nothing would be trained")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError("--temperature must be > 0 (log-probs of greedy samples are not defined)")
        for name in ("clip", "clip_low", "clip_high"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if not self.is_group_algo:
            given = [f for f in ("clip", "clip_low", "clip_high", "importance_level", "loss_aggregation",
                                 "scale_rewards", "kl_coef") if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{', '.join('--' + f.replace('_', '-') for f in given)}: PPO-family options, which "
                                 f"--algo {self.algo} does not use; leave them out")
        if self.scale_rewards is not None and not scales_by_group_std(self.algorithm):
            raise ValueError(f"--scale-rewards switches GRPO's group std (grpo, dapo, dr_grpo, gspo); --algo "
                             f"{self.algo} has another baseline")
        if self.clip_low is not None and self.clip_low >= 1:
            raise ValueError("--clip-low must be below 1 (the ratio is clipped at 1 - clip-low)")
        for name in ("kl_coef", "vf_coef"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.critic_learning_rate is not None and self.critic_learning_rate <= 0:
            raise ValueError("--critic-learning-rate must be > 0")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError("--value-clip must be > 0")

    def rl_params(self, sampling: dict | None = None, longest_response: Callable[[], int] = lambda: 1):
        """``groups.RLParams`` from the options given, the algorithm's defaults for those left unset. ``--clip``
        sets both sides, ``--clip-low``/``--clip-high`` one side each; explicit options win over the algorithm's
        defaults. ``sequence_sum_norm``'s constant is the generation's --max-new-tokens (from ``sampling``, the data's
        lineage), else ``longest_response()`` (the longest response in the data)."""
        from rlhf_pipeline.algorithms import group_params
        from rlhf_pipeline.algorithms.groups import RLParams

        algo_defaults = self.algorithm.defaults
        default_clip = algo_defaults.get("clip", RLParams.clip)
        sides = {  # each side: its own flag, else --clip, else the algorithm's default for it, else its clip
            "clip": next(v for v in (self.clip_low, self.clip, default_clip) if v is not None),
            "clip_high": next(v for v in (self.clip_high, self.clip, algo_defaults.get("clip_high"), default_clip)
                              if v is not None),
        }
        params = group_params(
            self.algorithm, kl_coef=self.kl_coef, kl_mode=self.kl_mode,
            kl_estimator=self.kl_estimator or ("k1" if self.kl_mode == "reward" else "k3"), gamma=self.discount,
            lam=self.lam, vf_coef=self.vf_coef, value_clip=self.value_clip, normalize_rewards=self.normalize_rewards,
            importance=self.importance_level, loss_aggregation=self.loss_aggregation,
            group_std=None if self.scale_rewards is None else self.scale_rewards == "group", **sides,
        )
        if params.loss_aggregation == "sequence_sum_norm":
            params.max_tokens = int((sampling or {}).get("max_new_tokens") or longest_response())
        return params

    def loss_params(self):
        """(the pair algorithm, its ``PairLossParams``): the options given, the algorithm's defaults for the rest."""
        from rlhf_pipeline.algorithms import pair_loss_params

        if self.is_group_algo:
            raise ValueError(f"--algo {self.algo} trains on groups and has no pair loss")
        algo = self.algorithm
        return algo, pair_loss_params(algo, eta=self.eta, beta=self.beta, label_smoothing=self.label_smoothing,
                                      gamma=self.gamma, nll_coef=self.nll_coef)


def _reference_columns(accelerator, setup_model, dd, config, temperature, pad_id, record, output: Path, data=None):
    """The splits with reference log-prob columns: from the data, from OUTPUT/ref_logps, or computed now. ``data`` is
    the module of the data's kind: ``pairs`` (default) or ``unpaired``."""
    import rlhf_pipeline.algorithms.pairs
    from rlhf_pipeline.training.stage import cached_splits

    data = data or rlhf_pipeline.algorithms.pairs
    add_ref_columns, compute_ref_logps = data.add_ref_columns, data.compute_ref_logps
    if all(c in ds.column_names for ds in dd.values() for c in data.REF_LOGP_COLUMNS):
        if record is not None and record.get("temperature") != temperature:
            raise PipelineError(
                f"{config.data}: its reference log-probs were computed at temperature {record.get('temperature')}, "
                f"but this run takes log-probs at {temperature}; pass --temperature {record.get('temperature')} or "
                "recompute them with rlhf ref-logps --temperature"
            )
        return dd
    def compute():
        values = {
            split: compute_ref_logps(
                accelerator, setup_model, ds, pad_id, temperature, config.eval_batch_size, config.pack_ratio
            )
            for split, ds in dd.items()
        }
        return add_ref_columns(dd, values)

    return cached_splits(accelerator, output / REF_LOGPS_CACHE, compute)


def main(config: TrainConfig) -> Path:
    if config.algorithm.data == UNPAIRED:
        return train_unpaired(config)
    if config.algorithm.data == BEST:
        return train_best(config)
    return train_groups(config) if config.is_group_algo else train_pairs(config)


def _finish(run, name: str, result, dd, sampling, training: dict) -> None:
    """Mark a pair or unpaired run complete: the manifest records the sampling settings and the training record."""
    from rlhf_pipeline.training.stage import StageRun

    run.finish(StageRun(
        result=result,
        rows_in=sum(ds.num_rows for ds in dd.values()),
        extra={"sampling": sampling, "training": training},
        summary=f"{name}: {result.steps} steps, loss {result.first_loss:.4f} -> {result.last_loss:.4f}",
    ))


def train_best(config: TrainConfig) -> Path:
    """``rlhf train --algo raft``: supervised fine-tuning on each prompt's best response (``rlhf filter --mode
    best``), on its sampled token ids (``rlhf_pipeline.algorithms.supervised``)."""
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.algorithms.supervised import SFTTask, sampled_rows
    from rlhf_pipeline.training.loop import load_trainable, prepare, train
    from rlhf_pipeline.training.stage import training_run, training_summary

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)
    algo = config.algorithm
    with training_run("train", config, [ref]) as run:
        if run.finished:
            return run.path
        dd = load_dataset_dict(ref, required=("train",))
        data, _ = sampled_rows(dd, max_length=sys.maxsize, source=str(ref))  # the filter applied the length limits
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        model = load_trainable(config, AutoModelForCausalLM.from_pretrained)
        run.start()  # the data and the model are read and checked: now the output directory is made
        setup = prepare(config, run.accelerator, model, data["train"].num_rows)
        task = SFTTask(pad_id(tokenizer), config.pack_ratio)
        result = train(config, run.accelerator, setup, tokenizer, task, data["train"], data.get("test"))
        training = {"algo": algo.name, "loss": "mean NLL of each best response's sampled tokens",
                    **training_summary(result)}
        _finish(run, algo.name, result, dd, find_in_lineage([ref], "sampling"), training)
    return run.path


def train_pairs(config: TrainConfig) -> Path:
    """``rlhf train`` for REBEL and the DPO family: see ``rlhf_pipeline.algorithms.pairs``."""
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.algorithms import logp_temperature
    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.algorithms.pairs import PairTask
    from rlhf_pipeline.training.loop import load_trainable, prepare, train
    from rlhf_pipeline.training.stage import training_run, training_summary

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)
    try:
        algo, params = config.loss_params()
    except ValueError as e:
        raise PipelineError(str(e)) from None
    with training_run("train", config, [ref]) as run:
        if run.finished:
            return run.path
        dd = load_dataset_dict(ref, required=("train",))
        for split, ds in dd.items():
            check_pairs(ds, f"{ref}:{split}")
        gap_scale = None
        if config.reward_gap_scale == "rms":
            dd, rms = scale_reward_gaps(dd, str(ref))
            gap_scale = {"mode": "rms", "rms": rms}
        sampling = find_in_lineage([ref], "sampling")
        temperature = logp_temperature(algo, config.temperature, sampling, str(ref))
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        pad = pad_id(tokenizer)
        model = load_trainable(config, AutoModelForCausalLM.from_pretrained)
        run.start()  # the data and the model are read and checked: now the output directory is made
        setup = prepare(config, run.accelerator, model, dd["train"].num_rows)
        if algo.needs_reference:
            dd = _reference_columns(
                run.accelerator, setup.model, dd, config, temperature, pad, find_in_lineage([ref], "ref_logps"),
                run.path,
            )
        task = PairTask(algo, params, temperature, pad, config.pack_ratio)
        result = train(
            config, run.accelerator, setup, tokenizer, task, dd["train"], dd.get("test"),
        )
        training = {"algo": algo.name, "loss_params": vars(params), "logp_temperature": temperature,
                    "reward_gap_scale": gap_scale, **training_summary(result)}
        _finish(run, algo.name, result, dd, sampling, training)
    return run.path


# ----------------------------------------------------------------------------------------------------------------
# On unpaired responses: KTO (rlhf_pipeline.algorithms.unpaired)


def train_unpaired(config: TrainConfig) -> Path:
    """``rlhf train --algo kto``: see ``rlhf_pipeline.algorithms.unpaired``. Reference log-probs of the responses and of their
    mismatched pairs come from the data (``rlhf ref-logps``) or from one pass here, kept in OUTPUT/ref_logps."""
    import rlhf_pipeline.algorithms.unpaired as unpaired
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.algorithms import logp_temperature, unpaired_loss_params
    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.training.loop import load_trainable, prepare, train
    from rlhf_pipeline.training.stage import training_run, training_summary

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)
    algo = config.algorithm
    params = unpaired_loss_params(algo, beta=config.beta, desirable_weight=config.desirable_weight,
                                  undesirable_weight=config.undesirable_weight)
    with training_run("train", config, [ref]) as run:
        if run.finished:
            return run.path
        dd = load_dataset_dict(ref, required=("train",))
        for split, ds in dd.items():
            unpaired.check_unpaired(ds, f"{ref}:{split}")
        sampling = find_in_lineage([ref], "sampling")
        temperature = logp_temperature(algo, config.temperature, sampling, str(ref))
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        pad = pad_id(tokenizer)
        model = load_trainable(config, AutoModelForCausalLM.from_pretrained)
        run.start()  # the data and the model are read and checked: now the output directory is made
        setup = prepare(config, run.accelerator, model, dd["train"].num_rows)
        dd = _reference_columns(run.accelerator, setup.model, dd, config, temperature, pad,
                                find_in_lineage([ref], "ref_logps"), run.path, data=unpaired)
        balance = unpaired.class_balance(dd["train"]["desirable"], params)
        if balance["warning"]:
            run.accelerator.print(f"warning: {balance['warning']}")
        task = unpaired.UnpairedTask(algo, params, temperature, pad, config.pack_ratio, config.eval_batch_size)
        result = train(config, run.accelerator, setup, tokenizer, task, dd["train"], dd.get("test"))
        training = {"algo": algo.name, "loss_params": vars(params), "logp_temperature": temperature,
                    "classes": balance, **training_summary(result)}
        _finish(run, algo.name, result, dd, sampling, training)
    return run.path


# ----------------------------------------------------------------------------------------------------------------
# On groups: the PPO family (rlhf_pipeline.algorithms.groups)


def _critic_source(config, ref) -> str:
    from rlhf_pipeline.datasets_io import find_in_lineage
    from rlhf_pipeline.modeling import check_model_ref

    if config.critic_model:
        return config.critic_model
    reward = find_in_lineage([ref], "reward") or {}
    if reward.get("reward_model"):
        check_model_ref("the critic (the reward model that scored the data)", reward["reward_model"], tokenizer=False)
        return reward["reward_model"]
    why = ("was scored with several reward sources, so no one reward model to start it from" if reward.get("sources")
           else "was not scored with a reward model")
    raise PipelineError(f"{config.data}: --algo {config.algo} needs a critic to start from, and the data {why}; pass "
                        "--critic-model (a reward model directory, e.g. from rlhf train-rm)")


def _rollout(config, params, accelerator, setup_model, dd, temperature, pad, output: Path):
    """The flattened samples of each split with old_logps, ref_logps, (old_values,) advantages (, returns): from
    OUTPUT/rollout when an interrupted run made them, else computed now and kept there."""
    import datasets

    from rlhf_pipeline.algorithms.groups import compute_advantages, flatten_groups, rollout_pass
    from rlhf_pipeline.modeling import load_causal_lm
    from rlhf_pipeline.training.stage import cached_splits

    def compute():
        uses_critic = config.algorithm.uses_critic
        samples = {split: flatten_groups(ds, f"{config.data}:{split}") for split, ds in dd.items()}
        reference = None
        if config.ref_model and params.kl_coef and config.ref_model != config.model:  # else: the rollout's own
            reference = load_causal_lm(config.ref_model, dtype="float32" if not config.bf16 else "bfloat16",
                                       trust_remote_code=config.trust_remote_code, device=accelerator.device)
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
        del reference
        return datasets.DatasetDict({split: datasets.Dataset.from_dict(s) for split, s in samples.items()})

    return cached_splits(accelerator, output / ROLLOUT_CACHE, compute)


def train_groups(config: TrainConfig) -> Path:
    """``rlhf train`` for the PPO family: see ``rlhf_pipeline.algorithms.groups``."""
    import statistics

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_pipeline.algorithms import logp_temperature
    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.distributed import on_main_process
    from rlhf_pipeline.algorithms.groups import GroupTask, check_groups, policy_and_critic
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.training.loop import load_trainable, prepare, train
    from rlhf_pipeline.training.stage import StageRun, training_run, training_summary

    check_model_ref("--model", config.model)
    if config.ref_model:
        check_model_ref("--ref-model", config.ref_model, tokenizer=False)
    if config.critic_model:
        check_model_ref("--critic-model", config.critic_model, tokenizer=False)
    ref = parse_ref(config.data)
    with training_run("train", config, [ref]) as run:
        if run.finished:
            return run.path
        dd = load_dataset_dict(ref, required=("train",))
        for split, ds in dd.items():
            check_groups(ds, f"{ref}:{split}")
        sampling = find_in_lineage([ref], "sampling")
        params = config.rl_params(sampling, lambda: max(
            (len(r) for ds in dd.values() for rs in ds["response_token_ids"] for r in rs), default=1))
        temperature = logp_temperature(config.algorithm, config.temperature, sampling, str(ref))
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        pad = pad_id(tokenizer)
        critic_path = _critic_source(config, ref) if config.algorithm.uses_critic else None

        def loader(path, trust_remote_code, **kwargs):
            policy = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
            if critic_path is None:
                return policy
            critic = AutoModelForSequenceClassification.from_pretrained(critic_path, num_labels=1,
                                                                        trust_remote_code=trust_remote_code, **kwargs)
            if critic.config.vocab_size < policy.config.vocab_size:
                raise PipelineError(
                    f"critic {critic_path} has a vocabulary of {critic.config.vocab_size}, the policy "
                    f"{policy.config.vocab_size}: the critic reads the policy's tokens, so it must share its "
                    "tokenizer; pass --critic-model with a reward model trained on the policy's tokenizer"
                )
            critic.config.use_cache = False
            critic.config.pad_token_id = pad
            return policy_and_critic(policy, critic)

        model = load_trainable(config, loader)
        run.start()  # the data and the models are read and checked: now the output directory is made
        num_train = sum(len(r) for r in dd["train"]["rewards"])
        critic_lr = config.learning_rate if config.critic_learning_rate is None else config.critic_learning_rate
        setup = prepare(config, run.accelerator, model, num_train,
                        learning_rate=lambda name: critic_lr if name.startswith("critic.") else config.learning_rate)
        data = _rollout(config, params, run.accelerator, setup.model, dd, temperature, pad, run.path)
        task = GroupTask(params, temperature, pad, config.pack_ratio)
        result = train(
            config, run.accelerator, setup, tokenizer, task, data["train"], data.get("test"),
        )
        if critic_path is not None:
            on_main_process(run.accelerator, lambda: tokenizer.save_pretrained(run.path / CRITIC))
        rewards = data["train"]["reward"]
        training = {
            "algo": params.algo, "rl_params": vars(params), "logp_temperature": temperature,
            "ref_model": config.ref_model or config.model, "critic_model": critic_path,
            "samples": {split: data[split].num_rows for split in data},
            "mean_reward": statistics.fmean(rewards) if rewards else None,
            **training_summary(result),
        }
        run.finish(StageRun(
            result=result,
            rows_in=sum(ds.num_rows for ds in dd.values()),
            extra={"sampling": sampling, "training": training},
            summary=f"{params.algo}: {result.steps} steps over {num_train} samples, loss {result.first_loss:.4f} "
            f"-> {result.last_loss:.4f}",
        ))
    return run.path


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(TrainConfig, main, "rlhf train", argv)


if __name__ == "__main__":
    sys.exit(cli())
