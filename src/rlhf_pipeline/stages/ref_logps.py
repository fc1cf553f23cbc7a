"""Reference log-probs of the responses (chosen and rejected of pairs, or KTO's unpaired responses) under the sampling
policy, computed once per dataset.

    rlhf ref-logps --model runs/iter_0/policy --input runs/iter_0/filter --output runs/iter_0/ref_logps
    accelerate launch --multi_gpu --num_processes 8 -m rlhf_pipeline.stages.ref_logps \\
        --model runs/iter_0/policy --input runs/iter_0/filter --output runs/iter_0/ref_logps

Adds ``chosen_ref_logp`` and ``rejected_ref_logp`` (sums over response tokens) to both splits, so training needs no
second model in memory; on unpaired data (``rlhf filter --mode unpaired``, KTO) ``completion_ref_logp`` and
``kl_ref_logp``, the latter of each row's mismatched (prompt, response) pair. The kind of data and what the pass
computes for it come from the algorithm registry (a family's ``reference``). The temperature is the one ``--algo``
takes its log-probs at (``algorithms.reference_temperature``: REBEL the sampling temperature, read from the generate
stage's manifest through the inputs' lineage; the DPO family and KTO 1.0) and is recorded in this output's manifest
with the precision (the weights' dtype); ``rlhf train`` checks that it computes the policy's log-probs at the same
temperature and precision (bfloat16 with ``--bf16``, else float32): at its first step policy and reference must give
the same numbers. ``rlhf train`` runs this pass itself when the columns are missing. One batched pass, sequences
sorted by length; under ``accelerate launch`` the batches are dealt out over the processes (each holds the whole
model; DeepSpeed configs are refused), gathered in the original order, and the main process writes the output (its
manifest records the number of processes, which does not change the log-probs beyond float rounding: a rerun with
another number reuses the output).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf_pipeline.algorithms import ReferenceAlgoName
from rlhf_pipeline.attention import DEFAULT_ATTENTION, AttnImplementation, attn_help
from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import DATASET_REF, DtypeName, OutputOptions, option, trust_remote_code_option
from rlhf_pipeline.errors import PipelineError

@dataclass(kw_only=True)
class RefLogpsConfig(OutputOptions):
    """Add the reference log-prob columns (chosen_ref_logp / rejected_ref_logp of pairs; completion_ref_logp /
    kl_ref_logp of KTO's unpaired rows) computed with the sampling policy."""

    model: str = option(help="The policy that sampled the data (the reference of the next training run).")
    input: str = option(
        help=f"Pairs or unpaired rows with train and test splits (the output of rlhf filter): {DATASET_REF}.",
        semantic=False,
    )
    algo: Optional[ReferenceAlgoName] = option(
        None, help="The algorithm rlhf train will run on the columns: they are taken at its log-prob temperature "
        "(REBEL: the sampling temperature; the DPO family and KTO: 1.0). Default: KTO's on unpaired data, REBEL's on "
        "pairs.",
    )
    temperature: Optional[float] = option(
        None, help="Temperature of the log-probs (default: --algo's; rlhf train --temperature takes the same)."
    )
    batch_size: int = option(8, help="Rows per forward pass (each pass holds 2 x batch_size sequences).")
    pack_ratio: float = option(
        2.0, help="Pack sequences into rows of up to this many times the longest one (0 = pad each to the longest).",
        semantic=False,
    )
    dtype: DtypeName = option(
        "auto", help="Model dtype; auto = bfloat16 on a GPU that supports it, float32 on a CPU. rlhf train takes the "
        "columns only at its own precision: bfloat16 with --bf16, else float32."
    )
    attn_implementation: AttnImplementation = option(DEFAULT_ATTENTION, help=attn_help(), semantic=False)
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self) -> None:
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError("--temperature must be > 0 (log-probs of greedy samples are not defined)")
        if self.batch_size < 1:
            raise ValueError("--batch-size must be at least 1")
        if self.pack_ratio and self.pack_ratio < 1:
            raise ValueError("--pack-ratio must be 0 (pad) or at least 1")


