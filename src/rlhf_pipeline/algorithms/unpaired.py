"""The unpaired family (KTO): :class:`UnpairedAlgorithm`, :func:`compute_unpaired_loss`, the responses' token columns, the reference pass that stores the reference log-probs of each
response and of its mismatched pair once per dataset (as ``algorithms.pairs.compute_ref_logps`` does for pairs), and the training
task of the unpaired losses, which estimates KTO's reference point z0 once per optimizer step.

Used by ``rlhf ref-logps`` (the reference pass as its own stage) and ``rlhf train --algo kto`` (the pass when the data
has no reference columns, then :class:`UnpairedTask`).

The reference point. KTO (Ethayarajh et al. 2024, §4.1) compares each response's log-ratio r = logπθ − logπref with
z0 = KL(πθ ‖ πref), estimated as ``max(0, mean_j(logπθ(y'_j|x_j) − logπref(y'_j|x_j)))`` over mismatched pairs
(x_j, y'_j) and not backpropagated through. Here:

- the mismatched pairs are made once per dataset, by ``rlhf filter --mode unpaired`` (``kl_completion_token_ids``:
  the response of a row of another prompt, ``selection.mismatched_partners``), so their reference log-probs come from
  the same once-per-dataset pass as the responses' (``kl_ref_logp``), as TRL's ``precompute_ref_log_probs`` does;
- z0 is estimated over every row of the optimizer step's global batch, in :meth:`UnpairedTask.begin_step`, one
  no-grad forward of the step's mismatched pairs shared over the processes. TRL
  (``trl/trainer/kto_trainer.py``, ``KTOTrainer._compute_loss``) averages each process's micro-batch and then the
  processes, so its z0 changes with the micro-batch size, the accumulation and the number of processes; ours does not:
  batch 4 x accumulation 1, batch 2 x accumulation 2 and 2 processes x batch 2 train against the same z0 (tested).
- Evaluation (``rows=None``) estimates z0 within each evaluation batch, from that batch's own mismatched pairs, in
  the same forward as its responses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from rlhf_pipeline.algorithms.registry import (UNPAIRED, Family, ReferencePass, register, register_family, resolve,
                                               with_defaults)
from rlhf_pipeline.config import option
from rlhf_pipeline.contracts import (
    UNPAIRED_REF_LOGP_COLUMNS,
    UNPAIRED_TOKEN_COLUMNS,
    require_columns,
    require_types,
)
from rlhf_pipeline.layout import METRIC_WEIGHT

log = logging.getLogger(__name__)

REF_LOGP_COLUMNS = UNPAIRED_REF_LOGP_COLUMNS  # what the reference pass adds (``reference.reference_columns``)


@dataclass(frozen=True)
class UnpairedAlgorithm:
    """A loss on single responses labelled desirable or undesirable (``rlhf filter --mode unpaired``): KTO.

    ``loss(params, policy_logps, ref_logps, desirable, reference_point) -> (loss (B,), margin (B,), logratio (B,))``
    takes the responses' sequence log-probs, their reference log-probs (the once-per-dataset pass, as for DPO), the
    labels and the reference point z0, which the trainer estimates once per optimizer step from the step's mismatched
    (prompt, response) pairs (:class:`UnpairedTask`). ``params`` is ``losses.UnpairedLossParams``; ``defaults``
    are its fields that differ for this algorithm.
    """

    name: str
    loss: Callable | str
    help: str
    defaults: dict[str, Any] = field(default_factory=dict)
    demo: dict[str, Any] = field(default_factory=dict)
    filter: dict[str, Any] = field(default_factory=dict)
    data: str = UNPAIRED
    # rlhf iterate --overlap 1 trains on samples of the policy one behind: a reason why this algorithm cannot (refused
    # then), or "" (it can: the sampler is its reference, --ref-model)
    refuses_stale_sampler: str = ""
    # the log-ratios need the reference pass; no rewards, no critic; log-probs at 1.0, as the DPO family
    needs_reference: ClassVar[bool] = True
    uses_rewards: ClassVar[bool] = False
    uses_critic: ClassVar[bool] = False
    logp_at_sampling_temperature: ClassVar[bool] = False

    def loss_fn(self) -> Callable:
        return resolve(self.loss)


def compute_unpaired_loss(algorithm: UnpairedAlgorithm | str, params, policy_logps, ref_logps, desirable,
                          reference_point):
    """Per-example loss (B,) and detached per-example metrics (B,) for one batch of unpaired responses.

    Metrics: ``margin`` is β·(r − z0) signed by the label (> 0 where the response sits on the side of z0 its label
    asks for), ``accuracy`` the share where it does, ``kl`` the reference point z0 the batch was trained against,
    ``logratio`` r = logπθ − logπref, and ``desirable_logratio`` / ``undesirable_logratio`` r over each label's
    responses (weighted metrics: ``NAME@weight`` is 1 where the response has that label).
    """
    import torch

    from rlhf_pipeline.algorithms.registry import get

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
    # r over the desirable and over the undesirable responses apart (TRL's rewards/chosen and rewards/rejected, but
    # for β): means over those responses alone, weighed by the label (layout.METRIC_WEIGHT)
    wanted = desirable.to(margin.dtype)
    for name, weight in (("desirable_logratio", wanted), ("undesirable_logratio", 1 - wanted)):
        metrics[name], metrics[name + METRIC_WEIGHT] = logratio.detach() * weight, weight
    return loss, metrics


def unpaired_loss_params(algorithm: UnpairedAlgorithm, **given: Any):
    """``losses.UnpairedLossParams`` from the options given (None = unset), the algorithm's defaults for the rest."""
    from rlhf_pipeline.losses import UnpairedLossParams

    return with_defaults(UnpairedLossParams, algorithm.defaults, **given)


