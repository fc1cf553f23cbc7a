"""SIGKILL at a random point, then the same command again: for each of the nine stages, the rerun's result equals an
uninterrupted run's, nothing half-made was ever visible as finished, and nothing finished was redone.

Each case runs the stage's command once to completion (the reference), then runs the same command into a fresh output
as a process of its own group, sends SIGKILL to the group (``rlhf iterate``'s stage processes die with it, as on an
OOM kill or a pre-empted node) at a random point, and runs the same command again to completion. It checks:

* the result equals the reference: datasets column by column (and the manifests' row counts), trained weights
  (``max_weight_diff`` < 1e-6: resuming is bit-identical on one CPU process) and metrics.jsonl, eval's results.json;
* nothing half-made was visible as finished: after the kill an output either has no manifest.json or is the complete
  one, and no temporary directory (``.NAME.tmp-*``, ``.NAME.old-*``, ``step_N.tmp``) survives the rerun;
* nothing finished was redone: an output that had its manifest keeps its ``output_id``; a training run's complete
  checkpoints keep their files untouched and the rerun resumes from the newest; eval's finished parts and iterate's
  finished steps are not run again.

The kill point is a fraction, drawn with a fixed seed per stage, of the span in which the reference did its work,
never the interpreter's start-up: for a single-write stage, from when it opened its output (its manifest's
``wall_time_s`` counts from there) to when its manifest appeared; for a stage that fills its output piece by piece
(training, eval, iterate), from when its first piece was finished (the first checkpoint, eval's generate/, iterate's
first step) to when its manifest appeared, so that each such case kills a run with finished work to reuse (a kill
before that leaves nothing to reuse, as the single-write cases show). An overlapped iterate (``overlap: 1``) is killed
while its two sides run together: when iteration 1's first checkpoint appears, iteration 2 sampling beside it. A run
that finishes before its kill point proves nothing: the case is retried with the point moved halfway to the span's
start, and fails after four tries.

The last tests kill the writes themselves at the moments a random kill rarely hits: inside a directory being
written, between creating a file and writing it (the run record; metrics.jsonl cut back on resume), and while
--save-total-limit removes an old checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import LENGTH_REWARD, max_weight_diff

from rlhf_pipeline.training.checkpoints import list_checkpoints
from rlhf_pipeline.config import OutputOptions, option
from rlhf_pipeline.layout import PARTS_DIR, REF_LOGPS_CACHE, RUN_RECORD

ENV = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
MANIFEST = "manifest.json"
# every checkpoint kept, through the run and after it: the tests compare them with the uninterrupted run's
TRAINING = {"--max-steps": 30, "--batch-size": 2, "--save-every": 3, "--learning-rate": 1e-4, "--report-to": "none",
            "--save-total-limit": 0, "--keep-checkpoints": True}
FIRST_CHECKPOINT = f"checkpoints/step_{TRAINING['--save-every']:06d}"
ITERATE_STEPS = ["iter_1/generate", "iter_1/score", "iter_1/filter", "iter_1/train"]


# ----------------------------------------------------------------------------------------------------------------
# Running, killing, rerunning


def launch(args: list, log: Path) -> subprocess.Popen:
    """``rlhf ARGS`` as the leader of a new process group, its output to ``log``."""
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, "-m", "rlhf_pipeline.cli", *map(str, args)], env=ENV, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_until_group_dead(pgid: int, timeout: float = 30.0) -> None:
    """Until no process of the group runs (a killed child reparented to a PID 1 that never reaps stays a zombie)."""
    if not Path("/proc/self/stat").exists():
        time.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            except (OSError, IndexError):
                continue
            alive = alive or (int(group) == pgid and state != "Z")
        if not alive:
            return
        time.sleep(0.02)
    raise AssertionError(f"process group {pgid} still runs {timeout}s after SIGKILL")


@dataclass
class Reference:
    """A stage's command (a function of the output path) and its uninterrupted run."""

    stage: str
    command: Callable[[Path], list]
    output: Path
    span: tuple[float, float]  # seconds after launch in which the stage did its work
    started: str | None  # the file under the output whose appearance starts that span (None: a time after launch)


