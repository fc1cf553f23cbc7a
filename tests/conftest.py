"""Shared fixtures: tiny models built once per session, offline, and small prompt files."""

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from rlhf_pipeline.tiny import bundled_path  # noqa: E402


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> str:
    from rlhf_pipeline.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "policy", kind="policy", seed=0))


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory) -> str:
    from rlhf_pipeline.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "rm", kind="reward", seed=1))


@pytest.fixture(scope="session")
def bundled_prompts() -> str:
    return str(bundled_path("prompts.jsonl"))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def small_prompts(tmp_path) -> str:
    rows = [json.loads(line) for line in bundled_path("prompts.jsonl").read_text().splitlines()[:12]]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)