def check_unpaired(ds, source: str) -> None:
    hint = "pass data made by rlhf filter --mode unpaired (--algo kto trains on single labelled responses)"
    require_columns(ds, UNPAIRED_TOKEN_COLUMNS, source, hint)
    require_types(ds, {"prompt_token_ids": "list of int", "completion_token_ids": "list of int",
                       "kl_completion_token_ids": "list of int", "desirable": "bool",
                       **{c: "number" for c in REF_LOGP_COLUMNS}}, source, hint)


def unpaired_lengths(ds) -> list[int]:
    """Tokens in one row's training forward: the prompt and the response."""
    return [len(p) + len(c) for p, c in zip(ds["prompt_token_ids"], ds["completion_token_ids"])]


def response_logps(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int, temperature: float,
                   pack_ratio: float = 0.0):
    """Sequence log-probs (N,) of ``responses[i]`` after ``prompts[i]`` in one forward, and the batch."""
    from rlhf_pipeline.logprobs import build_batch, sequence_logps

    batch = build_batch(prompts, responses, pad_id, pack_ratio=pack_ratio).to(next(model.parameters()).device)
    return sequence_logps(model, batch, temperature=temperature), batch


def _rows_logps(model, rows: list[dict[str, Any]], pad_id: int, temperature: float, pack_ratio: float,
                responses: bool = True):
    """Log-probs of each row's response (``responses``) and then of its mismatched pair, in one forward: (2B,) or,
    with ``responses=False``, the mismatched pairs' alone (B,)."""
    prompts = [r["prompt_token_ids"] for r in rows]
    kl = [r["kl_completion_token_ids"] for r in rows]
    if not responses:
        return response_logps(model, prompts, kl, pad_id, temperature, pack_ratio)
    return response_logps(model, prompts + prompts, [r["completion_token_ids"] for r in rows] + kl, pad_id,
                          temperature, pack_ratio)


def compute_ref_logps(
    accelerator, model, ds, pad_id: int, temperature: float, batch_size: int, pack_ratio: float = 0.0
) -> tuple[list, list]:
    """Reference log-probs of every row's response and of its mismatched pair, in length-sorted batches shared over
    processes (each batch one forward over 2B sequences)."""
    from rlhf_pipeline.distributed import sharded_inference

    def compute(ids: list[int]) -> list[tuple[float, float]]:
        logps, _ = _rows_logps(model, ds.select(ids).to_list(), pad_id, temperature, pack_ratio)
        return list(zip(logps[: len(ids)].tolist(), logps[len(ids) :].tolist()))

    lengths = [2 * len(p) + len(c) + len(k) for p, c, k in
               zip(ds["prompt_token_ids"], ds["completion_token_ids"], ds["kl_completion_token_ids"])]
    values = sharded_inference(accelerator, model, lengths, batch_size, compute, "reference log-probs")
    return [c for c, _ in values], [k for _, k in values]


