"""The docs against the code they describe, where a list in prose is derived from one place in the code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_full_size_names_every_extra_of_the_package():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (ROOT / "docs" / "full-size.md").read_text()
    (paragraph,) = [p for p in text.split("\n\n") if p.startswith("Optional extras of the package")]
    named = set(re.findall(r"`([\w-]+)` \(", paragraph))
    assert named == set(extras), f"docs/full-size.md's extras list: missing {set(extras) - named}, " \
                                 f"not in pyproject.toml {named - set(extras)}"


def test_the_module_map_of_development_md_lists_every_module_at_its_level():
    """docs/development.md's tree of src/rlhf_pipeline/ names every module of the package, each at the level that
    tests/test_layering.py's ``LEVELS`` gives it (it had missed three new modules and kept a moved one)."""
    from test_layering import LEVELS

    def dotted(path: str) -> str:  # "stages/generate.py" -> "stages.generate"; a package's __init__.py -> the package
        parts = path.removesuffix(".py").rstrip("/").split("/")
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        return ".".join(parts) or "rlhf_pipeline"

    text = (ROOT / "docs" / "development.md").read_text()
    tree = text.split("```\nsrc/rlhf_pipeline/\n", 1)[1].split("```", 1)[0]
    listed: dict[str, int | None] = {}
    package = ""
    for line in tree.splitlines():
        m = re.match(r"^(│   |    )?[├└]── ([\w/.]+)\s*(\d+)?", line)
        assert m, f"docs/development.md: a line of the module map that is not an entry: {line!r}"
        nested, name, level = m.groups()
        if not nested:
            package = name if name.endswith("/") else ""
        listed[dotted(package + name if nested else name)] = int(level) if level else None
    source = ROOT / "src" / "rlhf_pipeline"
    modules = {dotted(p.relative_to(source).as_posix()) for p in source.rglob("*.py")}
    assert modules - set(listed) == set(), "modules missing from docs/development.md's module map"
    levels = {name: level for level, name, _ in LEVELS}
    wrong = {m: (shown, levels.get(m)) for m, shown in listed.items() if shown is not None and levels.get(m) != shown}
    assert not wrong, f"docs/development.md shows these at other levels than LEVELS (shown, LEVELS): {wrong}"


def test_algorithms_md_names_every_registered_algorithm():
    """docs/algorithms.md describes each ``--algo`` choice by its name (in backticks), as the registry lists them."""
    from rlhf_pipeline.algorithms import names

    text = (ROOT / "docs" / "algorithms.md").read_text()
    missing = [name for name in names() if f"`{name}`" not in text]
    assert not missing, f"docs/algorithms.md does not name these registered algorithms: {missing}"
