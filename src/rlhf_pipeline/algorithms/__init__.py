"""Every algorithm ``rlhf train`` runs: the registry (:mod:`.registry`) and the families that fill it, one module
each: :mod:`.pairs` (REBEL, the DPO family), :mod:`.unpaired` (KTO), :mod:`.groups` (the PPO family) and
:mod:`.supervised` (RAFT). Importing this package registers them all; a new family or algorithm registers itself
the same way, in its own module (imported here).
"""

from rlhf_pipeline.algorithms.registry import (  # noqa: F401  (the registry's API, importable from here)
    ALGORITHMS,
    BEST,
    FAMILIES,
    GROUPS,
    PAIRS,
    UNPAIRED,
    Family,
    ReferencePass,
    check_reads,
    family,
    get,
    help_text,
    logp_temperature,
    names,
    reference_family,
    reference_temperature,
    register,
    register_family,
    resolve_temperature,
    takes_beta,
)
from rlhf_pipeline.algorithms.pairs import PairAlgorithm, compute_pair_loss, pair_loss_params  # noqa: F401
from rlhf_pipeline.algorithms.unpaired import (  # noqa: F401
    UnpairedAlgorithm,
    compute_unpaired_loss,
    unpaired_loss_params,
)
from rlhf_pipeline.algorithms.groups import GroupAlgorithm, group_params, scales_by_group_std  # noqa: F401
from rlhf_pipeline.algorithms.supervised import SupervisedAlgorithm  # noqa: F401

from typing import Literal  # noqa: E402

# The algorithms registered above, as a type for the stage configs (their --algo choices); those whose data a
# reference pass (rlhf ref-logps) takes (a reference-free one among them gets a line saying so).
AlgoName = Literal[tuple(ALGORITHMS)]  # type: ignore[valid-type]
ReferenceAlgoName = Literal[tuple(  # type: ignore[valid-type]
    name for name, a in ALGORITHMS.items() if FAMILIES[a.data].reference is not None)]
