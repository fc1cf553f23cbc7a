"""The registry of ``rlhf train``'s algorithms: every list, choice, default and dispatch is derived from it.

Two kinds of entry:

- a :class:`Family` is a kind of training data (``rlhf filter --mode pairs|groups|unpaired|best``) and everything
  ``rlhf train`` does with it: its options (a dataclass whose fields become flags, with their checks), and its
  recipe (the body of ``rlhf train`` for that data). Each family is one module of this package (``pairs``,
  ``groups``, ``unpaired``, ``supervised``), which registers itself and its algorithms;
- an algorithm is an entry of one family (``PairAlgorithm``, ``GroupAlgorithm``, ...: each defined in its family's
  module) that says what the family's recipe computes for it, and declares its capabilities as fields
  (``needs_reference``, ``uses_rewards``, ``uses_critic``, ``logp_at_sampling_temperature``, and the family's own,
  such as a pair loss's ``label_smoothing`` or a group algorithm's ``policy_loss``), so nothing tests a name.

Which algorithms read an option is declared with the option, as a predicate on those capabilities
(``option(..., reads=lambda algorithm: ...)``), and one rule (:func:`check_reads`) refuses an option given to an
algorithm that does not read it, naming the ones that do.

A new algorithm is one entry in one module (plus its pure function and its test)::

    from rlhf_pipeline.algorithms import PairAlgorithm, register
    register(PairAlgorithm(name="my_loss", loss=my_pair_terms, needs_reference=False, help="..."))

Functions may be given as ``"module:attribute"`` strings, imported on first use, so that reading the registry (a
stage's ``--help``) does not import torch. This module imports no family: the package's ``__init__`` does.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

# The kinds of data a family trains on, as rlhf filter --mode makes them (contracts.TRAINING_DATA_KINDS)
from rlhf_pipeline.contracts import BEST, GROUPS, PAIRS, TRAINING_DATA_KINDS, UNPAIRED  # noqa: F401  (families' data)


def resolve(fn: Callable | str) -> Callable:
    """A function, or ``"module:attribute"`` imported now."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ReferencePass:
    """What ``rlhf ref-logps`` computes for a family's data, once per dataset: the reference model's log-probs,
    ``columns`` (one list each from ``compute(accelerator, model, ds, pad_id, temperature, batch_size,
    pack_ratio)``), after ``check(ds, source)``. ``marker`` is a column only this family's data has."""

    marker: str
    columns: tuple[str, ...]
    check: Callable[[Any, str], None]
    compute: Callable[..., tuple[list, ...]]


@dataclass(frozen=True)
class Family:
    """A kind of training data and what ``rlhf train`` does with it.

    ``options`` is a dataclass of the family's ``rlhf train`` options (its ``options_group`` titles their section of
    ``--help``; each field declares the algorithms that read it, ``reads``, for :func:`check_reads`; its
    ``check_options(self, algorithm)`` checks their values, whatever the algorithm); ``train(config) -> Path`` is
    the family's recipe, the body of ``rlhf train`` for its algorithms.
    """

    data: str  # the rlhf filter --mode that makes this data
    options: type | None
    train: Callable[[Any], Any]
    help: str
    reference: ReferencePass | None = None  # rlhf ref-logps's pass over this data, for families that take one


FAMILIES: dict[str, Family] = {}
ALGORITHMS: dict[str, Any] = {}


def register_family(family: Family) -> Family:
    """Add a family (once per kind of data)."""
    if family.data not in TRAINING_DATA_KINDS:
        raise ValueError(f"a family for {family.data!r} data: rlhf filter makes none (contracts.TRAINING_DATA_KINDS: "
                         f"{', '.join(TRAINING_DATA_KINDS)}); add the kind there and its --mode to rlhf filter")
    if family.data in FAMILIES:
        raise ValueError(f"a family for {family.data!r} data is already registered")
    FAMILIES[family.data] = family
    return family


def reference_temperature(family: Family, algorithm: Any | None, requested: float | None, sampling: dict | None,
                          source: str) -> float:
    """The temperature ``rlhf ref-logps`` takes the reference log-probs of ``family``'s data at, so that ``rlhf
    train`` takes its own at the same: ``--temperature`` when given; else ``--algo``'s (:func:`logp_temperature`);
    else the one every algorithm of the family that reads the columns agrees on (KTO's 1.0 on unpaired data); else
    the sampling temperature (pairs: REBEL's, where the DPO family takes 1.0)."""
    if algorithm is not None:
        return logp_temperature(algorithm, requested, sampling, source)
    rules = {a.logp_at_sampling_temperature for a in ALGORITHMS.values() if a.data == family.data and a.needs_reference}
    return resolve_temperature(requested, sampling, source, 1.0 if rules == {False} else None)


