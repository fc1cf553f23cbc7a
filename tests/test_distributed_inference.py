"""score, ref-logps and eval under ``accelerate launch --multi_gpu --num_processes 2`` on CPUs (gloo): the output of
2 processes equals the output of 1 (exactly for a reward function; within float tolerance for models), only the
main process writes, and a failure on one process is one error from the main process. One launch per case (each
costs ~10-15 s on 2 cores), on one small shared dataset."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import load_from_disk

from conftest import bundled_path, free_port, launch_failure, run

ACCELERATE = Path(sys.executable).parent / "accelerate"

# A reward of the whole batch (each response's length against its batch's mean) and of a passed column: equal rewards
# under 2 processes mean every call saw the very batch it sees in one process.
BATCH_REWARD = '''
def reward(prompts, responses, **columns):
    mean = sum(map(len, responses)) / len(responses)
    return [len(r) - mean + 0.01 * len(p) + 0.001 * len(i) for r, p, i in
            zip(responses, prompts, columns["prompt_id"])]
'''

# Raises on the second process only (its rank comes from torchrun).
RAISES_ON_RANK_1 = '''
import os

def reward(prompts, responses, **columns):
    if os.environ.get("RANK") == "1":
        raise ValueError("a failure on the second process")
    return [0.0] * len(responses)
'''


def launch(stage_module: str, *args, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu --num_processes 2 -m MODULE ARGS`` on CPUs (the stages use gloo there); a
    ``stage_module`` ending in .py is a script, launched as it is."""
    script = ["-m", stage_module] if not stage_module.endswith(".py") else [stage_module]
    cmd = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           *script, *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def shared(tmp_path_factory, tiny_policy) -> Path:
    """11 prompts x 2 responses (an odd count, so the processes' shares differ in size) and the reward functions."""
    d = tmp_path_factory.mktemp("distributed")
    (d / "batch_reward.py").write_text(BATCH_REWARD)
    (d / "raises.py").write_text(RAISES_ON_RANK_1)
    assert run("generate", "--model", tiny_policy, "--prompts", bundled_path("prompts.jsonl"), "--output", d / "gen",
               "--n", 2, "--max-new-tokens", 8, "--limit", 11, "--engine", "hf") == 0
    return d


def column(path: Path, name: str) -> list:
    return load_from_disk(str(path))[name]


def test_score_on_two_processes_equals_one_process(shared, tiny_rm, tmp_path, capsys):
    """A reward model and a batch-dependent reward function, combined: batch size 3 over 22 responses makes 8
    batches, dealt out 4 and 4 (the model's length-sorted, the function's in order)."""
    args = ["--input", shared / "gen", "--reward-model", tiny_rm, "--reward-fn", f"{shared}/batch_reward.py:reward",
            "--batch-size", 3]
    assert run("score", *args, "--output", tmp_path / "one") == 0
    res = launch("rlhf_pipeline.stages.score", *args, "--output", tmp_path / "two")
    assert res.returncode == 0, launch_failure(res)
    assert res.stdout.count("[score] wrote") == 1  # the main process alone writes
    assert column(tmp_path / "two", "rewards_reward_fn") == column(tmp_path / "one", "rewards_reward_fn")
    for name in ("rewards_reward_model", "rewards"):
        two, one = column(tmp_path / "two", name), column(tmp_path / "one", name)
        assert [pytest.approx(r, abs=1e-6) for r in one] == two
    assert column(tmp_path / "two", "prompt_id") == column(tmp_path / "one", "prompt_id")
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["processes"] == 2
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["processes"] == 1
    # the number of processes does not change the output: one process reuses the 2-process output
    capsys.readouterr()
    assert run("score", *args, "--output", tmp_path / "two") == 0
    assert "nothing to do" in capsys.readouterr().out


# rlhf score with small chunks (a reward model's of 3 rows, a function's of 2 batches of 3 responses), and a reward
# function that fails at its FAIL_AT-th call on each process when that is set.
SMALL_CHUNKS = """
import sys

from rlhf_pipeline.stages import score

score.CHUNK_ROWS, score.FN_CHUNK_RESPONSES, score.FN_CHUNK_BATCHES = 3, 6, 1
sys.exit(score.cli())
"""
FAILS_AT = """
import os

CALLS = []

def reward(prompts, responses, **columns):
    CALLS.append(1)
    if len(CALLS) == int(os.environ.get("FAIL_AT", 0)):
        raise ZeroDivisionError("the machine went away")
    mean = sum(map(len, responses)) / len(responses)
    return [len(r) - mean for r in responses]
"""


