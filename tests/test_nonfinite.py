"""Non-finite losses and gradients: the step is skipped (no update to the weights or the optimizer state, counted in
the metrics and the manifest), K in a row stop the run with one line, and a model with non-finite weights is never
saved as a finished output; the same under DeepSpeed ZeRO-3 on 2 processes as on one."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from conftest import (accelerate_launch, crash_after_checkpoint, launch_failure, logged, make_pairs, max_weight_diff,
                      run)

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
REPO = Path(__file__).resolve().parents[1]
NAN_STEP = 3  # the step of the nan_reward data whose global batch (4 pairs) holds the NaN reward


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    d = make_pairs(tmp_path_factory.mktemp("nonfinite"), tiny_policy, bundled_prompts, limit=40, test_size=4,
                   max_new_tokens=12)
    # the same pairs with one train pair's reward NaN: REBEL's loss on any batch that holds it is NaN. The pair is
    # one of the third global batch of 4 (seed 0), so step NAN_STEP is skipped wherever the pair's micro-batch runs.
    from rlhf_pipeline.training.loop import global_batches

    dd = load_from_disk(str(d / "ref"))
    rewards = list(dd["train"]["chosen_reward"])
    rewards[global_batches(len(rewards), 4, seed=0, epoch=0)[NAN_STEP - 1][0]] = float("nan")
    dd["train"] = dd["train"].remove_columns("chosen_reward").add_column("chosen_reward", rewards)
    dd.save_to_disk(str(d / "nan_reward"))
    (d / "nan_reward" / "manifest.json").write_text((d / "ref" / "manifest.json").read_text())  # the lineage
    return d


def train_args(data: Path, policy, out: Path, *extra) -> list:
    return ["train", "--model", policy, "--data", data, "--output", out, "--report-to", "none", *extra]


def nan_on_calls(monkeypatch, calls: set[int]) -> dict:
    """PairTask.loss returns NaN on the given (1-based) calls: the training forward of those micro-batches. Returns
    the count, which a test may reset (``n``) and point at other calls (``calls``) for its next run."""
    from rlhf_pipeline.algorithms.pairs import PairTask

    real = PairTask.loss
    count = {"n": 0, "calls": calls}

    def loss(self, model, rows):
        value, metrics, tokens = real(self, model, rows)
        if model.training:
            count["n"] += 1
            if count["n"] in count["calls"]:
                value = value * float("nan")
        return value, metrics, tokens

    monkeypatch.setattr(PairTask, "loss", loss)
    return count


def skipped_by_step(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/skipped_steps"] for r in records if "train/skipped_steps" in r}


def optimizer_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "state" / "optimizer.bin", weights_only=True)["state"]


def zero3_optimizer_state(checkpoint: Path, rank: int) -> dict:
    """One process's partition of a ZeRO-3 checkpoint's optimizer: Adam's state (its step count and moments) and the
    fp32 master weights (the learning rate, which the schedule moves every step, left out)."""
    saved = torch.load(checkpoint / "state" / "pytorch_model" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                       weights_only=False)["optimizer_state_dict"]
    return {**saved["optimizer_state_dict"]["state"], "master": dict(enumerate(saved["fp32_flat_groups"]))}


def same_state(a: dict, b: dict) -> bool:
    """Two optimizer states ({param: {name: value}}) hold the same values, bit for bit."""
    def equal(x, y) -> bool:
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y

    return a.keys() == b.keys() and all(a[k].keys() == b[k].keys() and all(equal(a[k][n], b[k][n]) for n in a[k])
                                        for k in a)


def test_a_non_finite_loss_skips_its_step_and_nothing_changes(pairs, tiny_policy, tmp_path, monkeypatch):
    nan_on_calls(monkeypatch, {2})
    out = tmp_path / "out"
    assert run(*train_args(pairs / "ref", tiny_policy, out, "--algo", "dpo", "--temperature", 0.8, "--max-steps", 4,
                           "--batch-size", 2, "--save-every", 1, "--learning-rate", 1e-3, "--save-total-limit", 0,
                           "--keep-checkpoints")) == 0
    one, two, three = (out / "checkpoints" / f"step_00000{i}" for i in (1, 2, 3))
    assert max_weight_diff(one, two) == 0.0  # the skipped step applied no update
    assert same_state(optimizer_state(one), optimizer_state(two))  # nor touched Adam's moments
    assert max_weight_diff(two, three) > 0 and not same_state(optimizer_state(two), optimizer_state(three))
    assert skipped_by_step(out) == {1: 0, 2: 1, 3: 1, 4: 1}
    assert all(math.isfinite(x) for x in logged(out)) and len(logged(out)) == 3  # step 2 logs no loss
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["skipped_steps"] == 1
    assert all(torch.isfinite(t).all() for t in load_file(out / "model.safetensors").values())


def test_a_skipped_last_step_still_logs_its_window_in_one_line(pairs, tiny_policy, tmp_path, monkeypatch):
    """--logging-steps 2 over 4 steps whose last is skipped: step 4's one line holds the mean of the window's applied
    step (3) with the skipped count; a skipped step not at a window's end logs its count and rate alone."""
    count = nan_on_calls(monkeypatch, {4})
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 4, "--batch-size", 2, "--learning-rate", 1e-3]
    assert run(*train_args(pairs / "ref", tiny_policy, tmp_path / "every", *common)) == 0
    count.update(n=0)
    out = tmp_path / "windows"
    assert run(*train_args(pairs / "ref", tiny_policy, out, *common, "--logging-steps", 2)) == 0
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss/eval" not in r]
    assert [r["step"] for r in records] == [2, 4]
    every = logged(tmp_path / "every")
    assert logged(out) == pytest.approx([(every[0] + every[1]) / 2, every[2]], rel=1e-6)
    assert records[1]["train/skipped_steps"] == 1 and skipped_by_step(tmp_path / "every") == {1: 0, 2: 0, 3: 0, 4: 1}


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