def class_balance(desirable: list[bool], params) -> dict[str, Any]:
    """Class counts of the training split and the paper's check (Ethayarajh et al. 2024, eq. 8): λ_D·n_D / (λ_U·n_U)
    should be in [1, 4/3]; ``warning`` says what to change when it is not (TRL warns the same way in
    ``KTOTrainer._prepare_dataset``)."""
    n_d = sum(bool(d) for d in desirable)
    n_u = len(desirable) - n_d
    w_d, w_u = params.desirable_weight, params.undesirable_weight
    ratio = (w_d * n_d) / (w_u * n_u) if w_u * n_u else float("inf")
    warning = None
    if not 1.0 <= ratio <= 4 / 3 + 1e-9:
        warning = (f"KTO: {n_d} desirable and {n_u} undesirable responses with --desirable-weight {w_d:g} and "
                   f"--undesirable-weight {w_u:g} give lambda_D n_D / (lambda_U n_U) = {ratio:.3g}, outside the "
                   f"paper's [1, 4/3]; e.g. --desirable-weight {w_u * n_u / max(n_d, 1):.3g} (or "
                   f"--undesirable-weight {w_d * n_d / max(n_u, 1):.3g}) makes it 1")
    return {"desirable": n_d, "undesirable": n_u, "weighted_ratio": ratio, "warning": warning}


class UnpairedTask:
    """A micro-batch's responses in one forward; z0 from the whole step's mismatched pairs (:meth:`begin_step`); the
    loss from :func:`compute_unpaired_loss`. ``kl_batch_size`` is the batch size of the z0 pass (the
    evaluation batch size: fixed, so that z0 does not change with ``--batch-size``)."""

    def __init__(self, algorithm, params, temperature: float, pad_id: int, pack_ratio: float = 0.0,
                 kl_batch_size: int = 8):
        from rlhf_pipeline.algorithms.registry import get

        self.algorithm = get(algorithm) if isinstance(algorithm, str) else algorithm
        self.params, self.temperature, self.pad_id, self.pack_ratio = params, temperature, pad_id, pack_ratio
        self.kl_batch_size = kl_batch_size
        self.reference_point: float | None = None  # z0 of the current optimizer step; None: per batch (evaluation)

    def lengths(self, ds) -> list[int]:
        return unpaired_lengths(ds)

    def collate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return rows  # tensors are built in loss(), by logprobs.build_batch, packed or padded per micro-batch

    def begin_step(self, accelerator, model, rows) -> None:
        """z0 of this optimizer step from all its rows' mismatched pairs: a no-grad forward shared over the processes
        (every process runs the same number of batches, for ZeRO-3), gathered, averaged in row order."""
        import torch
        from accelerate.utils import gather_object

        from rlhf_pipeline.distributed import sharded_batches
        from rlhf_pipeline.losses import kto_reference_point

        if rows is None:
            self.reference_point = None
            return
        lengths = [len(p) + len(k) for p, k in zip(rows["prompt_token_ids"], rows["kl_completion_token_ids"])]
        batches = sharded_batches(lengths, self.kl_batch_size, accelerator.num_processes, accelerator.process_index)
        results: list[tuple[int, float]] = []
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for idx in batches:
                with accelerator.autocast():  # a stand-in on row 0 keeps ZeRO-3's collective forwards in step
                    logps, _ = _rows_logps(model, rows.select(idx or [0]).to_list(), self.pad_id, self.temperature,
                                           self.pack_ratio, responses=False)
                if idx is not None:
                    results += zip(idx, logps.tolist())
        model.train(was_training)
        if accelerator.num_processes > 1:
            results = gather_object(results)
        policy = dict(results)
        z0 = kto_reference_point(torch.tensor([policy[i] for i in range(len(lengths))], dtype=torch.float64),
                                 torch.tensor(rows["kl_ref_logp"], dtype=torch.float64))
        self.reference_point = float(z0)

    def loss(self, model, rows):
        import torch

        from rlhf_pipeline.logprobs import positions_processed, to_device
        from rlhf_pipeline.losses import kto_reference_point

        n = len(rows)
        per_batch = self.reference_point is None  # evaluation: z0 from this batch's own mismatched pairs
        if per_batch:
            logps, batch = _rows_logps(model, rows, self.pad_id, self.temperature, self.pack_ratio)
        else:
            logps, batch = response_logps(model, [r["prompt_token_ids"] for r in rows],
                                          [r["completion_token_ids"] for r in rows], self.pad_id, self.temperature,
                                          self.pack_ratio)
        device, dtype = logps.device, logps.dtype

        def column(name, kind=dtype):  # made on the host, copied without waiting for the forward
            return to_device(torch.tensor([r[name] for r in rows], dtype=kind), device)

        z0 = (kto_reference_point(logps[n:], column("kl_ref_logp")) if per_batch
              else to_device(torch.tensor(self.reference_point, dtype=dtype), device))
        losses, metrics = compute_unpaired_loss(
            self.algorithm, self.params, logps[:n], column("completion_ref_logp"), column("desirable", torch.bool), z0
        )
        return losses.mean(), metrics, (batch.num_real_tokens, positions_processed(model, batch))


