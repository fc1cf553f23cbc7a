"""Faults, not bad flags: what a long run meets when something breaks under it, on every stage each applies to.

The table (:data:`FAULTS`) damages one input of a real command (a dataset cut short, a data file replaced by
another's, a manifest or a model file damaged) and expects exit status 1, one ``error:`` line naming the damaged file
and the fix, no traceback, and nothing written. Beside it:

* a full disk, for real on a small tmpfs when the test may mount one (root on Linux), else by a simulated
  ``OSError(ENOSPC)``: one line naming the path and the space, no output a later run could take as finished, the
  inputs and the earlier checkpoints untouched, and the rerun (space freed) equal to an uninterrupted run;
* damaged checkpoints: ``--resume`` sets the newest aside, warns, and goes on from the one before, equal to an
  uninterrupted run; none whole is one line;
* ``--push-to-hub`` failing: one line, the output finished with the push recorded as pending, and the same command
  again uploads it without recomputing; the token never shows. Under ``rlhf iterate`` (its stages in their own
  processes, on a Hub kept on the disk, ``tests/fake_hub.py``), the same, and a run whose directory is lost goes on
  from the Hub with ``--resume``, pulling what a launched stage reads.

Non-finite losses and gradients are in tests/test_nonfinite.py; bounded memory in the ``memory_growth`` bench entries.
"""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from conftest import LENGTH_REWARD, crash_after_checkpoint, logged, max_weight_diff, run

from rlhf_pipeline.layout import PARTS_DIR, RUN_RECORD

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


# ------------------------------------------------------------------------------------------------ the inputs


@pytest.fixture(scope="module")
def kit(tmp_path_factory, tiny_policy, tiny_rm, bundled_prompts) -> dict[str, Path]:
    """Every stage's good input, made once by the stages themselves: prompts as a dataset directory, generations,
    scored generations, pairs, pairs with reference log-probs."""
    from datasets import load_dataset

    d = tmp_path_factory.mktemp("faults")
    (d / "reward.py").write_text(LENGTH_REWARD)
    k = {"dir": d, "policy": Path(tiny_policy), "rm": Path(tiny_rm), "reward": f"{d}/reward.py:reward"}
    load_dataset("json", data_files=bundled_prompts, split="train").select(range(24)).save_to_disk(str(d / "prompts"))
    k["prompts"] = d / "prompts"
    assert run("generate", "--model", tiny_policy, "--prompts", k["prompts"], "--output", d / "gen", "--n", 4,
               "--max-new-tokens", 12, "--engine", "hf") == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored", "--reward-fn", k["reward"]) == 0
    assert run("filter", "--input", d / "scored", "--output", d / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 4) == 0
    assert run("ref-logps", "--model", tiny_policy, "--input", d / "pairs", "--output", d / "ref") == 0
    for name in ("gen", "scored", "pairs", "ref"):
        k[name] = d / name
    return k


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def arrow_file(directory: Path) -> Path:
    return sorted(directory.rglob("data-*.arrow"))[0]


def cut_in_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def cut_arrow(d: Path) -> str:
    cut_in_half(arrow_file(d))
    return arrow_file(d).name


def garbage_arrow(d: Path) -> str:
    arrow_file(d).write_bytes(b"\x00garbage" * 512)
    return arrow_file(d).name


def other_schema(d: Path) -> str:
    """A valid Arrow file of another dataset in place of the data."""
    from datasets import Dataset

    Dataset.from_dict({"x": [1.0, 2.0]}).save_to_disk(str(d.parent / f"{d.name}_other"))
    shutil.copy(arrow_file(d.parent / f"{d.name}_other"), arrow_file(d))
    return "Keys mismatch"


def fewer_rows(d: Path) -> str:
    """The data of a stage's output cut at a record batch's end: it reads without an error, short of rows."""
    from datasets import load_from_disk

    ds = load_from_disk(str(d))
    first = arrow_file(d)
    split = first.parent.name if first.parent != d else None  # a DatasetDict's first split, or the dataset
    ds = ds[split] if split else ds
    ds.select(range(ds.num_rows - 1)).save_to_disk(str(d.parent / f"{d.name}_short"))
    shutil.copy(arrow_file(d.parent / f"{d.name}_short"), first)
    return "rows where its manifest.json counted"


def damage(name: str) -> Callable[[Path], str]:
    def cut(d: Path) -> str:
        cut_in_half(d / name)
        return name

    return cut


class Fault(NamedTuple):
    id: str
    args: list  # the command after ``rlhf``; "{x}" is the damaged copy of the kit's input x, "{policy}" etc. as they are
    damaged: str  # the kit entry that is copied and damaged
    damage: Callable[[Path], str]  # damages the copy; returns a part of the expected error line
    expect: str  # another part of the error line