def main(config: RefLogpsConfig) -> Path:
    from rlhf_pipeline.distributed import run_inference

    return run_inference("rlhf ref-logps", lambda accelerator: _ref_logps(config, accelerator))


def _read(config: RefLogpsConfig):
    """The output, the data (pairs or unpaired rows, checked) and the temperature; None when the output holds this run
    already."""
    from rlhf_pipeline.algorithms import get, reference_family, reference_temperature
    from rlhf_pipeline.attention import check_attn_implementation
    from rlhf_pipeline.datasets_io import StageOutput, find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.modeling import check_model_ref

    check_model_ref("--model", config.model)
    check_attn_implementation(config.attn_implementation)
    ref = parse_ref(config.input)
    out = StageOutput("ref-logps", config, inputs=[ref])
    if out.done():
        return None
    dd = load_dataset_dict(ref, required=("train",))
    family = reference_family(dd["train"].column_names, f"{ref}:train")
    algorithm = None if config.algo is None else get(config.algo)
    if algorithm is not None and not algorithm.needs_reference:
        raise PipelineError(f"--algo {algorithm.name} takes no reference log-probs; train on {ref} as it is (rlhf "
                            f"train --algo {algorithm.name} --data {ref})")
    if algorithm is not None and algorithm.data != family.data:
        raise PipelineError(f"--algo {algorithm.name} trains on {algorithm.data} data, but {ref} holds {family.data} "
                            f"data; pass the --algo of the run that will train on it")
    data = family.reference
    for split, ds in dd.items():
        data.check(ds, f"{ref}:{split}")
    sampling = find_in_lineage([ref], "sampling")
    temperature = reference_temperature(family, algorithm, config.temperature, sampling, str(ref))
    return out, dd, data, sampling, temperature


def _ref_logps(config: RefLogpsConfig, accelerator) -> Path:
    """One process, or every process of ``accelerate launch`` (``accelerator``): each computes its share of the
    length-sorted batches (``distributed.sharded_inference``, which gathers them in the original order), and the
    main process writes the output."""
    from accelerate import Accelerator

    from rlhf_pipeline.algorithms.reference import add_ref_columns
    from rlhf_pipeline.chat import TOKENIZER_PROBE_KEY, load_tokenizer, pad_id
    from rlhf_pipeline.datasets_io import find_in_lineage, parse_ref
    from rlhf_pipeline.distributed import guarded, on_main_process, world_and_rank
    from rlhf_pipeline.modeling import load_causal_lm
    from rlhf_pipeline.training.stage import check_tokenizer, check_vocabulary

    read = guarded(accelerator, lambda: _read(config))
    if read is None:
        return Path(config.output).expanduser()
    out, dd, data, sampling, temperature = read
    processes = world_and_rank(accelerator)[0]
    accelerator = accelerator or Accelerator()  # one process: the accelerator this stage has always used

    def load() -> tuple[Any, Any]:  # and check that this model reads the data's ids as the data's
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        check_tokenizer(tokenizer, config.input, config.model)
        model = load_causal_lm(config.model, dtype=config.dtype, trust_remote_code=config.trust_remote_code,
                               device=accelerator.device, attn_implementation=config.attn_implementation)
        check_vocabulary(dd, model, tokenizer, config.input, config.model)
        return tokenizer, model

    tokenizer, model = guarded(accelerator, load)
    values = {
        split: data.compute(accelerator, model, ds, pad_id(tokenizer), temperature, config.batch_size,
                            config.pack_ratio)
        for split, ds in dd.items()
    }
    on_main_process(accelerator, lambda: out.save(
        add_ref_columns(dd, values, data.columns),
        rows_in=sum(ds.num_rows for ds in dd.values()),
        extra={"sampling": sampling, "ref_logps": {"model": config.model, "temperature": temperature,
                                                   "dtype": str(model.dtype).removeprefix("torch.")},
               TOKENIZER_PROBE_KEY: find_in_lineage([parse_ref(config.input)], TOKENIZER_PROBE_KEY),
               "processes": processes},
    ))
    return out.path


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(RefLogpsConfig, main, "rlhf ref-logps", argv)


if __name__ == "__main__":
    sys.exit(cli())