def reference(stage: str, command: Callable[[Path], list], out: Path, done: str = MANIFEST,
              started: str | None = None) -> Reference:
    """Run ``command`` uninterrupted into ``out``; its span runs from when ``out/started`` appeared (default: when
    the stage opened its output) to when ``out/done`` appeared."""
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc = launch(command(out), out.parent / f"{out.name}.log")
    start_at = done_at = None
    while proc.poll() is None:
        if started is not None and start_at is None and (out / started).exists():
            start_at = time.monotonic() - t0
        if done_at is None and (out / done).exists():
            done_at = time.monotonic() - t0
        time.sleep(0.01)
    assert proc.returncode == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]
    done_at = done_at if done_at is not None else time.monotonic() - t0
    if started is None:  # the stage output's clock starts when the stage opens it, after its imports
        start_at = done_at - json.loads((out / MANIFEST).read_text())["wall_time_s"]
    return Reference(stage, command, out, (max(0.0, start_at or 0.0), done_at), started)


def kill_at_random_point(ref: Reference, root: Path) -> Path:
    """Run the reference's command into a fresh output under ``root`` and SIGKILL its process group at a seeded
    random point of ``ref.span``; returns the killed run's output. With ``ref.started`` the span's start is when
    that file appears in this run (the start-up's length varies from run to run), else a time after launch."""
    lo, hi = ref.span
    fraction = random.Random(f"sigkill/{ref.stage}").uniform(0.05, 0.95)
    finished = []
    # Each try halves the delay: this run may be much faster than the reference was (measured while other work
    # loaded the cores). The last try kills the moment the span starts (``ref.started`` appearing mid-run).
    for attempt, delay in enumerate([fraction * (hi - lo) / 2**a for a in range(4)] + [0.0]):
        out = root / f"try{attempt}" / "out"
        out.parent.mkdir(parents=True)
        t0 = time.monotonic()
        proc = launch(ref.command(out), out.parent / "killed.log")
        if ref.started is None:
            delay += lo
        else:
            while proc.poll() is None and not (out / ref.started).exists():
                time.sleep(0.005)
            t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < delay:
            time.sleep(0.005)
        if proc.poll() is not None:  # finished (or failed) before the kill: this try proves nothing
            finished.append(f"{delay:.2f}s: exit {proc.returncode}")
            assert proc.returncode == 0, (out.parent / "killed.log").read_text()[-3000:]
            continue
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_until_group_dead(proc.pid)
        assert proc.returncode == -signal.SIGKILL
        state = sorted(p.name for p in out.iterdir()) if out.exists() else "no output"
        after = "launch" if ref.started is None else ref.started
        print(f"[{ref.stage}] killed {delay:.2f}s after {after} (work span {lo:.2f}-{hi:.2f}s): {state}")
        return out
    pytest.fail(f"{ref.stage}: every run finished before its kill point ({'; '.join(finished)}); nothing was tested")


def rerun(ref: Reference, out: Path) -> str:
    """The same command again, to completion; returns its output."""
    log = out.parent / "rerun.log"
    proc = launch(ref.command(out), log)
    rc = proc.wait(timeout=600)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    return text


# ----------------------------------------------------------------------------------------------------------------
# What is compared


def output_id(path: Path) -> str:
    return json.loads((path / MANIFEST).read_text())["output_id"]


def file_stats(directory: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under ``directory``: unchanged means not rewritten."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def stray_temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_dir() and (".tmp" in p.name or ".old-" in p.name)]


def assert_same_data(a: Path, b: Path) -> None:
    """Two dataset directories hold the same splits, columns and values (and their manifests the same counts)."""
    from datasets import DatasetDict, load_from_disk

    def splits(path: Path) -> dict:
        ds = load_from_disk(str(path))
        return {name: d.to_dict() for name, d in (ds.items() if isinstance(ds, DatasetDict) else [("", ds)])}

    sa, sb = splits(a), splits(b)
    assert sa.keys() == sb.keys()
    for split in sa:
        assert list(sa[split]) == list(sb[split]), split
        for column in sa[split]:
            assert sa[split][column] == sb[split][column], f"{a}: split {split!r}, column {column!r} differs"
    if (b / MANIFEST).exists():
        ma, mb = (json.loads((p / MANIFEST).read_text()) for p in (a, b))
        counts = ("rows_in", "rows_out", "dropped")
        assert [ma[k] for k in counts] == [mb[k] for k in counts]


def metrics(path: Path) -> list[dict]:
    """metrics.jsonl without the one wall-clock value (tokens per second)."""
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "throughput/tokens_per_s"} for row in rows]


