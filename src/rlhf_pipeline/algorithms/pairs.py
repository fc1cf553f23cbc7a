"""The pair family: REBEL and the DPO family on (chosen, rejected) pairs (``rlhf filter --mode pairs``).

What is here, top to bottom: :class:`PairAlgorithm` (what an entry declares), :func:`compute_pair_loss` (the
dispatch and input checks around an entry's pure loss from ``losses.py``), the pairs' token columns and their
sequence log-probs in one forward, the reference pass that stores the sampling policy's log-probs once per dataset,
:class:`PairTask` (the training task), :class:`PairOptions` (the family's ``rlhf train`` options and their checks),
:func:`train` (the family's recipe: the body of ``rlhf train`` on pairs), and the registry entries.

Used by ``rlhf train`` on pairs, ``rlhf ref-logps`` (the reference pass as its own stage), and the trainer benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Optional

from rlhf_pipeline.algorithms.registry import (PAIRS, Family, ReferencePass, register, register_family, resolve,
                                               takes_beta, with_defaults)
from rlhf_pipeline.config import option
from rlhf_pipeline.contracts import PAIR_TOKEN_COLUMNS, REF_LOGP_COLUMNS, require_columns, require_types


@dataclass(frozen=True)
class PairAlgorithm:
    """A loss on (chosen, rejected) pairs.

    ``loss(params, policy_chosen, policy_rejected, **inputs) -> (loss (B,), margin (B,), chosen (B,), rejected (B,))``
    receives the inputs its flags ask for: ``ref_chosen_logps``/``ref_rejected_logps`` (``needs_reference``),
    ``chosen_rewards``/``rejected_rewards`` (``uses_rewards``), ``chosen_lengths``/``rejected_lengths``
    (``length_normalized``). ``margin`` is the implicit reward margin its ``reward/*_margin`` and ``*_accuracy``
    metrics report; ``chosen``/``rejected`` are the log-ratios (or what stands for them) logged as ``logp/*``.
    ``params`` is ``losses.PairLossParams``; ``defaults`` are its fields that differ for this algorithm.
    """

    name: str
    loss: Callable | str
    help: str
    needs_reference: bool = True
    # the reference must be the policy that sampled the pairs (REBEL regresses onto its log-ratios); else, as for
    # DPO, it is conventionally the model training starts from (algorithms.reference.check_reference)
    sampler_reference: bool = False
    uses_rewards: bool = False
    regression: bool = False  # the loss regresses log-ratios onto a target scaled by --eta (REBEL)
    length_normalized: bool = False
    target_margin: bool = False  # the loss has a target reward margin, --gamma (SimPO)
    logp_at_sampling_temperature: bool = False  # REBEL's code takes log-probs at the sampling temperature
    label_smoothing: bool = False  # the loss is cDPO's: --label-smoothing > 0 is required (and refused elsewhere)
    nll_term: bool = True  # --nll-coef may add an NLL term on the chosen response (RPO)
    sft_term: bool = False  # the loss has an NLL term of its own, weighted by --sft-coef (ORPO, CPO)
    defaults: dict[str, Any] = field(default_factory=dict)  # PairLossParams fields that differ from its defaults
    demo: dict[str, Any] = field(default_factory=dict)  # rlhf train options that make rlhf demo learn
    filter: dict[str, Any] = field(default_factory=dict)  # rlhf filter options that iterate and demo pass
    # params -> factor on the gradient only (the logged loss keeps its value); REBEL backpropagates its code's form
    gradient_scale: Callable | str | None = None
    data: str = PAIRS
    # rlhf iterate --overlap 1 trains on samples of the policy one behind: a reason why this algorithm cannot (refused
    # then), or "" (it can: the sampler is the reference, --ref-model; the reference-free losses need none)
    refuses_stale_sampler: str = ""
    uses_critic: ClassVar[bool] = False  # pair losses train the policy alone

    def loss_fn(self) -> Callable:
        return resolve(self.loss)

    def gradient_scale_fn(self) -> Callable:
        return resolve(self.gradient_scale)


# A pair counts as won (reward/*_accuracy) only when its chosen and rejected differ by more than this, in nats.
ACCURACY_TOLERANCE = 1e-4


def compute_pair_loss(algorithm: PairAlgorithm | str, params, policy_chosen_logps, policy_rejected_logps,
                      ref_chosen_logps=None, ref_rejected_logps=None, chosen_rewards=None, rejected_rewards=None,
                      chosen_lengths=None, rejected_lengths=None):
    """Per-example loss (B,) and detached per-example metrics (B,) for one batch of pairs.

    Metrics: ``margin`` is the implicit reward margin (β·Δ for DPO/cDPO/IPO; Δ/eta for REBEL, the quantity
    regressed onto rc − rr; β·(logπc/|yc| − logπr/|yr|) for SimPO); ``accuracy`` is 1.0 where margin > 0
    (REBEL's "sign_align") and chosen and rejected differ by more than :data:`ACCURACY_TOLERANCE` nats (at step 1 the
    policy's packed forward and the reference's padded one differ by float noise, ~1e-5 nats, which is no win);
    ``chosen_logratio``/``rejected_logratio`` are π − ref (SimPO: length-normalised logps).

    ``params.nll_coef`` α > 0 adds α·(−logπθ(chosen)/|chosen|) to each pair's loss (RPO, Pang et al. 2024, eq. 2: the
    chosen response's NLL normalised by its length), with metric ``nll``; it needs ``chosen_lengths``. TRL's ``"sft"``
    loss type beside ``"sigmoid"`` (``rpo_alpha`` before trl#3906) takes the cross-entropy over all chosen tokens of
    the micro-batch instead (a token mean, so long responses weigh more, and the value depends on how a batch is cut);
    OpenRLHF's ``nll_loss_coef`` is the same idea. Per pair, as here, the loss is the same whatever the batch size and
    accumulation.
    """
    from rlhf_pipeline.algorithms.registry import get

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
    decided = (chosen - rejected).detach().abs() > ACCURACY_TOLERANCE
    metrics = {"margin": margin, "accuracy": ((margin > 0) & decided).to(margin.dtype),
               "chosen_logratio": chosen.detach(), "rejected_logratio": rejected.detach()}
    if nll_coef:
        nll = -policy_chosen_logps / chosen_lengths.detach().to(policy_chosen_logps.dtype)
        loss = loss + nll_coef * nll
        metrics["nll"] = nll.detach()
    return loss, metrics



def pair_loss_params(algorithm: PairAlgorithm, **given: Any):
    """``losses.PairLossParams`` from the options given (None = unset), the algorithm's defaults filling the rest."""
    from rlhf_pipeline.losses import PairLossParams

    return with_defaults(PairLossParams, algorithm.defaults, **given)


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
    """Chosen and rejected of a micro-batch in one forward; the loss from :func:`compute_pair_loss`."""

    def __init__(self, algorithm, params, temperature: float, pad_id: int, pack_ratio: float = 0.0):
        from rlhf_pipeline.algorithms.registry import get

        self.algorithm = get(algorithm) if isinstance(algorithm, str) else algorithm
        self.params, self.temperature, self.pad_id, self.pack_ratio = params, temperature, pad_id, pack_ratio

    def lengths(self, ds) -> list[int]:
        return pair_lengths(ds)

    def collate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return rows  # tensors are built in loss(), by logprobs.build_batch, packed or padded per micro-batch

    def loss(self, model, rows):
        import torch

        from rlhf_pipeline.logprobs import positions_processed, response_lengths, to_device

        chosen, rejected, batch = pair_logps(model, rows, self.pad_id, self.temperature, self.pack_ratio)
        device, dtype = chosen.device, chosen.dtype

        def column(name):  # made on the host, copied without waiting for the forward
            return to_device(torch.tensor([r[name] for r in rows], dtype=dtype), device)

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
        return loss, metrics, (batch.num_real_tokens, positions_processed(model, batch))


# ----------------------------------------------------------------------------------------------------------------
# The family's options and recipe

BETA_HELP = ("DPO/cDPO/IPO/SimPO/KTO strength, ORPO's lambda, CPO's beta (default 0.1; 5.0 for dpo_norm, on its "
             "per-token log-ratios; 2.0 for SimPO).")


@dataclass(kw_only=True)
class PairOptions:
    """``rlhf train`` options of REBEL and the DPO family."""

    options_group: ClassVar[str] = "pair options (REBEL, DPO family)"

    eta: Optional[float] = option(
        None, help="REBEL: scale of the log-ratio regression, ((logratio_c - logratio_r)/eta - (r_c - r_r))^2 "
        "(default 1; REBEL's UltraFeedback runs use 1e6). SPPO: the target log-ratio of a response is eta x (its win "
        "rate - 1/2) (default 100).",
        reads=lambda algorithm: getattr(algorithm, "regression", False),
    )
    reward_gap_scale: Literal["none", "rms"] = option(
        "none", help="REBEL: rms divides the reward gaps (chosen - rejected) by their root mean square over the train "
        "split, so that --eta does not depend on the reward's scale (then eta 1 regresses the log-ratio gap onto gaps "
        "of typical size 1); recorded in the manifest.",
        reads=lambda algorithm: getattr(algorithm, "uses_rewards", False),
    )
    beta: Optional[float] = option(None, help=BETA_HELP, reads=takes_beta)
    nll_coef: float = option(
        0.0, help="DPO family: weight alpha of an NLL term on the chosen response, alpha * (-log pi(chosen) / "
        "|chosen|) per pair (RPO; TRL's sft loss type, OpenRLHF's nll_loss_coef); 0 = none.",
        reads=lambda algorithm: getattr(algorithm, "nll_term", False),
    )
    label_smoothing: Optional[float] = option(None, help="cDPO: probability that a label is flipped (default 0.1).",
                                              reads=lambda algorithm: getattr(algorithm, "label_smoothing", False))
    gamma: float = option(0.5, help="SimPO: target reward margin.",
                          reads=lambda algorithm: getattr(algorithm, "target_margin", False))
    sft_coef: Optional[float] = option(
        None, help="ORPO / CPO: weight of their NLL term on the chosen response (default 1.0: ORPO's loss, CPO's "
        "alpha; TRL's cpo_alpha).", reads=lambda algorithm: getattr(algorithm, "sft_term", False),
    )

    def check_options(self, algorithm) -> None:
        """The pair options' ranges, and cDPO's label smoothing. (An option this algorithm does not read:
        ``registry.check_reads``, from each option's ``reads``.)"""
        # The losses check these too (losses.py), but only at the first step, after the model is loaded.
        if self.eta is not None and self.eta <= 0:
            raise ValueError("--eta must be > 0 (REBEL divides the log-ratio gap by it)")
        if self.nll_coef < 0:
            raise ValueError("--nll-coef must be >= 0")
        if self.beta is not None and self.beta <= 0:
            raise ValueError("--beta must be > 0")
        if self.label_smoothing is not None:
            if not 0 <= self.label_smoothing < 0.5:
                raise ValueError("--label-smoothing must be in [0, 0.5)")
            if getattr(algorithm, "label_smoothing", False) and self.label_smoothing == 0:
                raise ValueError(f"--algo {algorithm.name} needs --label-smoothing > 0 (e.g. 0.1); with 0 it is "
                                 "--algo dpo")
        if self.gamma < 0:
            raise ValueError("--gamma must be >= 0")
        if self.sft_coef is not None and self.sft_coef < 0:
            raise ValueError("--sft-coef must be >= 0")

    def loss_params(self):
        """(the pair algorithm, its ``losses.PairLossParams``): the options given, the algorithm's defaults for the
        rest. (Mixed into ``rlhf train``'s config, which knows its ``algorithm``.)"""
        algorithm = self.algorithm
        if algorithm.data != PAIRS:
            raise ValueError(f"--algo {algorithm.name} trains on {algorithm.data} and has no pair loss")
        return algorithm, pair_loss_params(algorithm, eta=self.eta, beta=self.beta,
                                           label_smoothing=self.label_smoothing, gamma=self.gamma,
                                           nll_coef=self.nll_coef, sft_coef=self.sft_coef)


def train(config) -> Path:
    """``rlhf train`` on pairs (REBEL, the DPO family): the reference pass when the algorithm needs one, then
    :class:`PairTask`."""
    from rlhf_pipeline.algorithms.reference import data_reference, reference_columns
    from rlhf_pipeline.algorithms.registry import logp_temperature
    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.training.stage import TrainingJob, run_training, training_record, training_summary

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)
    try:
        algo, params = config.loss_params()
    except ValueError as e:
        raise PipelineError(str(e)) from None

    def read(run) -> TrainingJob:
        dd = load_dataset_dict(ref, required=("train",))
        for split, ds in dd.items():
            check_pairs(ds, f"{ref}:{split}")
        gap_scale = None
        if config.reward_gap_scale == "rms":
            dd, rms = scale_reward_gaps(dd, str(ref))
            gap_scale = {"mode": "rms", "rms": rms}
        sampling = find_in_lineage([ref], "sampling")
        temperature = logp_temperature(algo, config.temperature, sampling, str(ref))
        reference = (data_reference(config, algo, dd, REF_LOGP_COLUMNS, ref, sampling, temperature)
                     if algo.needs_reference else None)
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        pad = pad_id(tokenizer)

        def task(run, setup):
            splits = dd
            if algo.needs_reference:
                splits = reference_columns(run.accelerator, setup.model, dd, config, temperature, pad, run.path,
                                           REF_LOGP_COLUMNS, compute_ref_logps)
            return PairTask(algo, params, temperature, pad, config.pack_ratio), splits["train"], splits.get("test")

        def record(run, result):
            training = {"algo": algo.name, "loss_params": vars(params), "logp_temperature": temperature,
                        "ref_model": reference, "reward_gap_scale": gap_scale, **training_summary(result)}
            return training_record(algo.name, result, dd, sampling, training, config.model)

        return TrainingJob(tokenizer, dd["train"].num_rows, task, record, data=dd)

    return run_training("train", config, [ref], read)


register_family(Family(PAIRS, PairOptions, train, "preference pairs (rlhf filter --mode pairs)",
                       reference=ReferencePass("chosen_token_ids", REF_LOGP_COLUMNS, check_pairs, compute_ref_logps)))

register(PairAlgorithm(
    "rebel", "rlhf_pipeline.losses:rebel_terms", "regress the log-ratio gap / eta onto the reward gap",
    sampler_reference=True, uses_rewards=True, regression=True, logp_at_sampling_temperature=True, nll_term=False,
    gradient_scale="rlhf_pipeline.losses:rebel_gradient_scale", demo={"learning_rate": 3e-4, "eta": 1.0}))
register(PairAlgorithm(
    "dpo", "rlhf_pipeline.losses:dpo_terms", "-log sigmoid(beta x log-ratio gap)",
    demo={"learning_rate": 3e-4, "beta": 0.1}))
register(PairAlgorithm(
    "cdpo", "rlhf_pipeline.losses:cdpo_terms", "DPO with label smoothing", label_smoothing=True,
    defaults={"label_smoothing": 0.1}, demo={"learning_rate": 3e-4, "beta": 0.1}))
register(PairAlgorithm(
    "dpo_norm", "rlhf_pipeline.losses:dpo_norm_terms", "DPO on per-token mean log-ratios (Tulu 3's length-normalised "
    "DPO)", length_normalized=True, defaults={"beta": 5.0}, demo={"learning_rate": 3e-4}))
register(PairAlgorithm(
    "ipo", "rlhf_pipeline.losses:ipo_terms", "(log-ratio gap - 1/(2 beta))^2",
    demo={"learning_rate": 3e-4, "beta": 0.1}))
register(PairAlgorithm(
    "simpo", "rlhf_pipeline.losses:simpo_terms", "reference-free, length-normalised, target margin gamma",
    needs_reference=False, length_normalized=True, target_margin=True, defaults={"beta": 2.0},
    demo={"learning_rate": 3e-4}))
register(PairAlgorithm(
    "orpo", "rlhf_pipeline.losses:orpo_terms", "reference-free: the chosen NLL + beta x the log odds ratio term",
    needs_reference=False, length_normalized=True, nll_term=False, sft_term=True, demo={"learning_rate": 3e-4}))
register(PairAlgorithm(
    "cpo", "rlhf_pipeline.losses:cpo_terms", "reference-free: -log sigmoid(beta x log-prob gap) + the chosen NLL",
    needs_reference=False, length_normalized=True, nll_term=False, sft_term=True, demo={"learning_rate": 3e-4}))