def test_a_run_whose_every_step_was_skipped_stops_with_one_line(pairs, tiny_policy, tmp_path, monkeypatch, capsys):
    """Fewer steps than --max-nonfinite-steps, every one skipped: no model is saved as trained, as when K in a row
    stop a longer run (it was saved, then its summary raised on the missing loss)."""
    nan_on_calls(monkeypatch, set(range(1, 100)))
    out = tmp_path / "out"
    capsys.readouterr()
    assert run(*train_args(pairs / "ref", tiny_policy, out, "--algo", "dpo", "--temperature", 0.8, "--max-steps", 2,
                           "--batch-size", 2)) == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: step 2: the loss or the gradients were not finite for 2 steps in a row"), line
    assert "no step had a finite loss" in line and "Traceback" not in err
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
                           "--batch-size", 2, "--save-every", 1, "--learning-rate", 1e-3, "--keep-checkpoints")) == 0
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


def test_a_resumed_run_carries_the_skip_counters(pairs, tiny_policy, tmp_path, monkeypatch, capsys):
    """The skipped-step total and the count in a row are in the checkpoints' trainer state: a run cut right after
    its skipped step resumes to the same end as the run that was not cut, and a run cut inside a streak of
    non-finite steps stops where the uncut one would."""
    common = ["--algo", "rebel", "--temperature", 0.8, "--max-steps", 5, "--batch-size", 4, "--save-every", 1,
              "--learning-rate", 1e-3]
    assert run(*train_args(pairs / "nan_reward", tiny_policy, tmp_path / "full", *common)) == 0
    crash_after_checkpoint(monkeypatch, NAN_STEP)
    assert run(*train_args(pairs / "nan_reward", tiny_policy, tmp_path / "cut", *common)) == 130
    assert json.loads((tmp_path / "cut" / "checkpoints" / f"step_00000{NAN_STEP}" / "trainer_state.json").read_text())[
        "skipped_in_a_row"] == 1
    assert run(*train_args(pairs / "nan_reward", tiny_policy, tmp_path / "cut", *common, "--resume")) == 0
    assert skipped_by_step(tmp_path / "cut") == skipped_by_step(tmp_path / "full") == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    assert logged(tmp_path / "cut") == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    assert max_weight_diff(tmp_path / "cut", tmp_path / "full") < 1e-6
    for out in ("cut", "full"):
        assert json.loads((tmp_path / out / "manifest.json").read_text())["training"]["skipped_steps"] == 1

    # NaN at steps 2 and 3 with --max-nonfinite-steps 2, cut after step 2: the resumed run stops at step 3
    streak = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 6, "--batch-size", 2, "--save-every", 1,
              "--learning-rate", 1e-3, "--max-nonfinite-steps", 2]
    count = nan_on_calls(monkeypatch, {2, 3})
    crash_after_checkpoint(monkeypatch, 2)
    assert run(*train_args(pairs / "ref", tiny_policy, tmp_path / "streak", *streak)) == 130
    count.update(n=0, calls={1})  # the resumed run's first training forward is step 3's
    capsys.readouterr()
    assert run(*train_args(pairs / "ref", tiny_policy, tmp_path / "streak", *streak, "--resume")) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: step 3: the loss or the gradients were not finite for 2 steps in a row"), line
    assert f"the last finite loss was {logged(tmp_path / 'streak')[0]:.6g}" in line, line
    assert not (tmp_path / "streak" / "manifest.json").exists()


