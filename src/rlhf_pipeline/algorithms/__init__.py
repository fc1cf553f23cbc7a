"""Every algorithm ``rlhf train`` runs: the registry (:mod:`.registry`) and the families that fill it."""

from rlhf_pipeline.algorithms.registry import *  # noqa: F401,F403
from rlhf_pipeline.algorithms.registry import ALGORITHMS, AlgoName, get, help_text, names, register  # noqa: F401