def assert_same_model(a: Path, b: Path) -> None:
    assert max_weight_diff(a, b) < 1e-6
    assert metrics(a) == metrics(b)


# ----------------------------------------------------------------------------------------------------------------
# The inputs and the uninterrupted runs (each built once; each stage's reference is the next one's input)


@pytest.fixture(scope="module")
def kit(tmp_path_factory, bundled_prompts) -> dict:
    from rlhf_pipeline.demo.task import write_task_data

    d = tmp_path_factory.mktemp("sigkill_kit")
    (d / "reward.py").write_text(LENGTH_REWARD)
    task = write_task_data(d / "task")
    (d / "sft.jsonl").write_text("\n".join(task["sft"].read_text().splitlines()[:48]) + "\n")
    evals = task["eval_prompts"].read_text().splitlines()[:12]
    (d / "eval_prompts.jsonl").write_text("\n".join(evals) + "\n")
    return {"dir": d, "reward_fn": f"{d}/reward.py:reward", "sft": d / "sft.jsonl",
            "eval_prompts": d / "eval_prompts.jsonl", "prompts": Path(bundled_prompts)}


def _flags(options: dict) -> list:
    return [x for k, v in options.items() for x in ((k,) if v is True else (k, v))]


@pytest.fixture(scope="module")
def generate_ref(kit, tiny_policy, tmp_path_factory) -> Reference:
    def command(out):
        return ["generate", "--model", tiny_policy, "--prompts", kit["prompts"], "--output", out, "--n", 4,
                "--max-new-tokens", 16, "--limit", 24]
    return reference("generate", command, tmp_path_factory.mktemp("ref") / "generate")


@pytest.fixture(scope="module")
def score_ref(generate_ref, tiny_rm, tmp_path_factory) -> Reference:
    def command(out):
        return ["score", "--input", generate_ref.output, "--output", out, "--reward-model", tiny_rm]
    return reference("score", command, tmp_path_factory.mktemp("ref") / "score")


@pytest.fixture(scope="module")
def filter_ref(score_ref, tiny_policy, tmp_path_factory) -> Reference:
    def command(out):
        return ["filter", "--input", score_ref.output, "--output", out, "--tokenizer", tiny_policy, "--test-size", 4]
    return reference("filter", command, tmp_path_factory.mktemp("ref") / "filter")


@pytest.fixture(scope="module")
def ref_logps_ref(filter_ref, tiny_policy, tmp_path_factory) -> Reference:
    def command(out):
        return ["ref-logps", "--model", tiny_policy, "--input", filter_ref.output, "--output", out]
    return reference("ref-logps", command, tmp_path_factory.mktemp("ref") / "ref-logps")


@pytest.fixture(scope="module")
def train_ref(filter_ref, tiny_policy, tmp_path_factory) -> Reference:
    # REBEL on pairs without reference log-probs: train computes them once into OUTPUT/ref_logps, more finished work
    # that a resumed run must keep
    def command(out):
        return ["train", "--model", tiny_policy, "--data", filter_ref.output, "--output", out, "--algo", "rebel",
                *_flags(TRAINING), "--resume"]
    return reference("train", command, tmp_path_factory.mktemp("ref") / "train",
                     started=FIRST_CHECKPOINT)


@pytest.fixture(scope="module")
def sft_ref(kit, tiny_policy, tmp_path_factory) -> Reference:
    def command(out):
        return ["sft", "--model", tiny_policy, "--data", kit["sft"], "--output", out, "--test-size", 8,
                *_flags(TRAINING), "--resume"]
    return reference("sft", command, tmp_path_factory.mktemp("ref") / "sft",
                     started=FIRST_CHECKPOINT)


