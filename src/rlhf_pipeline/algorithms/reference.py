"""The once-per-dataset reference pass that pair losses (DPO family) and KTO train against: the sampling policy's
log-probs of every response, stored as columns, so no second model sits in memory during training.

The columns come from the data when ``rlhf ref-logps`` made them, else from ``OUTPUT/ref_logps`` when an interrupted
run of this output computed them, else from one pass here with the model as loaded (before its first update), kept
in ``OUTPUT/ref_logps`` so a resumed run does not redo them. Columns made at another temperature are an error, never
silently redone.

Which model is the reference: ``--ref-model`` (:class:`ReferenceOptions`, one option for every algorithm with a
reference: REBEL, the DPO family, KTO, the PPO family's KL), else the model as loaded (``--model``). The data's
lineage says which policy sampled it (the generate manifest's ``sampling.model``), and :func:`check_reference`
compares: REBEL's objective regresses onto the sampler's log-ratios (it declares ``sampler_reference``), so a
reference that is not the sampler is one error line; for the DPO family and KTO the reference is conventionally
the model training starts from, so ``--model`` that did not sample the data (without ``--ref-model``) is a warning
line. Columns from ``rlhf ref-logps`` record the model that computed them, which must be the reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence

from rlhf_pipeline.config import option
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import REF_LOGPS_CACHE
from rlhf_pipeline.modeling import same_model

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ReferenceOptions:
    """``rlhf train``'s reference model, one option for every algorithm that has a reference."""

    options_group: ClassVar[str] = "reference options (REBEL, DPO family, KTO, PPO family)"

    ref_model: Optional[str] = option(
        None, help="The reference model (default: the starting policy, --model). REBEL: the policy that sampled the "
        "data, when --model is another (its objective needs the sampler's log-probs). DPO family, KTO: e.g. the SFT "
        "model kept as the reference over iterations. PPO family: the KL reference (rlhf iterate: its model). "
        "Recorded in the manifest.", reads=lambda algorithm: algorithm.needs_reference,
    )


def check_reference(config, algorithm: Any, sampling: dict | None, record: dict | None) -> str:
    """The reference model of this run (``--ref-model``, else ``--model``), checked against the data's lineage: the
    policy that sampled it (``sampling``) and the model that computed its reference columns (``record``, from
    ``rlhf ref-logps``). One error line where the objective needs the sampler (``sampler_reference``) and the
    reference is not it, or the columns were computed by another model; a warning line where the DPO family or KTO
    trains ``--model`` on data another policy sampled against ``--model`` itself."""
    reference = config.ref_model or config.model
    computed = (record or {}).get("model")
    if computed is not None and not same_model(computed, reference):
        raise PipelineError(
            f"{config.data}: its reference log-probs were computed by {computed} (rlhf ref-logps), but this run's "
            f"reference is {reference}; pass --ref-model {computed}, or recompute them with rlhf ref-logps --model "
            f"{reference}"
        )
    sampler = (sampling or {}).get("model")
    if sampler is None or same_model(sampler, reference):
        return reference
    if getattr(algorithm, "sampler_reference", False):
        raise PipelineError(
            f"{config.data}: --algo {algorithm.name} regresses onto the log-probs of the policy that sampled the data, "
            f"{sampler}, but its reference here is {reference}; pass --model {sampler} (the next iteration trains "
            f"the policy that sampled it), or --ref-model {sampler} to train another model against the sampler"
        )
    if config.ref_model is None:
        log.warning("%s: the data was sampled by %s, and --algo %s trains %s against itself as the reference; to "
                    "keep the sampler (or the SFT model) as the reference, pass --ref-model", config.data, sampler,
                    algorithm.name, reference)
    return reference


def precision(config) -> str:
    """The dtype a run takes its reference log-probs in, and must find in cached ones: bfloat16 with ``--bf16``, else
    float32."""
    return "bfloat16" if config.bf16 else "float32"


def load_reference(config, accelerator):
    """``--ref-model`` for inference beside the policy (same dtype, on this process's device), or None when it is
    the policy as loaded (unset, or ``--model`` itself). Whole on every process under ZeRO-3 too (a full copy on
    each GPU: 16 GB at 8B in bf16), where only the trained model is partitioned."""
    from rlhf_pipeline.distributed import outside_zero3_init
    from rlhf_pipeline.modeling import load_causal_lm

    if not config.ref_model or same_model(config.ref_model, config.model):
        return None
    with outside_zero3_init(accelerator):
        return load_causal_lm(config.ref_model, dtype=precision(config),
                              trust_remote_code=config.trust_remote_code, device=accelerator.device,
                              attn_implementation=config.attn_implementation)


