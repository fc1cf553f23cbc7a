"""The once-per-dataset reference pass that pair losses (DPO family) and KTO train against: the sampling policy's
log-probs of every response, stored as columns, so no second model sits in memory during training.

The columns come from the data when ``rlhf ref-logps`` made them, else from ``OUTPUT/ref_logps`` when an interrupted
run of this output computed them, else from one pass here with the model as loaded (before its first update), kept
in ``OUTPUT/ref_logps`` so a resumed run does not redo them. Columns made at another temperature are an error, never
silently redone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import REF_LOGPS_CACHE


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


def reference_columns(accelerator, model, dd, config, temperature: float, pad_id: int, record: dict | None,
                      output: Path, columns: Sequence[str], compute_ref_logps: Callable):
    """The splits with the reference columns ``columns``: from the data (whose ``ref_logps`` lineage ``record`` must
    match ``temperature``), from ``output``'s cache, or computed now with ``compute_ref_logps(accelerator, model, ds,
    pad_id, temperature, batch_size, pack_ratio)`` and cached."""
    from rlhf_pipeline.training.stage import cached_splits

    if all(c in ds.column_names for ds in dd.values() for c in columns):
        if record is not None and record.get("temperature") != temperature:
            raise PipelineError(
                f"{config.data}: its reference log-probs were computed at temperature {record.get('temperature')}, "
                f"but this run takes log-probs at {temperature}; pass --temperature {record.get('temperature')} or "
                "recompute them with rlhf ref-logps --temperature"
            )
        return dd

    def compute():
        values = {
            split: compute_ref_logps(accelerator, model, ds, pad_id, temperature, config.eval_batch_size,
                                     config.pack_ratio)
            for split, ds in dd.items()
        }
        return add_ref_columns(dd, values, columns)

    return cached_splits(accelerator, output / REF_LOGPS_CACHE, compute)