@pytest.fixture(scope="module")
def train_rm_ref(filter_ref, tiny_policy, tmp_path_factory) -> Reference:
    def command(out):
        return ["train-rm", "--model", tiny_policy, "--data", filter_ref.output, "--output", out, *_flags(TRAINING),
                "--resume"]
    return reference("train-rm", command, tmp_path_factory.mktemp("ref") / "train-rm",
                     started=FIRST_CHECKPOINT)


# eval samples and scores the baseline model first, then the evaluated one: each part a stage output of its own
EVAL_PARTS = tuple(f"{who}{part}" for who in ("baseline/", "") for part in ("generate", "score_reward_model",
                                                                             "score_reward_fn"))


@pytest.fixture(scope="module")
def eval_ref(kit, tiny_policy, stop_prone_policy, tiny_rm, tmp_path_factory) -> Reference:
    def command(out):
        return ["eval", "--model", tiny_policy, "--prompts", kit["eval_prompts"], "--output", out, "--n", 2,
                "--max-new-tokens", 16, "--reward-model", tiny_rm, "--reward-fn", kit["reward_fn"],
                "--baseline", stop_prone_policy]
    return reference("eval", command, tmp_path_factory.mktemp("ref") / "eval",
                     started=f"{EVAL_PARTS[0]}/{MANIFEST}")


def iterate_reference(kit, tiny_policy, tmp_path_factory, name: str, extra: str, done: str,
                      started: str) -> Reference:
    """The uninterrupted ``rlhf iterate`` run of a config: the kit's policy, prompts and reward, small sizes,
    every checkpoint kept, and ``extra`` (YAML lines)."""
    config = kit["dir"] / f"{name}.yaml"
    config.write_text(
        f"model: {tiny_policy}\nprompts: {kit['prompts']}\nreward_fn: {kit['reward_fn']}\n{extra}"
        "prompts_per_iteration: 24\ngenerate: {n: 4, max_new_tokens: 16}\nfilter: {test_size: 4}\n"
        "train: {max_steps: 8, batch_size: 2, save_every: 2, learning_rate: 0.0001, report_to: none, save_total_limit: 0,\n"
        "        keep_checkpoints: true}\n"
    )

    def command(out):
        return ["iterate", "--config", config, "--output", out]
    return reference(name, command, tmp_path_factory.mktemp("ref") / name, done=done, started=started)


@pytest.fixture(scope="module")
def iterate_ref(kit, tiny_policy, tmp_path_factory) -> Reference:
    return iterate_reference(kit, tiny_policy, tmp_path_factory, "iterate", "iterations: 1\n",
                             done=f"{ITERATE_STEPS[-1]}/{MANIFEST}", started=f"{ITERATE_STEPS[0]}/{MANIFEST}")


@pytest.fixture(scope="module")
def overlapped_iterate_ref(kit, tiny_policy, tmp_path_factory) -> Reference:
    """Two overlapped iterations (``overlap: 1``): iteration 2 samples, scores and filters with the starting policy
    while iteration 1 trains. The kill comes the moment iteration 1's first checkpoint appears: its training is
    then mid-run with finished work to keep, and iteration 2's sampling was launched with it (both wait for
    iteration 1's filter only)."""
    ref = iterate_reference(
        kit, tiny_policy, tmp_path_factory, "iterate-overlapped",
        "iterations: 2\noverlap: 1\nlane_env: {sample: {OMP_NUM_THREADS: 1}, train: {OMP_NUM_THREADS: 1}}\n",
        done=f"iter_1/train/{MANIFEST}", started=f"iter_1/train/checkpoints/step_{2:06d}")
    return dataclasses.replace(ref, span=(ref.span[0], ref.span[0]))  # no random delay: inside the overlap


# ----------------------------------------------------------------------------------------------------------------
# The single-write stages


def assert_only_finished_chunks(out: Path) -> None:
    """An unfinished output of a stage that keeps its chunks (generate, score) holds its run record and the chunks
    it finished, or is not there: killed before its first chunk was done."""
    if out.exists():
        assert {p.name for p in out.iterdir() if not p.name.startswith(".")} <= {PARTS_DIR, RUN_RECORD}, out


