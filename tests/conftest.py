"""Shared fixtures: tiny models built once per session, offline, and small prompt files."""

import json
import os
import socket
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


# A reward for the training tests: longer answers and answers that stopped are better, by several units.
LENGTH_REWARD = '''
def reward(prompts, responses, **columns):
    # Longer answers and answers that stopped are better: differences of several units between responses.
    return [len(r) / 20 + (2.0 if f == "stop" else 0.0) for r, f in zip(responses, columns["finish_reasons"])]
'''


@pytest.fixture
def fresh_accelerate_state():
    """Each in-process training run builds its own Accelerator; accelerate keeps singletons between them."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def free_port() -> int:
    """A free TCP port for a multi-process launch's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args) -> int:
    """One ``rlhf`` command in-process; arguments may be paths or numbers."""
    from rlhf_pipeline.cli import main as rlhf

    return rlhf([str(a) for a in args])


def logged(path: Path, key: str = "loss/train") -> list[float]:
    """Every value of ``key`` in a training run's metrics.jsonl, in order."""
    return [r[key] for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if key in r]


def max_weight_diff(a: Path, b: Path) -> float:
    """The largest absolute difference between two saved models' weights (same parameter names required)."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