def add_ref_columns(dd, values: dict[str, tuple[list, list]], columns: Sequence[str]):
    """Each split with the two reference columns ``columns`` (float64) set to ``values[split]``, replacing any."""
    from datasets import Value

    out = {}
    for split, ds in dd.items():
        ds = ds.remove_columns([c for c in columns if c in ds.column_names])
        for name, column in zip(columns, values[split]):
            ds = ds.add_column(name, column, feature=Value("float64"))
        out[split] = ds
    return type(dd)(out)


def has_columns(dd, columns: Sequence[str]) -> bool:
    """Whether every split holds the reference columns already (made by ``rlhf ref-logps``)."""
    return all(c in ds.column_names for ds in dd.values() for c in columns)


def data_reference(config, algorithm: Any, dd, columns: Sequence[str], ref, sampling: dict | None,
                   temperature: float) -> str:
    """The reference model, checked before the run starts against the data's lineage and its reference columns'
    ``ref_logps`` record (:func:`check_reference`, :func:`check_columns`); ``ref`` is the data's reference,
    ``--ref-model`` must exist."""
    from rlhf_pipeline.datasets_io import find_in_lineage
    from rlhf_pipeline.modeling import check_model_ref

    if config.ref_model:
        check_model_ref("--ref-model", config.ref_model, tokenizer=False)
    record = find_in_lineage([ref], "ref_logps") if has_columns(dd, columns) else None
    reference = check_reference(config, algorithm, sampling, record)
    check_columns(config, algorithm, record, temperature)
    return reference


def check_columns(config, algorithm: Any, record: dict | None, temperature: float) -> None:
    """Reference columns of the data (their ``ref_logps`` lineage ``record``) must have been computed at this run's
    log-prob ``temperature`` and precision: at the first step policy and reference must give the same numbers."""
    if record is None:
        return
    if record.get("temperature") != temperature:
        remake = f"--temperature {temperature:g}" if config.temperature is not None else f"--algo {algorithm.name}"
        raise PipelineError(
            f"{config.data}: its reference log-probs were computed at temperature {record.get('temperature')}, but "
            f"--algo {algorithm.name} takes log-probs at {temperature:g} here; recompute them with rlhf ref-logps "
            f"{remake}, or pass --temperature {record.get('temperature')} to train at theirs"
        )
    run_dtype = precision(config)
    if record.get("dtype", run_dtype) != run_dtype:  # older records have no dtype
        fix = {"bfloat16": "add --bf16", "float32": "remove --bf16"}.get(record["dtype"])  # float16: no flag
        raise PipelineError(
            f"{config.data}: its reference log-probs were computed in {record['dtype']}, but this run computes "
            f"the policy's in {run_dtype}: at the first step the two would differ by rounding alone, which the "
            f"loss would train on; {fix + ', or ' if fix else ''}recompute them with rlhf ref-logps --dtype "
            f"{run_dtype}"
        )


def reference_columns(accelerator, model, dd, config, temperature: float, pad_id: int, output: Path,
                      columns: Sequence[str], compute_ref_logps: Callable):
    """The splits with the reference columns ``columns``: from the data (checked by :func:`data_reference` before
    the run started), from ``output``'s cache, or computed now with ``compute_ref_logps(accelerator, model, ds,
    pad_id, temperature, batch_size, pack_ratio)`` and cached, ``model`` being ``--ref-model`` (loaded for the
    pass, then freed) when it is set, else the policy as loaded."""
    from rlhf_pipeline.training.stage import cached_splits

    if has_columns(dd, columns):
        return dd

    def compute():
        reference = load_reference(config, accelerator)
        values = {
            split: compute_ref_logps(accelerator, model if reference is None else reference, ds, pad_id, temperature,
                                     config.eval_batch_size, config.pack_ratio)
            for split, ds in dd.items()
        }
        del reference
        return add_ref_columns(dd, values, columns)

    return cached_splits(accelerator, output / REF_LOGPS_CACHE, compute)