@pytest.mark.parametrize("stage", ["generate", "score", "filter", "ref-logps"])
def test_killed_single_write_stage_reruns_to_the_uninterrupted_result(stage, request, tmp_path):
    ref: Reference = request.getfixturevalue(stage.replace("-", "_") + "_ref")
    out = kill_at_random_point(ref, tmp_path)
    # "Finished work" of these stages is their whole output: StageOutput.save writes the dataset and its manifest
    # into a hidden temporary sibling renamed into place at the end. So what the kill may leave is nothing under the
    # output's name, or the complete output; or, for generate and score, which keep each chunk as it finishes (one
    # chunk here), the run record and the finished chunks, which the rerun reuses.
    finished = (out / MANIFEST).exists()
    if finished:
        assert_same_data(out, ref.output)
        before = output_id(out)
    elif stage in ("generate", "score"):
        assert_only_finished_chunks(out)
    else:
        assert not out.exists(), sorted(p.name for p in out.iterdir())

    log = rerun(ref, out)
    assert_same_data(out, ref.output)
    assert not stray_temporaries(tmp_path)
    if finished:  # complete before the kill: reused, not redone
        assert output_id(out) == before and "nothing to do" in log


# ----------------------------------------------------------------------------------------------------------------
# The training stages


@pytest.mark.parametrize("stage", ["train", "sft", "train-rm"])
def test_killed_training_run_resumes_from_its_checkpoints_to_the_uninterrupted_result(stage, request, tmp_path):
    ref: Reference = request.getfixturevalue(stage.replace("-", "_") + "_ref")
    out = kill_at_random_point(ref, tmp_path)
    finished = (out / MANIFEST).exists()
    if finished:
        assert_same_model(out, ref.output)
        before = output_id(out)
    kept = {p.name: file_stats(p) for p in list_checkpoints(out)}
    cache = out / REF_LOGPS_CACHE
    cache_kept = file_stats(cache) if (cache / "dataset_dict.json").exists() else None

    print(f"[{stage}] complete checkpoints at the kill: {sorted(kept)}; ref-logps cache: {cache_kept is not None}")

    log = rerun(ref, out)
    assert_same_model(out, ref.output)
    assert not stray_temporaries(tmp_path)
    # nothing finished is redone: the complete checkpoints are untouched and the rerun continues from the newest
    for name, stats in kept.items():
        assert file_stats(out / "checkpoints" / name) == stats, name
    if cache_kept is not None:
        assert file_stats(cache) == cache_kept
    if finished:
        assert output_id(out) == before and "nothing to do" in log
    elif kept:
        newest = max(kept)
        assert f"resuming from {out / 'checkpoints' / newest} (step {int(newest.split('_')[1])})" in log, log
    else:
        assert "resuming from" not in log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(
        p.name for p in (ref.output / "checkpoints").iterdir())


# ----------------------------------------------------------------------------------------------------------------
# eval and iterate: several outputs, each finished one reused


def test_killed_eval_keeps_its_finished_parts_and_reruns_to_the_uninterrupted_result(eval_ref, tmp_path):
    ref = eval_ref
    out = kill_at_random_point(ref, tmp_path)
    finished = (out / MANIFEST).exists()
    parts = {name: output_id(out / name) for name in EVAL_PARTS if (out / name / MANIFEST).exists()}
    for name in EVAL_PARTS:  # each part is a stage output of its own: complete, or its finished chunks, or not there
        if name in parts:
            assert_same_data(out / name, ref.output / name)
        else:
            assert_only_finished_chunks(out / name)

    print(f"[eval] finished parts at the kill: {sorted(parts)}")

    log = rerun(ref, out)
    results = [json.loads((p / "results.json").read_text()) for p in (out, ref.output)]
    assert results[0] == results[1]
    assert_same_data(out / "samples", ref.output / "samples")
    for name in EVAL_PARTS:
        assert_same_data(out / name, ref.output / name)
    assert not stray_temporaries(tmp_path)
    assert {name: output_id(out / name) for name in parts} == parts  # finished parts were not redone
    if finished:
        assert "nothing to do" in log


