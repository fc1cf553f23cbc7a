"""Overlapped iterations (rlhf iterate --overlap 1): the plan (who samples, who is the reference, what waits for
what), the scheduler of the two sides, failure and kill/resume, and one overlapped demo end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.stages import iterate
from rlhf_pipeline.stages.iterate import IterateConfig, Step, check, plan, run_steps


def config(tmp_path, **overrides) -> IterateConfig:
    values = dict(output=str(tmp_path / "run"), model="base", prompts=str(tmp_path / "p.jsonl"), iterations=3,
                  reward_model="rm", eval_prompts="e.jsonl", overlap=1)
    values.update(overrides)
    return IterateConfig(**values)


def arg(step: Step, flag: str):
    return step.args[step.args.index(flag) + 1] if flag in step.args else None


def test_overlapped_plan_samples_one_policy_behind_with_the_sampler_as_reference(tmp_path):
    steps = plan(config(tmp_path))
    run = tmp_path / "run"
    by = {s.name: s for s in steps}
    policy = {0: "base", **{t: str(run / f"iter_{t}" / "train") for t in (1, 2, 3)}}
    # iteration t samples with policy t-2 (iterations 1 and 2 with the starting one) and trains policy t-1 into t
    assert [arg(by[f"iter_{t}/generate"], "--model") for t in (1, 2, 3)] == [policy[0], policy[0], policy[1]]
    assert [arg(by[f"iter_{t}/filter"], "--tokenizer") for t in (1, 2, 3)] == [policy[0], policy[0], policy[1]]
    assert [arg(by[f"iter_{t}/train"], "--model") for t in (1, 2, 3)] == [policy[0], policy[1], policy[2]]
    # REBEL's reference is the policy that sampled the data, wherever that is not the one it trains from
    assert [arg(by[f"iter_{t}/train"], "--ref-model") for t in (1, 2, 3)] == [None, policy[0], policy[1]]
    # two sides: training on one, the rest on the other, each in order
    assert {s.lane for s in steps if s.stage == "train"} == {"train"}
    assert {s.lane for s in steps if s.stage != "train"} == {"sample"}
    # what waits for what: sampling with a policy waits for its training, training for the one before and its data
    assert "iter_1/train" in by["iter_3/generate"].after
    assert set(by["iter_2/train"].after) == {"iter_1/train", "iter_2/filter"}
    assert "iter_1/train" not in by["iter_2/generate"].after  # iteration 2 samples while iteration 1 trains
    assert "iter_2/train" in by["iter_2/eval"].after and "iter_0/eval" in by["iter_2/eval"].after
    # the list is in an order the scheduler can take: every step after those it waits for
    seen: set[str] = set()
    for step in steps:
        assert set(step.after) <= seen, step.name
        seen.add(step.name)
    check(steps)  # every stage parses its options


def test_sequential_plan_is_unchanged_by_the_overlap_machinery(tmp_path):
    steps = plan(config(tmp_path, overlap=0))
    assert all(s.after is None and s.lane == "main" and not s.env for s in steps)
    assert not any("--ref-model" in s.args for s in steps)
    run = tmp_path / "run"
    assert arg({s.name: s for s in steps}["iter_2/generate"], "--model") == str(run / "iter_1" / "train")


def test_group_family_keeps_its_kl_reference_and_the_sampler_log_probs(tmp_path):
    by = {s.name: s for s in plan(config(tmp_path, algo="grpo"))}
    assert [arg(by[f"iter_{t}/train"], "--ref-model") for t in (1, 2, 3)] == ["base"] * 3
    assert arg(by["iter_3/generate"], "--model") == str(tmp_path / "run" / "iter_1" / "train")


@pytest.mark.parametrize("algo, reference", [("dpo", "sampler"), ("kto", "sampler"), ("simpo", None),
                                             ("raft", None), ("ppo", "base")])
def test_each_family_gets_the_reference_its_registry_entry_declares(tmp_path, algo, reference):
    """With overlap 1 the DPO family and KTO take the sampler as their reference, the reference-free losses and
    RAFT none, the PPO family its KL reference; PPO's critic of iteration t waits for iteration t-1's training."""
    run = tmp_path / "run"
    by = {s.name: s for s in plan(config(tmp_path, algo=algo))}
    sampler = {1: "base", 2: "base", 3: str(run / "iter_1" / "train")}
    expected = {t: sampler[t] if reference == "sampler" else reference for t in (1, 2, 3)}
    if reference == "sampler":
        expected[1] = None  # iteration 1 trains the policy that sampled it
    assert {t: arg(by[f"iter_{t}/train"], "--ref-model") for t in (1, 2, 3)} == expected
    if algo == "ppo":
        assert arg(by["iter_2/train"], "--critic-model") == str(run / "iter_1" / "train" / "critic")
        assert "iter_1/train" in by["iter_2/train"].after


def test_an_algorithm_that_needs_its_own_samples_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^overlap 1: --algo sppo needs samples of the policy it trains \(.*\); "
                                         r"run it with overlap 0$"):
        config(tmp_path, algo="sppo")


@pytest.mark.parametrize("overrides, message", [
    ({"overlap": 2}, "overlap 2: 0 .sequential. or 1"),
    ({"overlap": 0, "lane_env": {"train": {"A": 1}}}, "set overlap 1 too"),
    ({"lane_env": {"gpu": {"A": 1}}}, "unknown side.s. gpu; the sides are sample, train"),
])
def test_overlap_options_are_checked(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **overrides)


def test_each_side_gets_its_environment(tmp_path):
    steps = plan(config(tmp_path, lane_env={"sample": {"CUDA_VISIBLE_DEVICES": "0,1"},
                                            "train": {"CUDA_VISIBLE_DEVICES": "2,3", "OMP_NUM_THREADS": 4}}))
    for step in steps:
        assert step.env["CUDA_VISIBLE_DEVICES"] == ("2,3" if step.stage == "train" else "0,1")
    assert {s.env.get("OMP_NUM_THREADS") for s in steps if s.stage == "train"} == {"4"}


def test_a_credential_in_lane_env_reaches_its_stages_but_not_the_run_record(tmp_path, monkeypatch):
    """iterate.json records the run's config; a token given to one side's stages is left out of it."""
    lanes = {"sample": {"CUDA_VISIBLE_DEVICES": "0,1", "WANDB_API_KEY": "k-123456"},
             "train": {"HF_TOKEN": "hf_" + "y" * 34, "OMP_NUM_THREADS": 4}}
    seen = {}
    monkeypatch.setattr(iterate, "check", lambda steps: None)  # no models or data behind this config
    monkeypatch.setattr(iterate, "run_steps", lambda steps, run, **kwargs: seen.update({s.name: s.env for s in steps}))
    iterate.run_iterations(config(tmp_path, lane_env=lanes))
    assert seen["iter_1/generate"]["WANDB_API_KEY"] == "k-123456"
    assert seen["iter_1/train"]["HF_TOKEN"] == lanes["train"]["HF_TOKEN"]
    recorded = json.loads((tmp_path / "run" / "iterate.json").read_text())["lane_env"]
    assert recorded == {"sample": {"CUDA_VISIBLE_DEVICES": "0,1", "WANDB_API_KEY": "***"},
                        "train": {"HF_TOKEN": "***", "OMP_NUM_THREADS": 4}}


# ---------------------------------------------------------------------------------------------- the scheduler

# A stand-in stage: records its environment, sleeps, writes its manifest (or exits with a status)
STAGE = """
import json, os, sys, time
out, seconds, rc = sys.argv[-3], float(sys.argv[-2]), int(sys.argv[-1])
time.sleep(seconds)
if rc:
    sys.exit(rc)
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "manifest.json"), "w").write(json.dumps({"env": os.environ.get("LANE_MARK")}))
"""


def fake(tmp_path, name, lane, after, seconds=0.0, rc=0, stage="generate") -> Step:
    out = tmp_path / name
    return Step(name, stage, [str(out), str(seconds), str(rc)], out, launcher=[sys.executable, "-c", STAGE],
                after=after, lane=lane, env={"LANE_MARK": lane})


@pytest.fixture
def manifest_means_done(monkeypatch):
    """Stand-in stages have no config to compare: a manifest means finished."""
    monkeypatch.setattr(iterate, "is_complete", lambda step, *hub: (step.output / "manifest.json").exists())


def log(run: Path) -> dict[str, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "steps.jsonl").read_text().splitlines())}


def test_the_two_sides_run_side_by_side_and_each_waits_for_what_it_reads(tmp_path, manifest_means_done):
    steps = [fake(tmp_path, "a", "sample", [], seconds=1.0), fake(tmp_path, "b", "train", [], seconds=1.0),
             fake(tmp_path, "c", "sample", ["a", "b"]), fake(tmp_path, "d", "train", ["b"])]
    run = tmp_path / "run"
    launched = run_steps(steps, run)
    assert launched[:2] == ["a", "b"] and sorted(launched[2:]) == ["c", "d"]
    records = log(run)
    a, b, c, d = (records[n] for n in "abcd")
    assert a["started"] < b["ended"] and b["started"] < a["ended"], "a and b did not overlap"
    assert c["started"] >= max(a["ended"], b["ended"]) and d["started"] >= b["ended"]
    assert (a["lane"], b["lane"]) == ("sample", "train")
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["env"] == "train"  # its side's environment


def test_finished_steps_are_skipped_one_after_another_before_anything_runs(tmp_path, manifest_means_done):
    """A resumed run whose first steps are finished skips them all in one go and launches the rest (a sequential
    plan, where each step waits for every one before it, and an overlapped one)."""
    for after in (None, "chain"):
        root = tmp_path / str(after)
        names = ["a", "b", "c", "d"]
        steps = [fake(root, n, "main" if after is None else ("train" if n == "c" else "sample"),
                      None if after is None else names[:i]) for i, n in enumerate(names)]
        for n in ("a", "b"):
            (root / n).mkdir(parents=True)
            (root / n / "manifest.json").write_text("{}")
        assert run_steps(steps, root / "run") == ["c", "d"]


def test_a_failure_stops_new_launches_but_lets_the_other_side_finish(tmp_path, manifest_means_done):
    # "train" sleeps long enough that "gen" fails first however slowly its interpreter starts under load
    steps = [fake(tmp_path, "gen", "sample", [], rc=3), fake(tmp_path, "train", "train", [], seconds=5.0),
             fake(tmp_path, "next", "train", ["train"])]
    run = tmp_path / "run"
    with pytest.raises(PipelineError, match=r"^gen failed \(exit status 3"):
        run_steps(steps, run)
    records = log(run)
    assert records["gen"]["rc"] == 3 and records["train"]["rc"] == 0  # the running side was not cut short
    assert (tmp_path / "train" / "manifest.json").exists() and "next" not in records


def test_a_step_that_cannot_start_lets_the_other_side_finish(tmp_path, monkeypatch):
    """An error before a launch (an output left by another run's config, a Hub pull that fails) while the other
    side runs: that side's stage finishes and is recorded, nothing new starts, then the error is raised."""
    def is_complete(step, *hub):
        if step.name == "bad":
            raise PipelineError(f"{step.output} holds a run with another config")
        return (step.output / "manifest.json").exists()

    monkeypatch.setattr(iterate, "is_complete", is_complete)
    steps = [fake(tmp_path, "first", "sample", []), fake(tmp_path, "train", "train", [], seconds=5.0),
             fake(tmp_path, "bad", "sample", ["first"]), fake(tmp_path, "next", "train", ["train"])]
    run = tmp_path / "run"
    with pytest.raises(PipelineError, match="bad holds a run with another config"):
        run_steps(steps, run)
    records = log(run)
    assert records["train"]["rc"] == 0 and (tmp_path / "train" / "manifest.json").exists()
    assert "next" not in records and "bad" not in records


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")
def test_a_killed_overlapped_run_resumes_without_redoing_finished_steps(tmp_path, manifest_means_done):
    """SIGKILL while both sides run takes both stages with it; the rerun launches only what had not finished."""
    run = tmp_path / "run"
    spec = [("done", "sample", [], 0.0), ("long_sample", "sample", ["done"], 60.0), ("long_train", "train", [], 60.0),
            ("last", "sample", ["long_sample", "long_train"], 0.0)]
    parent = (
        "import sys; from pathlib import Path; from rlhf_pipeline.stages import iterate; "
        "from rlhf_pipeline.stages.iterate import Step, run_steps; "
        "iterate.is_complete = lambda s, *hub: (s.output / 'manifest.json').exists(); "
        f"steps = [Step(n, 'generate', [str(Path({str(tmp_path)!r}) / n), str(sec), '0'], Path({str(tmp_path)!r}) / n, "
        f"launcher=[sys.executable, '-c', {STAGE!r}], after=a, lane=l) for n, l, a, sec in {spec!r}]; "
        f"run_steps(steps, Path({str(run)!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    deadline = time.time() + 60
    while time.time() < deadline and set(_running_children(proc.pid)) != {"long_sample", "long_train"}:
        time.sleep(0.1)
    children = _running_children(proc.pid)
    assert set(children) == {"long_sample", "long_train"}, "both sides should be running"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for pid in children.values():  # both stages die with their parent
        _wait_gone(pid)
    assert (tmp_path / "done" / "manifest.json").exists() and not (tmp_path / "last").exists()

    quick = [Step(n, "generate", [str(tmp_path / n), "0", "0"], tmp_path / n, launcher=[sys.executable, "-c", STAGE],
                  after=a, lane=l) for n, l, a, _ in spec]
    assert sorted(run_steps(quick, run)) == ["last", "long_sample", "long_train"]  # "done" is not redone


def _running_children(pid: int) -> dict[str, int]:
    """The stand-in stages ``pid`` runs, not yet exited: their step name (the output's) -> their pid."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    running = {}
    for child in map(int, out.split()):
        try:
            status = Path(f"/proc/{child}/status").read_text()
            args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[:-1]
        except FileNotFoundError:
            continue
        if "\nState:\tZ" not in status and len(args) >= 3:
            running[Path(args[-3].decode()).name] = child
    return running


def _wait_gone(pid: int, seconds: float = 10.0) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return
        if "\nState:\tZ" in state:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"stage {pid} outlived the killed run")


# ---------------------------------------------------------------------------------------------- the report


def _steps_log(run: Path, records: list[tuple[str, str, float, float, int]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "steps.jsonl").write_text("".join(
        json.dumps({"step": s, "command": ["x"], "rc": rc, "seconds": e - b, "started": 1000 + b, "ended": 1000 + e,
                    "lane": lane}) + "\n" for s, lane, b, e, rc in records))


def test_report_draws_the_schedule_of_a_run_beside_another(tmp_path):
    pytest.importorskip("matplotlib")
    from rlhf_pipeline.stages.report import read_schedule, write_report

    overlapped, sequential = tmp_path / "overlapped", tmp_path / "sequential"
    _steps_log(overlapped, [("iter_1/generate", "sample", 0, 10, 0), ("iter_1/train", "train", 10, 30, 0),
                            ("iter_2/generate", "sample", 10, 20, 0), ("iter_2/train", "train", 30, 50, 0)])
    _steps_log(sequential, [("iter_1/generate", "main", 0, 10, 0), ("iter_1/train", "main", 10, 30, 0),
                            ("iter_2/generate", "main", 30, 40, 0), ("iter_2/train", "main", 40, 60, 1)])
    (sequential / "iter_1" / "generate").mkdir(parents=True)
    (sequential / "iter_1" / "generate" / "manifest.json").write_text(json.dumps({"wall_time_s": 10.0}))
    assert [r["step"] for r in read_schedule(overlapped)] == ["iter_1/generate", "iter_1/train",
                                                                    "iter_2/generate", "iter_2/train"]
    report = write_report(sequential, tmp_path / "out", compare=overlapped)
    assert (tmp_path / "out" / "plots" / "schedule.png").stat().st_size > 0
    assert "plots/schedule.png" in report.read_text()
    with pytest.raises(PipelineError, match="--compare .*: no steps.jsonl"):
        write_report(sequential, tmp_path / "out", compare=tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------- end to end

DEMO_SMALL = ["--iterations", "2", "--prompts-per-iteration", "48", "--n", "2", "--max-new-tokens", "12",
              "--eval-prompts", "16", "--eval-n", "1", "--sft-epochs", "1", "--rm-epochs", "1", "--hidden-size", "32"]


@pytest.mark.slow
def test_overlapped_demo_runs_every_stage_with_the_stale_sampler_named(tmp_path):
    run = tmp_path / "demo"
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "rlhf_pipeline.stages.demo", "--output", str(run), "--overlap", "1",
                           *DEMO_SMALL], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = log(run)
    assert all(r["rc"] == 0 for r in records.values())
    for t in (1, 2):
        for stage in ("generate", "score", "filter", "train", "eval"):
            assert (run / f"iter_{t}" / stage / "manifest.json").exists(), (t, stage)
    manifest = lambda t, stage: json.loads((run / f"iter_{t}" / stage / "manifest.json").read_text())  # noqa: E731
    # iteration 2 was sampled by the SFT policy (one behind) while iteration 1 trained it
    assert manifest(2, "generate")["config"]["model"] == str(run / "sft")
    assert manifest(2, "train")["config"]["model"] == str(run / "iter_1" / "train")
    assert manifest(2, "train")["config"]["ref_model"] == str(run / "sft")  # REBEL's reference: the sampler
    # the train manifest names its sampler and whether it is the policy trained: not in an overlapped iteration 2
    assert manifest(1, "train")["training"]["sampler"] == {"model": str(run / "sft"), "is_trained_policy": True}
    assert manifest(2, "train")["training"]["sampler"] == {"model": str(run / "sft"), "is_trained_policy": False}
    gen2, train1 = records["iter_2/generate"], records["iter_1/train"]
    assert gen2["started"] < train1["ended"] and train1["started"] < gen2["ended"], "the two sides did not overlap"
    assert (run / "plots" / "schedule.png").exists()


@pytest.mark.slow
def test_the_sampling_side_samples_on_a_ray_replica_pool(tiny_policy, bundled_prompts, tmp_path):
    """The sampling side on a Ray cluster that runs apart from the run (here one this test starts, which the
    stages join as drivers through its address), the training side on the machine's own cores: every generate
    samples on 2 replicas of the pool while the other side trains."""
    ray = pytest.importorskip("ray")
    from conftest import LENGTH_REWARD

    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        address = context.address_info["gcs_address"]
        run = tmp_path / "run"
        spec = {"model": str(tiny_policy), "prompts": str(bundled_prompts), "reward_fn": f"{reward}:reward",
                "iterations": 2, "prompts_per_iteration": 8, "overlap": 1,
                "lane_env": {"train": {"OMP_NUM_THREADS": 1}},
                "generate": {"n": 2, "max_new_tokens": 8, "engine": "hf", "executor": "ray", "ray_address": address,
                             "replicas": 2},
                "filter": {"test_size": 2}, "train": {"max_steps": 2, "batch_size": 2, "report_to": "none"}}
        (tmp_path / "run.yaml").write_text(json.dumps(spec))
        env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        proc = subprocess.run([sys.executable, "-m", "rlhf_pipeline.stages.iterate", "--config",
                               str(tmp_path / "run.yaml"), "--output", str(run)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        ray.shutdown()
    for t in (1, 2):
        gen = json.loads((run / f"iter_{t}" / "generate" / "manifest.json").read_text())["config"]
        assert (gen["executor"], gen["ray_address"], gen["replicas"]) == ("ray", address, 2)
        train = json.loads((run / f"iter_{t}" / "train" / "manifest.json").read_text())
        assert train["training"]["sampler"] == {"model": str(tiny_policy), "is_trained_policy": t == 1}
    records = log(run)
    gen2, train1 = records["iter_2/generate"], records["iter_1/train"]
    assert gen2["lane"] == "sample" and train1["lane"] == "train"
    assert gen2["started"] < train1["ended"] and train1["started"] < gen2["ended"], "the two sides did not overlap"


def test_bench_pins_each_side_and_reads_seconds_per_iteration(tmp_path, monkeypatch):
    from rlhf_pipeline.bench import overlap as bench

    monkeypatch.setattr(bench, "usable_cores", lambda: [4, 7])  # the cores this process may use, not 0 and 1
    monkeypatch.setattr(bench.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(bench, "vllm_python", lambda: "/envs/vllm/bin/python")
    overlapped = bench.run_config(tmp_path, "o", overlap=True, quick=True)
    sequential = bench.run_config(tmp_path, "s", overlap=False, quick=True)
    assert overlapped["launchers"]["generate"] == "taskset -c 4 /envs/vllm/bin/python"
    assert overlapped["launchers"]["train"].startswith("taskset -c 7 ")
    assert overlapped["lane_env"]["train"] == {"OMP_NUM_THREADS": 1} and overlapped["overlap"] == 1
    assert sequential["launchers"]["generate"] == "/envs/vllm/bin/python" and "lane_env" not in sequential
    assert sequential["generate"]["engine"] == "vllm"
    IterateConfig(**{k: v for k, v in overlapped.items()})  # a config rlhf iterate takes
    _steps_log(tmp_path / "r", [("iter_1/generate", "sample", 0, 10, 0), ("iter_1/train", "train", 10, 30, 0),
                                ("iter_2/generate", "sample", 10, 20, 0), ("iter_2/train", "train", 30, 50, 0),
                                ("iter_3/generate", "sample", 30, 40, 0), ("iter_3/train", "train", 50, 60, 0)])
    result = bench.per_iteration(tmp_path / "r")
    # iterations end at 30, 50 and 60: 15 s an iteration once under way, 60 s over 3 over the whole run
    assert result["seconds_per_iteration"] == pytest.approx((60 - 30) / 2)
    assert result["whole_run_seconds_per_iteration"] == pytest.approx(60 / 3)
    assert result["stage_seconds"] == {"generate": 30.0, "train": 50.0}
    assert result["phase_seconds_per_iteration"] == {"sampling": 10.0, "training": round(50 / 3, 2)}


# ---------------------------------------------------------------------------------------------- the GPU node model


def test_node_model_by_hand():
    from rlhf_pipeline.bench.overlap import (Phase, best_split, cluster_table, overlapped_seconds, sequential_seconds,
                                             whole_run, with_generation, with_pool)

    sampling, training = [Phase("generate", 10.0, 80.0)], [Phase("train", 20.0, 40.0)]
    assert sequential_seconds(sampling, training, 8) == 10 + 80 / 8 + 20 + 40 / 8 == 45.0
    assert overlapped_seconds(sampling, training, 4, 4) == max(10 + 20, 20 + 10) == 30.0
    assert overlapped_seconds(sampling, training, 5, 3) == pytest.approx(max(10 + 16, 20 + 40 / 3))
    assert best_split(sampling, training, 8) == (4, 30.0)  # 3/5: 36.7, 5/3: 33.3
    assert best_split(sampling, training, 8, min_train_gpus=5) == (3, pytest.approx(10 + 80 / 3))
    with pytest.raises(ValueError, match="leave none to sample on"):
        best_split(sampling, training, 2, min_train_gpus=2)
    # 3 iterations: the first sampling (30) alone, 2 iterations of the longer side (30), the last training (30)
    assert whole_run(30.0, 30.0, 3) == 120.0 and whole_run(10.0, 30.0, 3) == 10 + 2 * 30 + 30
    # generation twice as fast, then a quarter of its time on 8 GPUs (10 + 5 = 15) made fixed
    (fast,) = with_generation(sampling, 2.0, gpus=8)
    assert (fast.fixed, fast.work) == (10.0, 40.0)
    (tailed,) = with_generation(sampling, 1.0, 0.25, gpus=8)
    assert (tailed.fixed, tailed.work, tailed.seconds(8)) == (12.5, 60.0, 20.0)
    # a pool of 8 that only generates: sequential generates on 16 then scores and trains on 8; overlapped, the
    # pool generates while the 8 train and score (scoring's GPU work is theirs)
    scoring = [Phase("generate", 10.0, 80.0), Phase("score", 2.0, 16.0)]
    assert with_pool(scoring, training, 8, 8) == (10 + 5 + 2 + 2 + 20 + 5, 10 + 10 + 2 + 2, 20 + 5 + 2)
    # without fixed parts, splitting a node cannot beat running each phase on all of it (the work is conserved)
    linear = [Phase("generate", 0.0, 80.0)], [Phase("train", 0.0, 40.0)]
    assert best_split(*linear, 8)[1] >= sequential_seconds(*linear, 8)
    table = cluster_table([Phase("generate", 0.0, 4800.0)], [Phase("train", 0.0, 4800.0)], 8, 1, 3)
    # sequential 20 min; 4/4: 20 min each side (+1 for loading the reference): 21 min, 20/21 = 0.95, over 3
    # iterations 60 / (20 + 2 x 21 + 21) = 0.72
    assert "| as estimated (4,000 tokens/s a GPU) | 20 | 21 (0.95; 0.72) |" in table, table


@pytest.mark.parametrize("lane_env, shared", [
    ({}, True),
    ({"sample": {"CUDA_VISIBLE_DEVICES": "0,1"}}, True),  # the training side sees every GPU
    ({"sample": {"CUDA_VISIBLE_DEVICES": "0,1"}, "train": {"CUDA_VISIBLE_DEVICES": "1,2"}}, True),
    ({"sample": {"CUDA_VISIBLE_DEVICES": "0,1"}, "train": {"CUDA_VISIBLE_DEVICES": "2, 3"}}, False),
    ({"sample": {"CUDA_VISIBLE_DEVICES": ""}}, False),  # a sampling side on a Ray pool, scoring on the CPU
])
def test_sides_that_share_gpus_are_warned_about(tmp_path, monkeypatch, caplog, lane_env, shared):
    monkeypatch.setattr(iterate, "gpus_visible", lambda: True)
    with caplog.at_level("WARNING", logger=iterate.__name__):
        plan(config(tmp_path, lane_env=lane_env), 24)
    assert ("see the same GPUs" in caplog.text) == shared
    monkeypatch.setattr(iterate, "gpus_visible", lambda: False)  # a CPU machine: nothing to say
    caplog.clear()
    with caplog.at_level("WARNING", logger=iterate.__name__):
        plan(config(tmp_path, lane_env=lane_env), 24)
    assert "see the same GPUs" not in caplog.text
