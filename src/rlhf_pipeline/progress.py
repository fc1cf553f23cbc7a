"""The project's one progress setting: bars show unless ``TQDM_DISABLE`` is set (tqdm's own variable, which the
tests and CI set). Code that draws bars itself honours it through tqdm; this function is for the places that must
decide explicitly: an explicit ``disable=`` would override tqdm's reading of the variable, and vLLM's
``use_tqdm=True`` divides by the bar's elapsed time, which a disabled bar never measures (ZeroDivisionError in
``vllm/entrypoints/common/offline.py``)."""

from __future__ import annotations

import os


def bars_disabled() -> bool:
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")
