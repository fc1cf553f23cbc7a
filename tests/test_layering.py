"""The package's layers, read from the source: every module has a level, imports only go down, and nothing cycles.

:data:`LEVELS` is the map of the package, bottom to top, one line per module or package (a package's line covers
its submodules). A module may import a module of a lower line, or of its own line (a package's submodules among
themselves); never one above it, nor a sibling on the same level: the stages do not import each other, and the
stages that run others (``eval`` runs ``generate`` and ``score``, ``merge`` reads ``generate``'s options, ``iterate``
plans every stage, ``demo`` runs ``iterate`` and ``report``) each have a level of their own above the ones they run.

An import is any ``import``/``from ... import`` anywhere in a file (function bodies and ``TYPE_CHECKING`` blocks
included), relative or absolute, and any reference by string: a string literal that is exactly a module path
(``"rlhf_pipeline.stages.train"``, what ``importlib.import_module`` is given) or a registry reference
(``"rlhf_pipeline.losses:dpo_terms"``). The whole graph, with those edges, must have no cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rlhf_pipeline

PACKAGE = Path(rlhf_pipeline.__file__).parent

# Bottom to top. A module may import what stands on a lower level, or on its own line.
LEVELS: list[tuple[int, str, str]] = [
    (0, "rlhf_pipeline", "the package: its version, nothing else"),
    (1, "errors", "the exceptions that reach the user as one line"),
    (1, "progress", "whether progress bars show"),
    (1, "layout", "the names of a run's directories, files and metrics"),
    (1, "sharding", "which prompts a --shard takes, and their seeds"),
    (1, "advantages", "pure advantage and baseline functions of tensors"),
    (1, "selection", "pure choice of pairs, groups and splits"),
    (1, "chat_templates", "the built-in chat templates (--chat-template NAME), as Jinja text"),
    (1, "data.lm_eval.rlhf_arith", "the bundled lm-eval task's dataset loader (a file of data/, beside its jsonl)"),
    (1, "data.modeling_tiny_armo", "the tiny kit's remote-code reward model (a file of data/ it copies into a model)"),
    (1, "evalstats", "pure statistics of an evaluation: win rates, length control, pass@k"),
    (1, "judge", "the pairwise judge's prompt, verdicts and both orders, as pure functions"),
    (1, "machine", "what this process may use of the machine (CPU cores, a GPU), and that a stage dies with its run"),
    (1, "compat", "names transformers 5 removed that model code written for transformers 4 imports"),
    (2, "tiny", "the offline tiny tokenizer and models (their families' templates: chat_templates)"),
    (2, "files", "whole files: damaged-file checks, sealed directories, a full disk as one line"),
    (2, "losses", "pure loss functions of tensors (they share advantages' masked mean)"),
    (2, "config", "option dataclasses, flags and YAML"),
    (2, "contracts", "the column contracts between stages"),
    (2, "attention", "the attention implementations, and varlen registered with transformers"),
    (3, "chat", "chat templates and tokenization"),
    (3, "modeling", "loading and unwrapping models"),
    (3, "datasets_io", "dataset references, atomic outputs, manifests"),
    (3, "distributed", "processes: sharded inference and collectives"),
    (3, "executors", "where engines run: locally or on Ray"),
    (3, "sampling_options", "the sampling options generate and eval share"),
    (4, "logprobs", "the one place log-probs are computed"),
    (4, "engines", "generation engines: hf, vllm"),
    (4, "demo", "the demo's bundled task"),
    (5, "rewards", "reward models and reward functions"),
    (5, "harness", "EleutherAI's lm-eval harness on a model directory (rlhf eval --lm-eval); stops its vLLM engine"),
    (6, "training", "the training loop, checkpoints, the training-stage frame, LoRA"),
    (7, "algorithms", "the registry and the algorithm families"),
    (8, "stages", "run_stage, what every stage's cli calls"),
    (9, "stages.generate", "rlhf generate"),
    (9, "stages.score", "rlhf score"),
    (9, "stages.filter", "rlhf filter"),
    (9, "stages.ref_logps", "rlhf ref-logps"),
    (9, "stages.train", "rlhf train"),
    (9, "stages.sft", "rlhf sft"),
    (9, "stages.train_rm", "rlhf train-rm"),
    (9, "stages.report", "rlhf report"),
    (9, "stages.tiny_model", "rlhf tiny-model"),
    (10, "stages.eval", "rlhf eval: runs generate and score"),
    (10, "stages.merge", "rlhf merge: checks the shards by generate's options"),
    (11, "stages.iterate", "rlhf iterate: plans and launches the stages"),
    (12, "stages.demo", "rlhf demo: runs iterate and report"),
    (13, "bench", "rlhf bench: runs the stages side by side with peers"),
    (14, "cli", "rlhf <stage>: names every stage (and bench) by module path"),
]

_REFERENCE = re.compile(r"rlhf_pipeline(?:\.\w+)*(?::\w+)?")


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package: Path) -> set[str]:
    """Every module a file names: imports anywhere in it (``from a import b`` counts as ``a`` and ``a.b``, b may be
    a module), and string literals that are exactly a module path or a ``module:attribute`` reference."""
    found = set()
    me = module_name(path, package)
    here = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _REFERENCE.fullmatch(node.value):
            found.add(node.value.partition(":")[0])
    return found


def graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (an import of ``a.b.c`` where only ``a.b`` is a module is ``a.b``)."""
    files = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    root = package.name

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    return {
        me: {t for t in map(resolve, (n for n in imports(path, package) if n.split(".")[0] == root))
             if t is not None and t != me}
        for me, path in files.items()
    }


