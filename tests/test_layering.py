"""The package's layers: library modules never import a stage, and a stage never imports another stage.

Three layers: the library (everything outside ``stages/``), the stages (thin programs over it), and the entry points
above them, ``cli`` (``rlhf <stage>``) and ``bench`` (``rlhf bench``, which times the stage programs end to end as a
user runs them), which may import any stage. ``rlhf iterate`` and ``rlhf demo`` launch stages as processes, by
module name, so they import none.

Read from the source (every ``import`` and ``from ... import`` anywhere in a module, function bodies included), so
a lazy import inside a function counts as much as one at the top.
"""

import ast
from pathlib import Path

import rlhf_pipeline

PACKAGE = Path(rlhf_pipeline.__file__).parent
STAGES = "rlhf_pipeline.stages"
ENTRY_POINTS = ("rlhf_pipeline.cli", "rlhf_pipeline.bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports; ``from a import b`` counts as ``a`` and ``a.b`` (b may be a module)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def stage_of(module: str) -> str | None:
    """``rlhf_pipeline.stages.train`` (or anything below it) -> its stage module; None outside stages."""
    if module == STAGES or not module.startswith(STAGES + "."):
        return None
    return ".".join(module.split(".")[:3])


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        if me in ENTRY_POINTS or me.startswith(tuple(e + "." for e in ENTRY_POINTS)):
            continue
        my_stage = stage_of(me)
        targets = {stage_of(t) or t for t in imported_modules(path) if t == STAGES or stage_of(t) is not None}
        for target in sorted(targets - {my_stage, STAGES if my_stage else None}):
            if my_stage is None and me != STAGES:
                found.append(f"{me} (a library module) imports {target}")
            elif my_stage is not None:
                found.append(f"{me} imports another stage, {target}")
    return found


def test_library_modules_never_import_a_stage_and_stages_never_import_each_other():
    assert violations() == []


def test_the_check_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """Guards the test above: it must catch an import inside a function and a relative one."""
    fake = tmp_path / "rlhf_pipeline"
    (fake / "stages").mkdir(parents=True)
    for name in ("__init__.py", "stages/__init__.py"):
        (fake / name).write_text("")
    (fake / "lib.py").write_text("def f():\n    from rlhf_pipeline.stages.train import main\n")
    (fake / "stages" / "a.py").write_text("from . import b\n")
    (fake / "stages" / "b.py").write_text("from rlhf_pipeline.stages.b import x\n")  # itself: fine
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert violations() == ["rlhf_pipeline.lib (a library module) imports rlhf_pipeline.stages.train",
                            "rlhf_pipeline.stages.a imports another stage, rlhf_pipeline.stages.b"]
