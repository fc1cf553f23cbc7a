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