def _launched(run: Path) -> list[str]:
    steps = run / "steps.jsonl"
    return [json.loads(line)["step"] for line in steps.read_text().splitlines()] if steps.exists() else []


OVERLAPPED_STEPS = [f"iter_{t}/{stage}" for t in (1, 2) for stage in ("generate", "score", "filter", "train")]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sequential", "overlapped"])
def test_killed_iterate_relaunches_only_unfinished_steps_and_reaches_the_uninterrupted_result(case, request, tmp_path):
    ref: Reference = request.getfixturevalue("iterate_ref" if case == "sequential" else "overlapped_iterate_ref")
    steps = ITERATE_STEPS if case == "sequential" else OVERLAPPED_STEPS
    trains = [name for name in steps if name.endswith("/train")]
    run = kill_at_random_point(ref, tmp_path)
    finished = {name: output_id(run / name) for name in steps if (run / name / MANIFEST).exists()}
    for name in steps:
        if name in trains:
            continue
        if name in finished:  # dataset stages: complete, or their finished chunks (generate, score), or not there
            assert_same_data(run / name, ref.output / name)
        elif name.endswith(("/generate", "/score")):
            assert_only_finished_chunks(run / name)
        else:
            assert not (run / name).exists(), name
    kept = {(train, p.name): file_stats(p) for train in trains for p in list_checkpoints(run / train)}
    if case == "overlapped":  # killed mid-overlap: iteration 1 training (with a checkpoint), iteration 2 sampling
        assert "iter_1/filter" in finished and "iter_1/train" not in finished and kept, (finished, kept)
    launched_before = _launched(run)
    print(f"[{ref.stage}] finished steps at the kill: {sorted(finished)}; checkpoints: {sorted(kept)}")

    log = rerun(ref, run)
    relaunched = _launched(run)[len(launched_before):]
    assert sorted(relaunched) == sorted(set(steps) - set(finished)), relaunched  # each unfinished one, once
    assert {name: output_id(run / name) for name in finished} == finished
    for name in steps:
        if name in trains:
            assert_same_model(run / name, ref.output / name)
        else:
            assert_same_data(run / name, ref.output / name)
    for (train, name), stats in kept.items():
        assert file_stats(run / train / "checkpoints" / name) == stats, (train, name)
    for train in trains:
        newest = max((name for t, name in kept if t == train), default=None)
        if newest and train not in finished:
            assert f"resuming from {run / train / 'checkpoints' / newest}" in log, log
    assert not stray_temporaries(tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# The writes themselves, killed at the moments a random kill rarely hits


def _python(code: str, *args) -> int:
    """Run ``code`` in a fresh interpreter; its exit status."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=ENV, check=False).returncode


# From here on the process dies at the first byte it writes to a file (SIGXFSZ, which Python ignores by default, at
# its default action): the state a SIGKILL leaves between creating a file and writing it.
DIE_AT_FIRST_WRITE = ("import resource, signal\n"
                      "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
                      "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
                      "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n")


def test_a_directory_write_killed_midway_leaves_no_temporary_behind_once_rewritten(tmp_path):
    """What train's OUTPUT/ref_logps cache (and PPO's rollout, eval's OUTPUT/samples) goes through: a kill inside
    atomic_directory leaves its hidden temporary sibling, which the next write of the same directory removes."""
    from rlhf_pipeline.datasets_io import atomic_directory

    target = tmp_path / "out" / "ref_logps"
    code = ("import os, signal, sys; from pathlib import Path; from rlhf_pipeline.datasets_io import atomic_directory\n"
            "with atomic_directory(Path(sys.argv[1])) as tmp:\n"
            "    (tmp / 'part').write_text('half')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert _python(code, target) == -signal.SIGKILL
    assert not target.exists() and stray_temporaries(tmp_path)  # nothing visible; the half-made part is hidden
    with atomic_directory(target) as tmp:
        (tmp / "part").write_text("whole")
    assert (target / "part").read_text() == "whole"
    assert not stray_temporaries(tmp_path)


@dataclass(kw_only=True)
class RunConfig(OutputOptions):
    learning_rate: float = option(1e-3, help="what a training run's record holds besides the output options")


def test_a_run_record_write_killed_midway_leaves_the_output_resumable(tmp_path):
    """A training run (or eval) killed while it records its start (run_started.json): the rerun with --resume
    continues it, instead of failing to read a truncated record."""
    from rlhf_pipeline.datasets_io import StageOutput

    out = tmp_path / "out"
    out.mkdir()
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_sigkill import RunConfig\n"
            "from rlhf_pipeline.datasets_io import StageOutput\n"
            "out = StageOutput('train', RunConfig(output=sys.argv[1]), [])\n" + DIE_AT_FIRST_WRITE
            + "out.record_start()\n")
    assert _python(code, out) == -signal.SIGXFSZ
    assert StageOutput("train", RunConfig(output=str(out)), []).done(resume=True) is False
    StageOutput("train", RunConfig(output=str(out)), []).record_start()
    assert StageOutput("train", RunConfig(output=str(out)), []).done(resume=True) is False


def test_a_metrics_rewrite_killed_midway_keeps_the_steps_before_the_checkpoint(tmp_path):
    """A resumed run first cuts metrics.jsonl back to the steps of its checkpoint; killed while it does, the rerun
    must still find those steps, or the finished run's metrics.jsonl lacks them."""
    from rlhf_pipeline.training.loop import Metrics

    class MainProcess:
        is_main_process = True

    lines = [json.dumps({"step": s, "loss/train": 1.0 / (s + 1)}) + "\n" for s in range(7)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    code = ("import sys; from pathlib import Path; from rlhf_pipeline.training.loop import Metrics\n"
            "class MainProcess:\n    is_main_process = True\n"
            + DIE_AT_FIRST_WRITE + "Metrics(MainProcess(), Path(sys.argv[1]), resume_step=4)\n")
    assert _python(code, tmp_path) == -signal.SIGXFSZ
    Metrics(MainProcess(), tmp_path, resume_step=4)  # the rerun resumes from the same checkpoint
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:5])