# ----------------------------------------------------------------------------------------------------------------
# The family's options and recipe


@dataclass(kw_only=True)
class UnpairedOptions:
    """``rlhf train`` options of KTO (its ``--beta`` is the DPO family's, ``PairOptions.beta``)."""

    options_group: ClassVar[str] = "unpaired options (KTO)"

    desirable_weight: Optional[float] = option(
        None, help="KTO: weight lambda_D of the desirable responses' losses (default 1.0).",
        reads=lambda algorithm: algorithm.data == UNPAIRED,
    )
    undesirable_weight: Optional[float] = option(
        None, help="KTO: weight lambda_U of the undesirable responses' losses (default 1.0); the paper advises "
        "lambda_D n_D / (lambda_U n_U) in [1, 4/3], and training warns outside it.",
        reads=lambda algorithm: algorithm.data == UNPAIRED,
    )

    def check_options(self, algorithm) -> None:
        """The weights' ranges. (--beta: PairOptions; an option this algorithm does not read:
        ``registry.check_reads``.)"""
        for name in ("desirable_weight", "undesirable_weight"):
            value, flag = getattr(self, name), "--" + name.replace("_", "-")
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0")
        if self.desirable_weight == 0 and self.undesirable_weight == 0:
            raise ValueError("--desirable-weight and --undesirable-weight are both 0: nothing would be trained")


def train(config) -> Path:
    """``rlhf train --algo kto``: reference log-probs of the responses and of their mismatched pairs come from the
    data (``rlhf ref-logps``) or from one pass here, kept in OUTPUT/ref_logps; then :class:`UnpairedTask`."""
    from rlhf_pipeline.algorithms.reference import data_reference, reference_columns
    from rlhf_pipeline.algorithms.registry import logp_temperature
    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.training.stage import TrainingJob, run_training, training_record, training_summary

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)
    algo = config.algorithm
    params = unpaired_loss_params(algo, beta=config.beta, desirable_weight=config.desirable_weight,
                                  undesirable_weight=config.undesirable_weight)

    def read(run) -> TrainingJob:
        dd = load_dataset_dict(ref, required=("train",))
        for split, ds in dd.items():
            check_unpaired(ds, f"{ref}:{split}")
        sampling = find_in_lineage([ref], "sampling")
        temperature = logp_temperature(algo, config.temperature, sampling, str(ref))
        reference = data_reference(config, algo, dd, REF_LOGP_COLUMNS, ref, sampling, temperature)
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        pad = pad_id(tokenizer)
        balance = class_balance(dd["train"]["desirable"], params)

        def task(run, setup):
            splits = reference_columns(run.accelerator, setup.model, dd, config, temperature, pad, run.path,
                                       REF_LOGP_COLUMNS, compute_ref_logps)
            if balance["warning"]:
                run.accelerator.print(f"warning: {balance['warning']}")
            task = UnpairedTask(algo, params, temperature, pad, config.pack_ratio, config.eval_batch_size)
            return task, splits["train"], splits.get("test")

        def record(run, result):
            training = {"algo": algo.name, "loss_params": vars(params), "logp_temperature": temperature,
                        "ref_model": reference, "classes": balance, **training_summary(result)}
            return training_record(algo.name, result, dd, sampling, training, config.model)

        return TrainingJob(tokenizer, dd["train"].num_rows, task, record, data=dd)

    return run_training("train", config, [ref], read)


register_family(Family(UNPAIRED, UnpairedOptions, train, "single responses labelled desirable or undesirable "
                       "(rlhf filter --mode unpaired)",
                       reference=ReferencePass("completion_token_ids", REF_LOGP_COLUMNS, check_unpaired,
                                               compute_ref_logps)))

register(UnpairedAlgorithm(
    "kto", "rlhf_pipeline.losses:kto_terms", "unpaired desirable/undesirable responses, "
    "1 - sigmoid(beta (log-ratio - z0)) with z0 the KL from mismatched pairs",
    demo={"learning_rate": 3e-4, "beta": 0.1}))