def test_an_interrupted_two_process_score_keeps_its_chunks_and_resumes(shared, tiny_rm, tmp_path, monkeypatch):
    """Each chunk's shares are gathered and kept by the main process as the chunk finishes: a 2-process run that
    fails in the function's third chunk (one batch of it on each process) keeps the model's 4 chunks and the
    function's first 2, and a 2-process rerun scores the rest and writes what one uninterrupted process writes."""
    from rlhf_pipeline.stages import score

    (tmp_path / "small_chunks.py").write_text(SMALL_CHUNKS)
    (tmp_path / "fails_at.py").write_text(FAILS_AT)
    args = ["--input", shared / "gen", "--reward-model", tiny_rm, "--reward-fn", f"{tmp_path}/fails_at.py:reward",
            "--batch-size", 3]
    monkeypatch.setattr(score, "CHUNK_ROWS", 3)
    monkeypatch.setattr(score, "FN_CHUNK_RESPONSES", 6)
    monkeypatch.setattr(score, "FN_CHUNK_BATCHES", 1)
    assert run("score", *args, "--output", tmp_path / "one") == 0

    res = launch(str(tmp_path / "small_chunks.py"), *args, "--output", tmp_path / "two", env={"FAIL_AT": "3"})
    assert res.returncode != 0 and "ZeroDivisionError: the machine went away" in res.stderr, launch_failure(res)
    kept = sorted(p.stem for p in (tmp_path / "two" / "parts").glob("*.arrow"))
    assert kept == ["reward_fn-0000000000-0000000006", "reward_fn-0000000006-0000000012",
                    *(f"reward_model-{6 * k:010d}-{min(6 * k + 6, 22):010d}" for k in range(4))]

    res = launch(str(tmp_path / "small_chunks.py"), *args, "--output", tmp_path / "two")
    assert res.returncode == 0, launch_failure(res)
    assert "reusing 6 of 8 chunks an interrupted run finished" in res.stdout, launch_failure(res)
    assert column(tmp_path / "two", "rewards_reward_fn") == column(tmp_path / "one", "rewards_reward_fn")
    for name in ("rewards_reward_model", "rewards"):
        two, one = column(tmp_path / "two", name), column(tmp_path / "one", name)
        assert [pytest.approx(r, abs=1e-6) for r in one] == two
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["resumed"] is True


def test_a_failure_on_one_process_is_one_error_from_the_main_process(shared, tmp_path):
    res = launch("rlhf_pipeline.stages.score", "--input", shared / "gen", "--output", tmp_path / "out",
                 "--reward-fn", f"{shared}/raises.py:reward", "--batch-size", 3)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rlhf score: process 1 of 2: the reward function "
                      f"{shared}/raises.py:reward raised on rows 1..2 (batch of 3 responses): ValueError: a failure "
                      "on the second process"], launch_failure(res)
    assert 'raise ValueError("a failure on the second process")' in res.stderr  # the user's traceback, once
    assert res.stderr.count("Traceback (most recent call last):\n  File \"" + str(shared)) == 1
    assert not (tmp_path / "out").exists()


def test_a_deepspeed_launch_is_refused(monkeypatch):
    from rlhf_pipeline.distributed import inference_accelerator
    from rlhf_pipeline.errors import FailedElsewhere, PipelineError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(PipelineError, match=r"rlhf score runs data-parallel.*--multi_gpu --num_processes N"):
        inference_accelerator("rlhf score")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(FailedElsewhere):  # the other processes exit without a word
        inference_accelerator("rlhf score")
    monkeypatch.delenv("WORLD_SIZE")
    assert inference_accelerator("rlhf score") is None  # one process: no accelerator, the stage as it always ran


def test_ref_logps_on_two_processes_equals_one_process(shared, tiny_policy, tmp_path):
    """11 pairs (8 train, 3 test) in batches of 2: 4 + 2 batches, some processes with a stand-in round."""
    assert run("score", "--input", shared / "gen", "--output", tmp_path / "scored",
               "--reward-fn", f"{shared}/batch_reward.py:reward") == 0
    assert run("filter", "--input", tmp_path / "scored", "--output", tmp_path / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 3) == 0
    args = ["--model", tiny_policy, "--input", tmp_path / "pairs", "--batch-size", 2]
    assert run("ref-logps", *args, "--output", tmp_path / "one") == 0
    res = launch("rlhf_pipeline.stages.ref_logps", *args, "--output", tmp_path / "two")
    assert res.returncode == 0, launch_failure(res)
    one, two = load_from_disk(str(tmp_path / "one")), load_from_disk(str(tmp_path / "two"))
    assert {split: ds.num_rows for split, ds in two.items()} == {"train": 8, "test": 3}
    for split in ("train", "test"):
        assert two[split]["prompt_id"] == one[split]["prompt_id"]
        for name in ("chosen_ref_logp", "rejected_ref_logp"):
            assert two[split][name] == pytest.approx(one[split][name], abs=1e-5)
            assert len(set(one[split][name])) == one[split].num_rows  # distinct values: a mix-up would show
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["processes"] == 2


def test_eval_on_two_processes_equals_one_process(shared, tiny_policy, tiny_rm, tmp_path):
    """The main process samples, both score (a reward model and a function), the main process writes the numbers."""
    args = ["--model", tiny_policy, "--prompts", bundled_path("prompts.jsonl"), "--limit", 7, "--n", 2,
            "--max-new-tokens", 8, "--engine", "hf", "--reward-model", tiny_rm,
            "--reward-fn", f"{shared}/batch_reward.py:reward", "--score-batch-size", 3, "--baseline", tiny_policy]
    assert run("eval", *args, "--output", tmp_path / "one") == 0
    res = launch("rlhf_pipeline.stages.eval", *args, "--output", tmp_path / "two")
    assert res.returncode == 0, launch_failure(res)
    assert res.stdout.count("[generate] wrote") == 1 and res.stdout.count("[eval] reward_fn: mean reward") == 1
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert two["scores"]["reward_fn"] == one["scores"]["reward_fn"]
    model_one, model_two = one["scores"]["reward_model"], two["scores"]["reward_model"]
    fit_one, fit_two = model_one.pop("length_controlled"), model_two.pop("length_controlled")
    assert model_two == pytest.approx(model_one, abs=1e-6)
    assert fit_two == pytest.approx(fit_one, abs=1e-6)  # the LC fit on the rewards of both processes
    samples_one, samples_two = (load_from_disk(str(tmp_path / d / "samples")) for d in ("one", "two"))
    assert samples_two["responses"] == samples_one["responses"]
    assert samples_two["rewards_reward_fn"] == samples_one["rewards_reward_fn"]
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["processes"] == 2
    assert json.loads((tmp_path / "two" / "score_reward_model" / "manifest.json").read_text())["processes"] == 2