def line_of(module: str, levels: list[tuple[int, str, str]], root: str) -> tuple[int, str] | None:
    """(level, line) of the most specific table line that covers ``module``."""
    best = None
    for level, name, _ in levels:
        full = root if name == root else f"{root}.{name}"
        covers = module == full or (full != root and module.startswith(full + "."))
        if covers and (best is None or len(full) > len(best[1])):
            best = (level, full)
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def violations(package: Path = PACKAGE, levels: list[tuple[int, str, str]] = LEVELS) -> list[str]:
    edges = graph(package)
    root = package.name
    found = [f"{m} has no line in LEVELS: add one" for m in sorted(edges) if line_of(m, levels, root) is None]
    for me in sorted(edges):
        mine = line_of(me, levels, root)
        if mine is None:
            continue
        for target in sorted(edges[me]):
            theirs = line_of(target, levels, root)
            if theirs is None or theirs[1] == mine[1] or theirs[0] < mine[0]:
                continue
            how = "a sibling on its level" if theirs[0] == mine[0] else "a higher level"
            found.append(f"{me} (level {mine[0]}) imports {target} (level {theirs[0]}), {how}")
    found += [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    return found


def test_every_import_goes_down_and_nothing_cycles():
    assert violations() == []


def test_every_line_of_the_table_names_a_module():
    modules = set(graph(PACKAGE))
    for _, name, _ in LEVELS:
        full = "rlhf_pipeline" if name == "rlhf_pipeline" else f"rlhf_pipeline.{name}"
        assert full in modules, f"LEVELS names {name}, which is not a module of the package"


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "rlhf_pipeline"
    for name, text in {"__init__.py": "", "stages/__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


FAKE_LEVELS = [(0, "rlhf_pipeline", ""), (0, "losses", ""), (1, "logprobs", ""), (2, "stages", ""),
               (3, "stages.train", ""), (3, "stages.sft", ""), (4, "cli", "")]


def test_the_check_fails_on_a_planted_upward_import(tmp_path):
    """A library module importing a stage inside a function, and a stage importing its sibling relatively."""
    package = _fake_package(tmp_path, {
        "losses.py": "",
        "logprobs.py": "def f():\n    from rlhf_pipeline.stages.train import main\n",
        "stages/train.py": "from rlhf_pipeline import logprobs\n",
        "stages/sft.py": "from . import train\n",
        "cli.py": "STAGES = {'train': 'rlhf_pipeline.stages.train'}\n",  # by string, from above: fine
    })
    assert violations(package, FAKE_LEVELS) == [
        "rlhf_pipeline.logprobs (level 1) imports rlhf_pipeline.stages.train (level 3), a higher level",
        "rlhf_pipeline.stages.sft (level 3) imports rlhf_pipeline.stages.train (level 3), a sibling on its level",
        "import cycle: rlhf_pipeline.logprobs <-> rlhf_pipeline.stages.train",
    ]


def test_the_check_fails_on_a_planted_cycle_through_a_string_reference(tmp_path):
    """A registry reference (``"module:function"``) closing a cycle inside one line of the table (the ``stages``
    package here), which the level rule allows and only the cycle check catches; and a module the table does not
    place."""
    package = _fake_package(tmp_path, {
        "losses.py": "",
        "logprobs.py": "",
        "stages/train.py": "from rlhf_pipeline.stages import run\n",
        "stages/run.py": "LOSS = 'rlhf_pipeline.stages.train:loss'\n",
        "cli.py": "",
        "extra.py": "",
    })
    levels = [(0, "rlhf_pipeline", ""), (0, "losses", ""), (1, "logprobs", ""), (2, "stages", ""), (4, "cli", "")]
    assert violations(package, levels) == [
        "rlhf_pipeline.extra has no line in LEVELS: add one",
        "import cycle: rlhf_pipeline.stages.run <-> rlhf_pipeline.stages.train",
    ]