def reference_family(column_names: list[str], source: str) -> Family:
    """The family whose reference pass (``rlhf ref-logps``) takes data of these columns."""
    from rlhf_pipeline.errors import PipelineError

    takes = [f for f in FAMILIES.values() if f.reference is not None]
    found = [f for f in takes if f.reference.marker in column_names]
    if len(found) != 1:
        kinds = " or ".join(f"{f.reference.marker} ({f.data}: rlhf filter --mode {f.data})" for f in takes)
        raise PipelineError(f"{source}: rlhf ref-logps computes reference log-probs of data with a column {kinds}; "
                            f"found {'both' if found else 'neither'} in its columns {', '.join(column_names)}")
    return found[0]


def register(algorithm: Any) -> Any:
    """Add an algorithm (a name may be registered once; its family must be registered)."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    if algorithm.data not in FAMILIES:
        raise ValueError(f"algorithm {algorithm.name!r} trains on {algorithm.data!r} data, which no family handles")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Any:
    """The algorithm called ``name``, or a ValueError that lists them."""
    if name not in ALGORITHMS:
        raise ValueError(f"--algo {name}: unknown algorithm; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def family(algorithm: Any) -> Family:
    """The family an algorithm (or an algorithm's name) belongs to."""
    return FAMILIES[(get(algorithm) if isinstance(algorithm, str) else algorithm).data]


def names(data: str | None = None) -> tuple[str, ...]:
    """Registered names, all or those training on ``data`` (PAIRS, GROUPS, ...), in registration order."""
    return tuple(n for n, a in ALGORITHMS.items() if data is None or a.data == data)


def help_text() -> str:
    """One line per algorithm, for ``--algo``'s help."""
    return "; ".join(f"{a.name} ({a.data}): {a.help}" for a in ALGORITHMS.values())


def with_defaults(params_type: type, defaults: dict[str, Any], **given: Any):
    """``params_type`` from the options given (None = unset), an algorithm's ``defaults`` filling the rest."""
    return params_type(**{**defaults, **{k: v for k, v in given.items() if v is not None}})


def takes_beta(algorithm: Any) -> bool:
    """Whether the loss has a preference strength ``--beta``: the DPO family and KTO (pair and unpaired losses but
    the regression on reward gaps, REBEL)."""
    return algorithm.data in (PAIRS, UNPAIRED) and not algorithm.uses_rewards


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_reads(options: Any, algorithm: Any) -> None:
    """The one rule for options given to the wrong algorithm: every field of ``options`` (a config dataclass) that
    declares which algorithms read it (``metadata["reads"]``, a predicate on an entry) and is given, i.e. set to
    other than its default, must be read by ``algorithm``; else one line naming the ones that read it."""
    for f in dataclasses.fields(options):
        reads = f.metadata.get("reads")
        if reads is None or reads(algorithm) or getattr(options, f.name) == _default(f):
            continue
        readers = ", ".join(a.name for a in ALGORITHMS.values() if reads(a))
        raise ValueError(f"--{f.name.replace('_', '-')} is not read by --algo {algorithm.name} (it is read by "
                         f"{readers}); leave it out")


def resolve_temperature(requested: float | None, sampling: dict | None, source: str, default: float | None) -> float:
    """The log-prob temperature: asked for, else ``default``, else the recorded sampling temperature."""
    from rlhf_pipeline.errors import PipelineError

    if requested is not None:
        return requested
    if default is not None:
        return default
    if sampling is None or sampling.get("temperature") is None:
        raise PipelineError(
            f"{source}: no sampling temperature recorded upstream (no generate manifest in its lineage); "
            "pass --temperature with the temperature the responses were sampled at"
        )
    if sampling["temperature"] == 0:
        raise PipelineError(f"{source}: the data was sampled greedily (temperature 0); pass --temperature")
    return float(sampling["temperature"])


def logp_temperature(algorithm: Any, requested: float | None, sampling: dict | None, source: str) -> float:
    """The temperature policy and reference log-probs are taken at: ``--temperature`` when given, else the sampling
    temperature (from the data's lineage) for the algorithms that declare ``logp_at_sampling_temperature`` (REBEL and
    the PPO family), else 1.0 (the DPO family)."""
    return resolve_temperature(requested, sampling, source, None if algorithm.logp_at_sampling_temperature else 1.0)