POLICY_ARGS = ["--max-new-tokens", 4, "--engine", "hf"]
FAULTS = [
    # input datasets
    Fault("generate-prompts-cut", ["generate", "--model", "{policy}", "--prompts", "{prompts}", *POLICY_ARGS],
          "prompts", cut_arrow, "is damaged or incomplete"),
    Fault("score-input-cut", ["score", "--input", "{gen}", "--reward-fn", "{reward}"], "gen", cut_arrow,
          "is damaged or incomplete"),
    Fault("score-input-garbage", ["score", "--input", "{gen}", "--reward-fn", "{reward}"], "gen", garbage_arrow,
          "is damaged or incomplete"),
    Fault("score-input-other-schema", ["score", "--input", "{gen}", "--reward-fn", "{reward}"], "gen", other_schema,
          "the dataset could not be read"),
    Fault("score-input-short-of-rows", ["score", "--input", "{gen}", "--reward-fn", "{reward}"], "gen", fewer_rows,
          "a data file is damaged or incomplete"),
    Fault("score-input-manifest-damaged", ["score", "--input", "{gen}", "--reward-fn", "{reward}"], "gen",
          damage("manifest.json"), "damaged (JSONDecodeError"),
    Fault("filter-input-cut", ["filter", "--input", "{scored}", "--tokenizer", "{policy}"], "scored", cut_arrow,
          "is damaged or incomplete"),
    Fault("filter-input-info-damaged", ["filter", "--input", "{scored}", "--tokenizer", "{policy}"], "scored",
          damage("dataset_info.json"), "dataset_info.json is damaged or incomplete"),
    Fault("ref-logps-input-cut", ["ref-logps", "--model", "{policy}", "--input", "{pairs}"], "pairs", cut_arrow,
          "is damaged or incomplete"),
    Fault("train-data-cut", ["train", "--model", "{policy}", "--data", "{ref}", "--algo", "dpo"], "ref", cut_arrow,
          "is damaged or incomplete"),
    Fault("train-data-short-of-rows", ["train", "--model", "{policy}", "--data", "{ref}", "--algo", "dpo"], "ref",
          fewer_rows, "a data file is damaged or incomplete"),
    Fault("eval-prompts-cut", ["eval", "--model", "{policy}", "--prompts", "{prompts}", "--reward-fn", "{reward}",
                               *POLICY_ARGS], "prompts", cut_arrow, "is damaged or incomplete"),
    # models and tokenizers
    Fault("generate-model-weights-cut", ["generate", "--model", "{policy}", "--prompts", "{prompts}", *POLICY_ARGS],
          "policy", damage("model.safetensors"), "the model could not be read"),
    Fault("generate-model-config-damaged", ["generate", "--model", "{policy}", "--prompts", "{prompts}",
                                            *POLICY_ARGS], "policy", damage("config.json"), "could not be read"),
    Fault("score-reward-model-weights-cut", ["score", "--input", "{gen}", "--reward-model", "{rm}"], "rm",
          damage("model.safetensors"), "the model could not be read"),
    Fault("filter-tokenizer-damaged", ["filter", "--input", "{scored}", "--tokenizer", "{policy}"], "policy",
          damage("tokenizer.json"), "the tokenizer could not be read"),
    Fault("ref-logps-model-weights-cut", ["ref-logps", "--model", "{policy}", "--input", "{pairs}"], "policy",
          damage("model.safetensors"), "the model could not be read"),
    # pairs without reference columns: with them, the check that they came from this --model (a copy of the policy
    # at another path here) would answer first
    Fault("train-model-weights-cut", ["train", "--model", "{policy}", "--data", "{pairs}", "--algo", "dpo"], "policy",
          damage("model.safetensors"), "the model could not be read"),
    Fault("train-rm-model-weights-cut", ["train-rm", "--model", "{policy}", "--data", "{dir}/rm.jsonl"], "policy",
          damage("model.safetensors"), "the model could not be read"),
    Fault("sft-tokenizer-config-damaged", ["sft", "--model", "{policy}", "--data", "{dir}/sft.jsonl"], "policy",
          damage("tokenizer_config.json"), "the tokenizer could not be read"),
    Fault("eval-model-weights-cut", ["eval", "--model", "{policy}", "--prompts", "{prompts}", "--reward-fn",
                                     "{reward}", *POLICY_ARGS], "policy", damage("model.safetensors"),
          "the model could not be read"),
]
TRAINING = {"train", "sft", "train-rm"}