SAVE_CHECKPOINTS = """
import os, shutil, signal, sys
from pathlib import Path
from rlhf_pipeline.training.checkpoints import save_checkpoint

class Accelerator:  # one process: what save_checkpoint asks of accelerate's
    is_main_process, num_processes = True, 1
    class state:  # no DeepSpeed plugin
        deepspeed_plugin = None
    def wait_for_everyone(self): pass
    def get_state_dict(self, model): return {}
    def save_state(self, path): Path(path).mkdir(); (Path(path) / "optimizer.bin").write_bytes(bytes(64))

class Model:
    def save_pretrained(self, path, **kwargs): (Path(path) / "model.safetensors").write_bytes(bytes(64))

class Tokenizer:
    def save_pretrained(self, path): (Path(path) / "tokenizer.json").write_text("{}")

output, steps, victim = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
real_rmtree = shutil.rmtree

def rmtree(path, *args, **kwargs):  # killed while removing the victim: its trainer_state.json gone, the rest not
    if victim and Path(path).name.startswith(victim[0]) and (Path(path) / "trainer_state.json").exists():
        (Path(path) / "trainer_state.json").unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    real_rmtree(path, *args, **kwargs)

shutil.rmtree = rmtree
for step in map(int, steps.split(",")):
    save_checkpoint(Accelerator(), Model(), Tokenizer(), output, {"step": step}, keep=1)
"""


def test_a_checkpoint_removal_killed_midway_leaves_nothing_that_is_never_removed(tmp_path):
    """--save-total-limit removes a checkpoint once a newer one is complete; killed while it does (for a real model
    that takes seconds), what is left must not look like a checkpoint, and must go at the next save."""
    assert _python(SAVE_CHECKPOINTS, tmp_path, "1,2", "step_000001") == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]  # a rerun resumes from the newest
    assert _python(SAVE_CHECKPOINTS, tmp_path, "3") == 0  # the rerun's next save
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003"]
