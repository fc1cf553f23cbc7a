"""What transformers 5 removed that model code written for transformers 4 still imports.

A model that ships its own code (``trust_remote_code``) was often written against transformers 4. ArmoRM
(RLHFlow/ArmoRM-Llama3-8B-v0.1, the reward model of REBEL's UltraFeedback recipe) starts with
``from transformers.models.llama.modeling_llama import LLAMA_INPUTS_DOCSTRING``: docstring text for a decorator,
which transformers 5 no longer defines, so the import fails before any weight loads. :func:`allow_legacy_remote_code`
gives such names back as empty text; a name transformers still has is left as it is.
"""

from __future__ import annotations

import importlib

# module -> the names it lost that remote model code imports (docstring constants only: no behaviour is restored)
LEGACY_REMOTE_CODE_NAMES = {"transformers.models.llama.modeling_llama": ("LLAMA_INPUTS_DOCSTRING",
                                                                         "LLAMA_START_DOCSTRING")}


def allow_legacy_remote_code() -> None:
    """Define the names of :data:`LEGACY_REMOTE_CODE_NAMES` that transformers lacks, as empty text. Called before a
    model's own code may run: by every stage given ``--trust-remote-code`` (``rlhf_pipeline.stages.run_stage``), by
    the loaders of ``rlhf_pipeline.modeling``, and by the tiny kit, whose ArmoRM-like model imports one."""
    for module_name, names in LEGACY_REMOTE_CODE_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                setattr(module, name, "")