@pytest.fixture(scope="module")
def text_data(kit) -> None:
    rows = [{"prompt": f"Review the park number {i}.", "answer": "Lovely.", "chosen": "Lovely.", "rejected": "Dull."}
            for i in range(12)]
    for name in ("sft", "rm"):
        (kit["dir"] / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def tree_digest(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_a_damaged_input_is_one_line_naming_the_file(fault, kit, text_data, tmp_path, capsys):
    damaged = copy_of(kit[fault.damaged], tmp_path / f"damaged_{fault.damaged}")
    expect_file = fault.damage(damaged)
    before = tree_digest(damaged)
    paths = {**{k: str(v) for k, v in kit.items()}, fault.damaged: str(damaged)}
    out = tmp_path / "out"
    args = [str(a).format(**paths) for a in fault.args] + ["--output", str(out)]
    if fault.args[0] in TRAINING:
        args += ["--report-to", "none"]
    capsys.readouterr()
    rc = run(*args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 1, err
    assert len(errors) == 1 and "Traceback" not in err, err
    assert expect_file in errors[0] and fault.expect in errors[0], errors[0]
    assert str(damaged) in errors[0], errors[0]  # names the input (and the file within it)
    assert "again" in errors[0] or "--overwrite" in errors[0], errors[0]  # and what to do
    if fault.args[0] == "eval":  # an evaluation is filled in place: at most its start record, unfinished
        assert not out.exists() or [p.name for p in out.iterdir()] == ["run_started.json"]
    else:
        assert not out.exists()
    assert tree_digest(damaged) == before  # the input as it was


def test_every_stage_that_reads_a_dataset_or_a_model_has_a_fault():
    stages = {f.args[0] for f in FAULTS}
    assert {"generate", "score", "filter", "ref-logps", "train", "sft", "train-rm", "eval"} <= stages


def test_files_checks_find_each_damaged_kind(tmp_path, tiny_policy):
    import torch

    from rlhf_pipeline.files import check_file, damaged_files, seal, verify

    model = copy_of(Path(tiny_policy), tmp_path / "model")
    assert damaged_files(model) == [] and check_file(model / "config.json") is None
    torch.save({"w": torch.ones(1000)}, model / "optimizer.bin")
    assert check_file(model / "optimizer.bin") is None
    seal(model)
    assert verify(model) is None
    blob = bytearray((model / "optimizer.bin").read_bytes())
    blob[blob.index(torch.ones(1).numpy().tobytes() * 8)] ^= 0xFF  # a flipped byte in the tensor: its CRC fails
    (model / "optimizer.bin").write_bytes(bytes(blob))
    assert "CRC" in check_file(model / "optimizer.bin")
    assert "optimizer.bin is damaged" in verify(model)
    cut_in_half(model / "model.safetensors")
    assert [p.name for p, _ in damaged_files(model)] == ["model.safetensors", "optimizer.bin"]
    assert verify(model).startswith("model.safetensors has ")
    (model / "model.safetensors").unlink()
    assert verify(model) == "model.safetensors is missing"


# ------------------------------------------------------------------------------------------------ a full disk


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None and Path("/proc/filesystems").exists() and \
        "tmpfs" in Path("/proc/filesystems").read_text()


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size at ``tmp_path/disk``, unmounted afterwards; ``resize(n)`` changes its size. Skipped
    where the test may not mount one (the simulated tests below run everywhere)."""
    if not can_mount():
        pytest.skip("mounting a tmpfs needs root on Linux; the simulated ENOSPC tests cover this machine")
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = []

    def make(size: str) -> Path:
        opts = f"size={size}" if not mounted else f"remount,size={size}"
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mount)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounted.append(True)
        return mount

    yield make
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> None:
    """Take every free byte of ``disk``."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


DISK_STAGES = [
    ("generate", ["generate", "--model", "{policy}", "--prompts", "{prompts}", *POLICY_ARGS], "gen"),
    ("score", ["score", "--input", "{gen}", "--reward-fn", "{reward}"], "gen"),
    ("filter", ["filter", "--input", "{scored}", "--tokenizer", "{policy}", "--test-size", 4], "scored"),
    ("ref-logps", ["ref-logps", "--model", "{policy}", "--input", "{pairs}"], "pairs"),
    ("train", ["train", "--model", "{policy}", "--data", "{ref}", "--algo", "dpo", "--temperature", 0.8, "--max-steps", 1,
               "--report-to", "none"], "ref"),
    ("eval", ["eval", "--model", "{policy}", "--prompts", "{prompts}", "--reward-fn", "{reward}", *POLICY_ARGS,
              "--limit", 4], "prompts"),
]


@pytest.mark.parametrize("stage,args,source", DISK_STAGES, ids=[s[0] for s in DISK_STAGES])
def test_a_full_disk_is_one_line_and_nothing_finished_is_left(stage, args, source, kit, small_disk, capsys):
    disk = small_disk("256k")
    fill(disk)
    before = tree_digest(kit[source])
    out = disk / "out"
    capsys.readouterr()
    rc = run(*[str(a).format(**{k: str(v) for k, v in kit.items()}) for a in args], "--output", out)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in err, err
    assert f"{out}: no space left on the device" in errors[0] and "free there" in errors[0], errors[0]
    assert not (out / "manifest.json").exists()  # nothing a later run could take as finished
    assert not [p for p in disk.iterdir() if p.name.startswith(".out")]  # no temporary left behind
    assert tree_digest(kit[source]) == before


def test_checkpoints_a_kill_left_beside_a_finished_run_go_when_it_is_found_again(kit, tmp_path, monkeypatch, capsys):
    """A run killed between writing its manifest and removing its checkpoints is finished, with its checkpoints
    (about 112 GB each at 8B) still there, and nothing removed them: the same command again, or rlhf iterate's check
    of the finished step, now removes them (and a killed removal's leftover .tmp) without training again. A run that
    keeps its checkpoints keeps them."""
    import rlhf_pipeline.training.stage as stage
    from rlhf_pipeline.stages.iterate import Step, is_complete

    common = ["--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 3,
              "--save-every", 1, "--batch-size", 2, "--learning-rate", 1e-3, "--report-to", "none"]
    for rerun in ("stage", "iterate"):
        out = tmp_path / rerun
        with monkeypatch.context() as m:
            m.setattr(stage, "remove_checkpoints", lambda path: None)  # killed once the manifest is written
            assert run("train", *common, "--output", out) == 0
        assert json.loads((out / "manifest.json").read_text())["checkpoints"] == []
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
        (out / "checkpoints" / "step_000003.tmp").mkdir()  # what a removal killed midway leaves
        finished = json.loads((out / "manifest.json").read_text())["output_id"]
        capsys.readouterr()
        if rerun == "stage":
            assert run("train", *common, "--output", out) == 0
        else:
            args = [str(a) for a in [*common, "--output", out]]
            assert is_complete(Step("iter_1/train", "train", args, out))
        assert f"{out}: removed the 2 checkpoints its finished run left behind" in capsys.readouterr().out
        assert not (out / "checkpoints").exists()
        assert json.loads((out / "manifest.json").read_text())["output_id"] == finished  # not trained again
    kept = tmp_path / "kept"
    assert run("train", *common, "--keep-checkpoints", "--output", kept) == 0
    assert run("train", *common, "--keep-checkpoints", "--output", kept) == 0
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


def test_a_disk_that_fills_during_training_keeps_the_checkpoints_and_the_rerun_resumes(kit, small_disk, tmp_path,
                                                                                      capsys):
    """The disk fills while the second checkpoint is written: one line, the first checkpoint untouched, no partial
    second one; with space freed, ``--resume`` ends equal to a run that never stopped."""
    common = ["--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 4, "--save-every", 1,
              "--batch-size", 2, "--learning-rate", 1e-3, "--report-to", "none", "--save-total-limit", 0,
              "--keep-checkpoints"]
    assert run("train", *common, "--output", tmp_path / "full") == 0
    one_checkpoint = sum(p.stat().st_size for p in (tmp_path / "full" / "checkpoints" / "step_000001").rglob("*")
                         if p.is_file())
    disk = small_disk(str(int(one_checkpoint * 1.6) // 4096 * 4096))
    out = disk / "out"
    capsys.readouterr()
    assert run("train", *common, "--output", out) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left on the device" in errors[0] and "--resume" in errors[0], err
    assert "--save-total-limit N keeps only the newest N checkpoints" in errors[0], errors[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]
    first = tree_digest(out / "checkpoints" / "step_000001")
    assert not (out / "manifest.json").exists()
    small_disk("64m")  # space freed
    assert run("train", *common, "--output", out, "--resume") == 0
    assert tree_digest(out / "checkpoints" / "step_000001") == first
    assert logged(out) == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    resumed = [json.loads((p / "manifest.json").read_text())["training"]["resumed_from_step"]
               for p in (tmp_path / "full", out)]
    assert resumed == [0, 1]  # what rlhf report marks: the manifest's wall time is the last attempt's
    assert max_weight_diff(out, tmp_path / "full") < 1e-6


def test_simulated_enospc_in_a_dataset_stage_is_one_line(kit, tmp_path, monkeypatch, capsys):
    """Where no tmpfs can be mounted: the write fails with ENOSPC as the OS would raise it."""
    from datasets import Dataset

    def full(self, path, *a, **kw):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "data-00000-of-00001.arrow").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(path) / "data-00000-of-00001.arrow"))

    monkeypatch.setattr(Dataset, "save_to_disk", full)
    out = tmp_path / "out"
    capsys.readouterr()
    assert run("score", "--input", kit["gen"], "--reward-fn", kit["reward"], "--output", out) == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert f"{out}: no space left on the device while writing the output" in line and "needed" in line, line
    # unfinished, not half-written: the run record and the chunk of rewards it finished, which the rerun reuses
    assert sorted(p.name for p in out.iterdir()) == [PARTS_DIR, RUN_RECORD] and not list(tmp_path.glob(".out*"))
    monkeypatch.undo()
    assert run("score", "--input", kit["gen"], "--reward-fn", kit["reward"], "--output", out) == 0
    assert "reusing 1 of 1 chunks an interrupted run finished" in capsys.readouterr().out


def test_simulated_enospc_from_a_library_that_raises_its_own_type(kit, tmp_path, monkeypatch, capsys):
    """tokenizers raises a plain Exception with the OS's text ("No space left on device (os error 28)"), as the
    issue's run showed: the same one line, the run unfinished and resumable."""
    from transformers import PreTrainedTokenizerBase

    def full(self, *a, **kw):
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    out = tmp_path / "out"
    capsys.readouterr()
    assert run("train", "--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 1,
               "--report-to", "none", "--output", out) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "no space left on the device" in line and "with --resume" in line, line
    assert not (out / "manifest.json").exists()


def test_an_unfinished_training_output_is_not_taken_as_a_model(kit, tmp_path, capsys):
    out = copy_of(kit["policy"], tmp_path / "half_trained")
    (out / "run_started.json").write_text("{}")
    capsys.readouterr()
    assert run("generate", "--model", out, "--prompts", kit["prompts"], "--output", tmp_path / "gen") == 1
    assert "an unfinished training run (no manifest.json)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ checkpoints


def interrupted(kit, out: Path, monkeypatch, common: list, at: int) -> None:
    """A run of ``common`` stopped by Ctrl-C right after its step-``at`` checkpoint."""
    crash_after_checkpoint(monkeypatch, at)
    assert run("train", *common, "--output", out) == 130


CHECKPOINT_DAMAGE = {
    "optimizer-cut": lambda c: cut_in_half(c / "state" / "optimizer.bin"),
    "weights-cut": lambda c: cut_in_half(c / "model.safetensors"),
    "trainer-state-damaged": lambda c: (c / "trainer_state.json").write_text("{\"step\": "),
    "file-missing": lambda c: (c / "state" / "random_states_0.pkl").unlink(),
}



def test_a_resumed_run_logs_each_window_once_with_the_mean_of_its_steps(kit, tmp_path, monkeypatch):
    """--logging-steps 3 over 5 steps logs at step 3 the mean of steps 1-3 and at step 5 (the last) that of 4-5:
    losses, gradient norms and the pair metrics alike (token-weighted ones: tests/test_train_groups.py). A run
    killed while saving its step-4 checkpoint (the checkpoint removed) resumes from step 2 with the window's sums,
    so its lines are the uninterrupted run's, and TensorBoard holds each step once: the first attempt's events
    after step 2 are dropped (all of them, resumed with no checkpoint)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = ["--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 5,
              "--batch-size", 2, "--learning-rate", 1e-3]
    assert run("train", *common, "--report-to", "none", "--output", tmp_path / "every") == 0
    out = tmp_path / "windows"
    windowed = [*common, "--logging-steps", 3, "--save-every", 2, "--report-to", "tensorboard", "--output", out]
    crash_after_checkpoint(monkeypatch, 4)
    assert run("train", *windowed) == 130
    shutil.rmtree(out / "checkpoints" / "step_000004")
    assert run("train", *windowed, "--resume") == 0

    every = tmp_path / "every"
    for key in ("loss/train", "grad_norm", "reward/train_accuracy", "logp/train_chosen_logratio"):
        values = logged(every, key)
        assert logged(out, key) == pytest.approx([sum(values[:3]) / 3, sum(values[3:]) / 2], rel=1e-6), key
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss/train" in r] == [3, 5]
    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss/train")] == [3, 5]
    assert [e.value for e in events.Scalars("loss/train")] == pytest.approx(logged(out), rel=1e-6)

    # killed before its first checkpoint was whole (removed): --resume starts over, and the events start over too
    again = tmp_path / "again"
    crash_after_checkpoint(monkeypatch, 2)
    assert run("train", *common, "--save-every", 2, "--report-to", "tensorboard", "--output", again) == 130
    shutil.rmtree(again / "checkpoints")
    assert run("train", *common, "--save-every", 2, "--report-to", "tensorboard", "--output", again, "--resume") == 0
    events = EventAccumulator(str(again / "runs"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss/train")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("how", CHECKPOINT_DAMAGE)
def test_resume_sets_a_damaged_checkpoint_aside_and_goes_on_from_the_one_before(how, kit, tmp_path, monkeypatch,
                                                                                capsys, caplog):
    common = ["--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 6, "--save-every", 2,
              "--batch-size", 2, "--learning-rate", 1e-3, "--report-to", "none"]
    assert run("train", *common, "--output", tmp_path / "full") == 0
    out = tmp_path / "cut"
    interrupted(kit, out, monkeypatch, common, at=4)
    # the command the message gives goes on (without --resume it would be refused: the output holds an unfinished run)
    assert "interrupted; run the same command again with --resume to continue" in capsys.readouterr().err
    newest = out / "checkpoints" / "step_000004"
    CHECKPOINT_DAMAGE[how](newest)
    assert run("train", *common, "--output", out, "--resume") == 0
    text = capsys.readouterr().out + caplog.text
    assert "checkpoint" in caplog.text and "step_000004 is damaged" in caplog.text, caplog.text
    assert "resuming from" in text and "step_000002" in text
    assert (out / "checkpoints" / "step_000004.damaged").is_dir()  # set aside, not deleted
    assert logged(out) == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    assert max_weight_diff(out, tmp_path / "full") < 1e-6


def test_a_whole_checkpoint_that_does_not_load_stops_the_resume_and_is_left_in_place(kit, tmp_path, monkeypatch,
                                                                                      capsys):
    """Whatever failed a load was taken for damage: a machine short of memory, or a package of another version,
    set aside every checkpoint in turn (each fails alike), and --overwrite, which the error advised, deleted them.
    A checkpoint whose files are whole but do not load now stops the run with one line, every checkpoint in place,
    and once the cause is gone the same --resume goes on from the newest."""
    from rlhf_pipeline.training import checkpoints

    common = ["--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 6,
              "--save-every", 2, "--batch-size", 2, "--report-to", "none"]
    out = tmp_path / "cut"
    interrupted(kit, out, monkeypatch, common, at=4)
    monkeypatch.undo()

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    real = checkpoints.load_checkpoint
    monkeypatch.setattr(checkpoints, "load_checkpoint", out_of_memory)
    capsys.readouterr()
    assert run("train", *common, "--output", out, "--resume") == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "step_000004 has all its files whole but did not load (RuntimeError: CUDA out of memory." in line, line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    monkeypatch.setattr(checkpoints, "load_checkpoint", real)
    assert run("train", *common, "--output", out, "--resume") == 0
    assert json.loads((out / "manifest.json").read_text())["training"]["resumed_from_step"] == 4


def test_resume_with_no_whole_checkpoint_is_one_line(kit, tmp_path, monkeypatch, capsys):
    common = ["--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 6, "--save-every", 2,
              "--batch-size", 2, "--report-to", "none"]
    out = tmp_path / "cut"
    interrupted(kit, out, monkeypatch, common, at=4)
    for checkpoint in (out / "checkpoints").iterdir():
        cut_in_half(checkpoint / "model.safetensors")
    capsys.readouterr()
    assert run("train", *common, "--output", out, "--resume") == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "--resume: none of the 2 checkpoint(s)" in line and "--overwrite" in line, line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002.damaged", "step_000004.damaged"]


def test_a_killed_checkpoint_save_is_never_taken_for_complete(kit, tmp_path, monkeypatch):
    """A kill while a checkpoint is written leaves ``step_N.tmp`` (never listed), or a renamed one whose seal is
    missing (an older version's write): --resume skips the first and checks the second file by file."""
    from rlhf_pipeline.training.checkpoints import list_checkpoints

    common = ["--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 4, "--save-every", 2,
              "--batch-size", 2, "--report-to", "none"]
    out = tmp_path / "cut"
    interrupted(kit, out, monkeypatch, common, at=2)
    shutil.copytree(out / "checkpoints" / "step_000002", out / "checkpoints" / "step_000003.tmp")
    assert [p.name for p in list_checkpoints(out)] == ["step_000002"]
    assert (out / "checkpoints" / "step_000002" / "files.json").exists()


# ------------------------------------------------------------------------------------------------ the Hub


def failing_hub(monkeypatch, calls: list, fail: bool):
    """huggingface_hub stand-ins that fail (as offline) or record the uploads."""
    from datasets import Dataset, DatasetDict

    def push(self, repo, **kw):
        if fail:
            raise OSError(f"cannot reach the Hub (token {os.environ['HF_TOKEN']})")
        calls.append(("data", repo))

    class Api:
        def create_repo(self, repo_id, **kw):
            if fail:
                raise OSError("cannot reach the Hub")

        def list_repo_files(self, repo_id, **kw):
            return []  # a new repo

        def file_exists(self, repo_id, filename, **kw):
            if fail:
                raise OSError("cannot reach the Hub")
            return False

        def upload_folder(self, **kw):
            calls.append(("folder", kw["repo_id"]))

        def upload_file(self, **kw):
            calls.append(("manifest", kw["repo_id"], json.loads(kw["path_or_fileobj"])["push"]))

    monkeypatch.setattr(Dataset, "push_to_hub", push)
    monkeypatch.setattr(DatasetDict, "push_to_hub", push)
    monkeypatch.setattr("huggingface_hub.HfApi", Api)


PUSH_STAGES = [
    ("score", ["score", "--input", "{gen}", "--reward-fn", "{reward}"]),
    ("filter", ["filter", "--input", "{scored}", "--tokenizer", "{policy}", "--test-size", 4]),
    ("train", ["train", "--model", "{policy}", "--data", "{ref}", "--algo", "dpo", "--temperature", 0.8, "--max-steps", 1,
               "--report-to", "none"]),
    ("eval", ["eval", "--model", "{policy}", "--prompts", "{prompts}", "--reward-fn", "{reward}", *POLICY_ARGS,
              "--limit", 4]),
]


@pytest.mark.parametrize("stage,args", PUSH_STAGES, ids=[s[0] for s in PUSH_STAGES])
def test_a_failed_push_keeps_the_output_and_the_rerun_pushes_without_recomputing(stage, args, kit, tmp_path,
                                                                                 monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwxyz0123")
    out = tmp_path / "out"
    cmd = [str(a).format(**{k: str(v) for k, v in kit.items()}) for a in args] + ["--output", str(out),
                                                                                   "--push-to-hub", "org/run"]
    calls = []
    failing_hub(monkeypatch, calls, fail=True)
    capsys.readouterr()
    assert run(*cmd) == 1
    captured = capsys.readouterr()
    (line,) = [x for x in captured.err.splitlines() if x.startswith("error:")]
    assert "--push-to-hub org/run: the upload failed" in line and "records the push as pending" in line, line
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["push"] == {"repo_id": "org/run", "pushed": False}
    output_id = manifest["output_id"]

    failing_hub(monkeypatch, calls, fail=False)
    assert run(*cmd) == 0
    captured2 = capsys.readouterr()
    assert "pushing it to org/run" in captured2.out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["output_id"] == output_id  # not recomputed
    assert manifest["push"] == {"repo_id": "org/run", "pushed": True}
    assert calls[-1] == ("manifest", "org/run", {"repo_id": "org/run", "pushed": True})
    assert run(*cmd) == 0 and "nothing to do" in capsys.readouterr().out  # pushed: nothing more
    for text in (captured.out, captured.err, captured2.out, captured2.err,
                 *(p.read_text() for p in out.rglob("*.json*"))):
        assert "hf_abcdefghijklmnopqrstuvwxyz0123" not in text


def test_a_run_whose_push_failed_resumes_and_a_lost_run_resumes_from_the_hub(kit, tmp_path, monkeypatch, capfd):
    """rlhf iterate's steps score and filter, each its own process, pushing to one private repo: the filter's upload
    fails (the run stops there); the same run again pushes it without recomputing. With the stages' outputs deleted,
    --resume finds both finished on the Hub and launches nothing; in another run directory (another machine's), with
    the filter's settings changed, it pulls the score from the Hub (the same output, not recomputed) and runs only
    the filter."""
    import sys

    import fake_hub
    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.stages.iterate import IterateConfig, plan, run_steps

    hub, run_dir = tmp_path / "hub", tmp_path / "run"
    fake_hub.install(monkeypatch.setattr, hub)
    monkeypatch.setenv("FAKE_HUB", str(hub))
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwxyz0123")
    launcher = f"{sys.executable} {Path(fake_hub.__file__)}"

    def steps(run=run_dir, **filter_options):
        config = IterateConfig(output=str(run), model=str(kit["policy"]), prompts=str(kit["prompts"]),
                               reward_fn=kit["reward"], iterations=1, push_to_hub="org/run", private=True,
                               resume=True, filter={"test_size": 4, **filter_options},
                               launchers={"score": launcher, "filter": launcher})
        return [s for s in plan(config) if s.stage in ("score", "filter")]

    def output_id(stage, run=run_dir):
        return json.loads((run / "iter_1" / stage / "manifest.json").read_text())["output_id"]

    shutil.copytree(kit["gen"], run_dir / "iter_1" / "generate")
    hub.mkdir()
    (hub / "fail").write_text("iter1-filter")
    with pytest.raises(PipelineError, match="iter_1/filter failed"):
        run_steps(steps(), run_dir)
    score_id, filter_id = output_id("score"), output_id("filter")
    assert fake_hub.hub_manifest(hub, "org/run", "iter1-score")["output_id"] == score_id
    assert fake_hub.is_private(hub, "dataset", "org/run")
    pending = json.loads((run_dir / "iter_1" / "filter" / "manifest.json").read_text())["push"]
    assert pending == {"repo_id": "org/run", "config": "iter1-filter", "pushed": False}

    (hub / "fail").unlink()
    assert run_steps(steps(), run_dir) == ["iter_1/filter"]
    assert (output_id("score"), output_id("filter")) == (score_id, filter_id)  # nothing recomputed
    assert fake_hub.hub_manifest(hub, "org/run", "iter1-filter")["push"]["pushed"] is True

    shutil.rmtree(run_dir / "iter_1" / "score")
    shutil.rmtree(run_dir / "iter_1" / "filter")
    capfd.readouterr()
    assert run_steps(steps(), run_dir, hub=True) == []
    assert "iter_1/filter: finished on the Hub (org/run#iter1-filter)" in capfd.readouterr().out
    assert not (run_dir / "iter_1" / "score").exists()  # pulled only when a launched stage reads it

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(kit["gen"], elsewhere / "iter_1" / "generate")
    assert run_steps(steps(elsewhere, test_size=6), elsewhere, hub=True) == ["iter_1/filter"]
    assert output_id("score", elsewhere) == score_id  # pulled from the Hub, not recomputed
    assert json.loads((elsewhere / "iter_1" / "score" / "manifest.json").read_text())["config"]["output"] == str(
        elsewhere / "iter_1" / "score")  # the pulled output's manifest says where it is now
    assert fake_hub.hub_manifest(hub, "org/run", "iter1-filter")["config"]["test_size"] == 6
    captured = capfd.readouterr()
    assert "hf_abcdefghijklmnopqrstuvwxyz0123" not in captured.out + captured.err


@pytest.mark.slow
def test_two_process_zero3_resume_skips_a_damaged_checkpoint(kit, tmp_path):
    """Under DeepSpeed ZeRO-3 on 2 processes (each loads its own shards): the newest checkpoint's optimizer shard of
    rank 1 cut short, the run's end undone (no manifest, as if killed after its last checkpoint); --resume sets the
    checkpoint aside on every process alike and ends equal to the run that never stopped."""
    from conftest import accelerate_launch, launch_failure

    args = ["--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature", 0.8, "--max-steps", 6,
            "--save-every", 2, "--batch-size", 2, "--learning-rate", 1e-3, "--report-to", "none", "--keep-checkpoints"]

    def launch(out: Path, *extra) -> None:
        res = accelerate_launch(["-m", "rlhf_pipeline.stages.train", *args, "--output", out, *extra], timeout=400)
        assert res.returncode == 0, launch_failure(res)
        return res

    full = tmp_path / "full"
    launch(full)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    (cut / "manifest.json").unlink()
    (cut / "model.safetensors").unlink()
    metrics = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(line + "\n" for line in metrics if json.loads(line)["step"] <= 4))
    shards = sorted((cut / "checkpoints" / "step_000004").rglob("*rank_1*optim_states.pt"))
    assert shards, sorted(p.name for p in (cut / "checkpoints" / "step_000004").rglob("*"))
    cut_in_half(shards[0])
    res = launch(cut, "--resume")
    assert "step_000004 is damaged" in res.stderr and "resuming from" in res.stdout + res.stderr
    assert (cut / "checkpoints" / "step_000004.damaged").is_dir()
    assert logged(cut) == pytest.approx(logged(full), abs=1e-5)
    assert max_weight_diff(cut, full) < 1e-5


@pytest.mark.slow
def test_two_process_training_pushes_from_the_main_process_after_the_group_is_gone(kit, tmp_path):
    """The upload (16 GB at 8B) held every other process in a collective, under a 6-hour timeout that a hang in
    training then shared. Now the main process pushes alone once the process group is destroyed (and training's
    collectives wait 30 minutes, distributed.TRAINING_COLLECTIVE_TIMEOUT)."""
    from conftest import REPO, accelerate_launch, launch_failure

    hub, record = tmp_path / "hub", tmp_path / "pushes.jsonl"
    wrapper = tmp_path / "train.py"
    wrapper.write_text(
        "import json, os, sys\nsys.path.insert(0, %r)\nimport fake_hub\n"
        "fake_hub.install(setattr, os.environ['FAKE_HUB'])\n"
        "import torch.distributed as dist\nfrom rlhf_pipeline.training import stage\nreal = stage.push_model_to_hub\n"
        "def push(*args):\n    with open(%r, 'a') as f:\n"
        "        f.write(json.dumps({'rank': os.environ['RANK'], 'group': dist.is_initialized()}) + '\\n')\n"
        "    real(*args)\nstage.push_model_to_hub = push\n"
        "from rlhf_pipeline.stages.train import cli\nsys.exit(cli())\n" % (str(REPO / "tests"), str(record)))
    out = tmp_path / "out"
    res = accelerate_launch([wrapper, "--model", kit["policy"], "--data", kit["ref"], "--algo", "dpo", "--temperature",
                             0.8, "--max-steps", 1, "--batch-size", 2, "--report-to", "none", "--output", out,
                             "--push-to-hub", "org/policy"], timeout=400, env={"FAKE_HUB": str(hub)})
    assert res.returncode == 0, launch_failure(res)
    assert [json.loads(line) for line in record.read_text().splitlines()] == [{"rank": "0", "group": False}]
    assert json.loads((out / "manifest.json").read_text())["push"] == {"repo_id": "org/policy", "pushed": True}
    assert (hub / "model" / "org" / "policy" / "rev" / "main" / "model.safetensors").exists()
