"""Train a policy with any registered algorithm (``rlhf_pipeline.algorithms``; ``--algo``'s help lists them, and
docs/algorithms.md): REBEL and the DPO family on preference pairs, KTO on unpaired desirable/undesirable responses,
the PPO family on groups of n responses per prompt, and RAFT on each prompt's best response.

    rlhf train --algo rebel --model runs/iter_0/policy --data runs/iter_0/filter --output runs/iter_0/train
    rlhf train --algo grpo --model runs/iter_0/policy --data runs/iter_0/groups --output runs/iter_0/train
    rlhf train --algo ppo --critic-model runs/rm --model runs/iter_0/policy --data runs/iter_0/groups --output OUT
    rlhf train --algo kto --model runs/iter_0/policy --data runs/iter_0/unpaired --output runs/iter_0/train
    rlhf train --algo dpo --help          # the common options and the DPO family's only
    accelerate launch --config_file accelerate_cfgs/zero3.yaml -m rlhf_pipeline.stages.train \\
        --algo rebel --model meta-llama/Meta-Llama-3-8B-Instruct --data runs/iter_0/filter --output runs/iter_0/train \\
        --batch-size 1 --gradient-accumulation-steps 16 --learning-rate 3e-7 --bf16

The algorithms, their families and what each needs come from ``rlhf_pipeline.algorithms``: this stage's options
are the training options every stage shares plus each family's options (``PairOptions``, ``UnpairedOptions``,
``GroupOptions``), and its body is the chosen algorithm's family recipe. Log-probs are taken at one temperature:
the sampling temperature for REBEL and the PPO family (read from the generate manifest), 1.0 for the DPO family and
KTO, unless ``--temperature`` says otherwise.

The output directory is a ``save_pretrained`` model that the next iteration's vLLM loads; see
``rlhf_pipeline.training.loop`` for checkpoints, metrics and resume.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rlhf_pipeline.algorithms import ALGORITHMS, FAMILIES, AlgoName, check_reads, family, get, help_text
from rlhf_pipeline.algorithms.reference import ReferenceOptions
from rlhf_pipeline.config import build_parser, option
from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.training.loop import TrainOptions

FAMILY_OPTIONS = tuple(f.options for f in FAMILIES.values() if f.options is not None)
# The options that only some algorithms read (each declares which: its ``reads``): the families' and the reference.
ALGORITHM_OPTIONS = (*FAMILY_OPTIONS, ReferenceOptions)


@dataclass(kw_only=True)
class TrainConfig(*ALGORITHM_OPTIONS, TrainOptions):  # type: ignore[misc]  (the families' options, from the registry)
    """Train a policy on pairs (REBEL, DPO family), unpaired responses (KTO), groups (PPO family) or each prompt's
    best response (RAFT)."""

    algo: AlgoName = option("rebel", help=f"The algorithm: {help_text()}.")
    temperature: Optional[float] = option(
        None, help="Temperature of policy and reference log-probs (default: the sampling temperature for REBEL and "
        "the PPO family, 1.0 for the DPO family)."
    )

    @property
    def algorithm(self):
        return get(self.algo)

    def __post_init__(self) -> None:
        super().__post_init__()
        algorithm = get(self.algo)  # an unknown name fails here, with the list of algorithms
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError("--temperature must be > 0 (log-probs of greedy samples are not defined)")
        check_reads(self, algorithm)  # an option given to an algorithm that does not read it: one line
        for options in FAMILY_OPTIONS:  # every family checks its options' values
            options.check_options(self, algorithm)


def main(config: TrainConfig) -> Path:
    """The chosen algorithm's family recipe (``Family.train``)."""
    return family(config.algorithm).train(config)


def algorithm_help(algo: str) -> str:
    """``rlhf train --algo X --help``: the options X reads in full (its family's, the reference, SPPO's --eta), then the
    options every algorithm shares, by name with their defaults (``rlhf train --help`` explains each)."""
    import textwrap

    entry, fam = get(algo), family(algo)
    own = fam.options
    mine = ["algo", "temperature"] + [f.name for o in ALGORITHM_OPTIONS for f in dataclasses.fields(o)
                                      if f.metadata.get("reads", lambda _: o is own)(entry)]
    family_names = {f.name for o in ALGORITHM_OPTIONS for f in dataclasses.fields(o)}
    parser = build_parser(TrainConfig, "rlhf train", f"Train a policy with --algo {algo}: {entry.help}. It trains on "
                          f"{fam.help}.", only=set(mine), first=own)
    parser.usage = f"rlhf train --algo {algo} --model MODEL --data DATA --output OUTPUT [options]"
    (choice,) = [a for a in parser._actions if a.dest == "algo"]
    choice.help, choice.metavar = f"The algorithm ({', '.join(ALGORITHMS)}).", "NAME"
    shared = []
    for action in build_parser(TrainConfig, "rlhf train")._actions:
        if action.dest in family_names or action.dest in mine or action.dest in ("help", "config"):
            continue
        default = action.default
        shown = default is not None and default is not False and default != 0
        shared.append(action.option_strings[0] + (f"\0({default})" if shown else ""))  # \0: kept with its flag
    common = textwrap.fill(", ".join(shared), width=78, initial_indent="  ", subsequent_indent="  ",
                           break_on_hyphens=False).replace("\0", " ")
    return (parser.format_help() + "\noptions every algorithm shares, with their defaults\n(rlhf train --help explains "
            "each):\n" + common + "\n")


def _algo_in(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--algo" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--algo="):
            return arg.partition("=")[2]
    return None


def cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    algo = _algo_in(argv)
    if algo in ALGORITHMS and ("-h" in argv or "--help" in argv):
        print(algorithm_help(algo), end="")
        return 0
    return run_stage(TrainConfig, main, "rlhf train", argv)


if __name__ == "__main__":
    sys.exit(cli())
