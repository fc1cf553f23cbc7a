"""Non-finite losses and gradients: the step is skipped (no update to the weights or the optimizer state, counted in
the metrics and the manifest), K in a row stop the run with one line, and a model with non-finite weights is never
saved as a finished output; the same under DeepSpeed ZeRO-3 on 2 processes as on one."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from conftest import free_port, launch_failure, logged, make_pairs, max_weight_diff, run

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    d = make_pairs(tmp_path_factory.mktemp("nonfinite"), tiny_policy, bundled_prompts, limit=40, test_size=4,
                   max_new_tokens=12)
    # the same pairs with one train pair's reward NaN: REBEL's loss on any batch that holds it is NaN
    dd = load_from_disk(str(d / "ref"))
    rewards = list(dd["train"]["chosen_reward"])
    rewards[5] = float("nan")
    dd["train"] = dd["train"].remove_columns("chosen_reward").add_column("chosen_reward", rewards)
    dd.save_to_disk(str(d / "nan_reward"))
    (d / "nan_reward" / "manifest.json").write_text((d / "ref" / "manifest.json").read_text())  # the lineage
    return d


def train_args(data: Path, policy, out: Path, *extra) -> list:
    return ["train", "--model", policy, "--data", data, "--output", out, "--report-to", "none", *extra]


def nan_on_calls(monkeypatch, calls: set[int]):
    """PairTask.loss returns NaN on the given (1-based) calls: the training forward of those micro-batches."""
    from rlhf_pipeline.algorithms.pairs import PairTask

    real = PairTask.loss
    count = {"n": 0}

    def loss(self, model, rows):
        value, metrics, tokens = real(self, model, rows)
        if model.training:
            count["n"] += 1
            if count["n"] in calls:
                value = value * float("nan")
        return value, metrics, tokens

    monkeypatch.setattr(PairTask, "loss", loss)


def optimizer_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "state" / "optimizer.bin", weights_only=True)["state"]


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k]
                                        if isinstance(a[k][n], torch.Tensor))


def test_a_non_finite_loss_skips_its_step_and_nothing_changes(pairs, tiny_policy, tmp_path, monkeypatch):
    nan_on_calls(monkeypatch, {2})
    out = tmp_path / "out"
    assert run(*train_args(pairs / "ref", tiny_policy, out, "--algo", "dpo", "--temperature", 0.8, "--max-steps", 4,
                           "--batch-size", 2, "--save-every", 1, "--learning-rate", 1e-3)) == 0
    one, two, three = (out / "checkpoints" / f"step_00000{i}" for i in (1, 2, 3))
    assert max_weight_diff(one, two) == 0.0  # the skipped step applied no update
    assert same_state(optimizer_state(one), optimizer_state(two))  # nor touched Adam's moments
    assert max_weight_diff(two, three) > 0 and not same_state(optimizer_state(two), optimizer_state(three))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["train/skipped_steps"] for r in records if "train/skipped_steps" in r}
    assert skipped == {1: 0, 2: 1, 3: 1, 4: 1}
    assert all(math.isfinite(x) for x in logged(out)) and len(logged(out)) == 3  # step 2 logs no loss
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["skipped_steps"] == 1
    assert all(torch.isfinite(t).all() for t in load_file(out / "model.safetensors").values())


def test_k_non_finite_steps_in_a_row_stop_the_run_with_one_line(pairs, tiny_policy, tmp_path, monkeypatch, capsys):
    nan_on_calls(monkeypatch, set(range(2, 100)))
    out = tmp_path / "out"
    capsys.readouterr()
    assert run(*train_args(pairs / "ref", tiny_policy, out, "--algo", "dpo", "--temperature", 0.8, "--max-steps", 8,
                           "--batch-size", 2, "--max-nonfinite-steps", 3)) == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    first = logged(out)[0]
    assert line.startswith("error: step 4: the loss or the gradients were not finite for 3 steps in a row"), line
    assert f"the last finite loss was {first:.6g}" in line and "--learning-rate" in line, line
    assert "Traceback" not in err
    assert not (out / "manifest.json").exists() and not (out / "model.safetensors").exists()


def test_non_finite_gradients_under_a_finite_loss_are_skipped_too(pairs, tiny_policy, tmp_path, monkeypatch):
    """A hook puts inf into one gradient at the second step: the loss is finite, the gradient norm is not."""
    from rlhf_pipeline.training import loop

    real_prepare = loop.prepare
    calls = {"n": 0}

    def prepare(*args, **kwargs):
        setup = real_prepare(*args, **kwargs)
        param = next(p for p in setup.model.parameters() if p.requires_grad)

        def poison(grad):
            calls["n"] += 1
            return grad * float("inf") if calls["n"] == 2 else grad

        param.register_hook(poison)
        return setup

    monkeypatch.setattr(loop, "prepare", prepare)
    out = tmp_path / "out"
    assert run(*train_args(pairs / "ref", tiny_policy, out, "--algo", "dpo", "--temperature", 0.8, "--max-steps", 3,
                           "--batch-size", 2, "--save-every", 1, "--learning-rate", 1e-3)) == 0
    assert max_weight_diff(out / "checkpoints" / "step_000001", out / "checkpoints" / "step_000002") == 0.0
    assert json.loads((out / "manifest.json").read_text())["training"]["skipped_steps"] == 1
    assert len(logged(out)) == 2


def test_a_learning_rate_that_diverges_never_ends_as_a_finished_nan_model(pairs, tiny_policy, tmp_path, capsys):
    """The issue's run: rlhf train --algo dpo --learning-rate 1e4. It either finishes with finite weights (its
    non-finite steps skipped) or stops with one line; it never exits 0 with NaN weights."""
    out = tmp_path / "out"
    capsys.readouterr()
    rc = run(*train_args(pairs / "ref", tiny_policy, out, "--algo", "dpo", "--temperature", 0.8,
                         "--learning-rate", 1e4, "--max-steps", 12, "--batch-size", 2))
    err = capsys.readouterr().err
    if rc == 0:
        assert all(torch.isfinite(t).all() for t in load_file(out / "model.safetensors").values())
    else:
        (line,) = [x for x in err.splitlines() if x.startswith("error:")]
        assert "not finite" in line and "--learning-rate" in line, line
        assert not (out / "manifest.json").exists()


def test_two_process_zero3_skips_the_same_step_as_one_process(pairs, tiny_policy, tmp_path):
    """REBEL on pairs where one train pair's reward is NaN: whichever process holds it, every process skips that
    step, and 2 processes x batch 2 under ZeRO-3 end where 1 process x batch 2 x accumulation 2 does."""
    common = ["--algo", "rebel", "--temperature", 0.8, "--epochs", 1, "--learning-rate", 1e-3, "--batch-size", 2]
    assert run(*train_args(pairs / "nan_reward", tiny_policy, tmp_path / "single", *common,
                           "--gradient-accumulation-steps", 2)) == 0
    single = json.loads((tmp_path / "single" / "manifest.json").read_text())["training"]
    assert single["skipped_steps"] == 1
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / "accelerate_cfgs" / "cpu_zero3.yaml"), "--main_process_port", str(free_port()),
           "-m", "rlhf_pipeline.stages.train",
           *map(str, train_args(pairs / "nan_reward", tiny_policy, tmp_path / "zero3", *common)[1:])]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert res.returncode == 0, launch_failure(res)
    assert json.loads((tmp_path / "zero3" / "manifest.json").read_text())["training"]["skipped_steps"] == 1
    assert logged(tmp_path / "zero3") == pytest.approx(logged(tmp_path / "single"), abs=1e-5)
    assert max_weight_diff(tmp_path / "zero3", tmp_path / "single") < 1e-4