def launch_zero3(out: Path, *args, stage: int = 3) -> subprocess.CompletedProcess:
    """``rlhf train ARGS`` on 2 processes under DeepSpeed ZeRO-3 (or ``stage``) on the CPU (gloo)."""
    return accelerate_launch(["-m", "rlhf_pipeline.stages.train", *args, "--output", out], timeout=400, stage=stage)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_process_zero3_skips_the_same_step_as_one_process(pairs, tiny_policy, tmp_path, stage):
    """REBEL on pairs where one train pair's reward is NaN: whichever process holds it, every process skips that
    step, leaving the weights, Adam's moments and step counts and the fp32 master weights of every partition as
    they were; 2 processes x batch 1 x accumulation 2 under ZeRO-3 end where 1 process x batch 2 x accumulation 2
    does (the accumulation included: ZeRO-3 adds the window's micro-batches up, see begin_deepspeed_micro_batch).
    Under ZeRO-2 DeepSpeed's engine steps whatever the gradients hold, and the trainer skips the step by hand
    (training.loop): the same steps are skipped and the run ends where the single process's does."""
    data = ["--model", tiny_policy, "--data", pairs / "nan_reward", "--report-to", "none"]
    # Adam turns float sums in another order (ZeRO-3's reduce-scatter) into updates of up to the learning rate where
    # a gradient is near 0: at 1e-3 the two runs' weights drifted 1.2e-4 apart in 5 steps on some data, at 1e-4 ten
    # times less; the skipped step is what is compared, exactly, below
    common = ["--algo", "rebel", "--temperature", 0.8, "--max-steps", 5, "--learning-rate", 1e-4, "--save-every", 1,
              "--gradient-accumulation-steps", 2, "--save-total-limit", 0, "--keep-checkpoints"]
    assert run("train", *data, *common, "--batch-size", 2, "--output", tmp_path / "single") == 0
    res = launch_zero3(tmp_path / "zero3", *data, *common, "--batch-size", 1, stage=stage)
    assert res.returncode == 0, launch_failure(res)
    for out in ("single", "zero3"):
        assert json.loads((tmp_path / out / "manifest.json").read_text())["training"]["skipped_steps"] == 1
        assert skipped_by_step(tmp_path / out) == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    assert logged(tmp_path / "zero3") == pytest.approx(logged(tmp_path / "single"), abs=1e-5)
    assert max_weight_diff(tmp_path / "zero3", tmp_path / "single") < 1e-4
    if stage == 2:
        return

    before, skipped, after = (tmp_path / "zero3" / "checkpoints" / f"step_{s:06d}"
                              for s in (NAN_STEP - 1, NAN_STEP, NAN_STEP + 1))
    assert max_weight_diff(before, skipped) == 0.0 and max_weight_diff(skipped, after) > 0
    for rank in (0, 1):
        assert same_state(zero3_optimizer_state(before, rank), zero3_optimizer_state(skipped, rank))
        assert not same_state(zero3_optimizer_state(skipped, rank), zero3_optimizer_state(after, rank))
    before, skipped = (tmp_path / "single" / "checkpoints" / f"step_{s:06d}" for s in (NAN_STEP - 1, NAN_STEP))
    assert max_weight_diff(before, skipped) == 0.0
    assert same_state(optimizer_state(before), optimizer_state(skipped))


def test_two_process_zero3_stops_with_one_line(pairs, tiny_policy, tmp_path):
    """--max-nonfinite-steps 1 on the same data: both processes stop at the NaN step, the main one says why in one
    line, and nothing is saved as finished."""
    res = launch_zero3(tmp_path / "zero3", "--model", tiny_policy, "--data", pairs / "nan_reward", "--report-to",
                       "none", "--algo", "rebel", "--temperature", 0.8, "--max-steps", 5, "--batch-size", 2,
                       "--learning-rate", 1e-3, "--max-nonfinite-steps", 1)
    assert res.returncode != 0, launch_failure(res)
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, launch_failure(res)
    expected = f"error: step {NAN_STEP}: the loss or the gradients were not finite for 1 step in a row"
    assert lines[0].startswith(expected), lines[0]
    assert f"the last finite loss was {logged(tmp_path / 'zero3')[-1]:.6g}" in lines[0], lines[0]
    frames = [x for x in res.stderr.splitlines() if x.lstrip().startswith('File "') and "rlhf_pipeline" in x]
    assert not frames, launch_failure(res)  # (the launcher prints its own traceback for a process that failed)
    assert not (tmp_path / "zero3" / "manifest.json").exists()
    assert not (tmp_path / "zero3" / "model.safetensors").exists()
