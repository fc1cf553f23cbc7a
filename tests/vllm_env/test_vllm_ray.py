"""Two Ray replicas of the real vLLM engine write what one vLLM engine writes (per-request seeds: sharding changes
nothing), token for token.

Opt-in: it runs only where Ray is installed in the vLLM environment, which scripts/install.sh does not do, so CI
skips it. Two vLLM CPU engines starting at once on 2 cores take ~85 s (the test: 120 s here, the local engine
included), too much of CI's budget for what tests/test_executors.py checks with the hf engine; what is vLLM's own
here is that its engine runs inside a Ray task at all. To run it:
    .venv-vllm/bin/pip install 'ray>=2.10' && bash scripts/test.sh tests/vllm_env/test_vllm_ray.py
"""

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: three exist at once here

from datasets import load_from_disk  # noqa: E402

from conftest import run  # noqa: E402

pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("shared_vllm_engines")  # the local run's engine (the replicas start their own)


def test_two_vllm_replicas_equal_one_engine(stop_prone_policy, bundled_prompts, tmp_path):
    args = ["generate", "--engine", "vllm", "--model", stop_prone_policy, "--prompts", bundled_prompts, "--n", 2,
            "--max-new-tokens", 8, "--limit", 6, "--seed", 3]
    assert run(*args, "--executor", "ray", "--replicas", 2, "--output", tmp_path / "ray") == 0
    assert run(*args, "--output", tmp_path / "local") == 0
    ours, local = load_from_disk(str(tmp_path / "ray")), load_from_disk(str(tmp_path / "local"))
    assert ours.column_names == local.column_names
    for column in ours.column_names:
        assert ours[column] == local[column], column
    assert len({tuple(ids) for row in ours["response_token_ids"] for ids in row}) > 1  # sampled, not all the same
