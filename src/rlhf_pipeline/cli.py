"""``rlhf <stage> [options]``: one entry point for every stage.

Each stage is also a module of its own (``python -m rlhf_pipeline.stages.generate ...``), so a launcher such as
``accelerate launch -m rlhf_pipeline.stages.train`` or ``conda run -n rlhf-vllm rlhf generate`` runs it unchanged.
``rlhf <stage> --help`` documents every option.

A mistake in the user's input (a mistyped path or number, a missing column, a model that is not there) ends with
exit status 1 and one ``error:`` line that names the option or file and the fix, and leaves no output behind:
options are checked when they are parsed, and a stage checks what it reads (data, models, the reward function)
before it makes its output directory. A flag argparse cannot parse is a usage error (exit status 2). When the user's
own code raises (a ``--reward-fn``), its traceback comes first and the ``error:`` line last.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

from rlhf_pipeline import algorithms

# stage name -> (module, one-line description). Modules are imported only when their stage runs.
STAGES: dict[str, tuple[str, str]] = {
    "tiny-model": ("rlhf_pipeline.stages.tiny_model", "build a tiny tokenizer + Llama (policy or reward) offline"),
    "generate": ("rlhf_pipeline.stages.generate", "sample n responses per prompt (vLLM or HF generate)"),
    "merge": ("rlhf_pipeline.stages.merge", "join the shards of a sharded generate run"),
    "score": ("rlhf_pipeline.stages.score", "score every response with a reward model or a python function"),
    "filter": ("rlhf_pipeline.stages.filter", "length filters; pairs, groups, unpaired or best responses; train/test split"),
    "ref-logps": ("rlhf_pipeline.stages.ref_logps", "reference log-probs of the responses (pairs or unpaired), once per dataset"),
    "train": ("rlhf_pipeline.stages.train", f"train a policy ({', '.join(algorithms.names())})"),
    "sft": ("rlhf_pipeline.stages.sft", "supervised fine-tuning on prompt/answer or messages rows (loss on answers)"),
    "train-rm": ("rlhf_pipeline.stages.train_rm", "train a Bradley-Terry reward model on chosen/rejected pairs"),
    "eval": ("rlhf_pipeline.stages.eval", "generate on held-out prompts, score, mean reward and win rate"),
    "iterate": ("rlhf_pipeline.stages.iterate", "T iterations of generate -> score -> filter -> train, resumable"),
    "report": ("rlhf_pipeline.stages.report", "plots and report.md of a run directory"),
    "demo": ("rlhf_pipeline.stages.demo", "the whole loop on a bundled task, offline on a CPU, showing learning"),
    "bench": ("rlhf_pipeline.bench.run", "side-by-side benchmarks against TRL and per-row/one-by-one baselines"),
}


def config_class(stage: str) -> type:
    """The config dataclass that ``rlhf <stage>`` parses (defined in the stage module or the library module it
    wraps, and imported into the stage module under a name ending in ``Config``)."""
    import dataclasses

    module = importlib.import_module(STAGES[stage][0])
    found = {v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
             and dataclasses.is_dataclass(v)}
    if len(found) != 1:
        raise TypeError(f"{module.__name__}: expected one *Config dataclass, found {sorted(c.__name__ for c in found)}")
    return found.pop()


def _usage() -> str:
    width = max(map(len, STAGES))
    lines = ["usage: rlhf <stage> [options]   (rlhf <stage> --help for a stage's options)", "", "stages:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in STAGES.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from rlhf_pipeline import __version__

        print(__version__)
        return 0
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"error: unknown stage '{stage}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(STAGES[stage][0])
    return module.cli(rest)


if __name__ == "__main__":
    sys.exit(main())
