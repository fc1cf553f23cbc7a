"""rlhf iterate and rlhf demo: the plan of stage runs, option checks before launch, and resume after Ctrl-C."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.stages.iterate import IterateConfig, check, option_args, plan


def config(tmp_path, **overrides) -> IterateConfig:
    values = dict(output=str(tmp_path / "run"), model="base", prompts=str(tmp_path / "p.jsonl"), iterations=3,
                  reward_model="rm")
    values.update(overrides)
    return IterateConfig(**values)


def test_option_args_spell_flags_as_the_stages_parse_them():
    assert option_args({"max_new_tokens": 64, "bf16": True, "drop_truncated": False, "top_k": None,
                        "inputs": ["a", "b"], "eta": 1e6}) == [
        "--max-new-tokens", "64", "--bf16", "--no-drop-truncated", "--inputs", "a", "b", "--eta", "1000000.0"]


def test_a_chunk_of_prompts_past_the_last_row_goes_on_from_the_first(tmp_path):
    """prompts_per_iteration's chunks wrap (generate --wrap): the one that runs past the last prompt was cut short,
    and the rows it left out were then used once less than the others."""
    from conftest import write_jsonl
    from rlhf_pipeline.datasets_io import parse_ref
    from rlhf_pipeline.stages.generate import select_prompts

    ref = parse_ref(write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Prompt {i}."} for i in range(5)]))
    assert list(select_prompts(ref, 3, 4)[2]) == [3, 4]
    ds, _, rows, total = select_prompts(ref, 3, 4, wrap=True)
    assert rows == [3, 4, 0, 1] and total == 5 and ds["prompt"] == ["Prompt 3.", "Prompt 4.", "Prompt 0.", "Prompt 1."]
    ds, _, rows, _ = select_prompts(ref, 3, 10, wrap=True)
    assert rows == [3, 4, 0, 1, 2]  # every row once at most
    assert ds["prompt"] == [f"Prompt {i}." for i in rows]  # in that order, as their seeds and the manifest say


def test_a_finished_eval_with_reference_answers_is_found_finished(tmp_path):
    """iterate checks a step as the stage would: rlhf eval records its prompts and its --reference answers as inputs,
    and iterate compared the prompts alone, so a second run stopped at the first evaluation ("the input data
    changed")."""
    from conftest import write_jsonl
    from rlhf_pipeline.datasets_io import StageOutput, parse_ref
    from rlhf_pipeline.stages.iterate import _stage_config, is_complete

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi."}, {"prompt": "Yo."}])
    answers = write_jsonl(tmp_path / "answers.jsonl", [{"prompt": "Hi.", "response": "a"},
                                                       {"prompt": "Yo.", "response": "b"}])
    step = plan(config(tmp_path, iterations=1, eval_prompts=prompts, eval={"reference": answers}))[0]
    assert step.name == "iter_0/eval"
    stage_config = _stage_config(step)
    out = StageOutput("eval", stage_config, inputs=[parse_ref(prompts), parse_ref(answers)])  # as rlhf eval records
    out.path.mkdir(parents=True)
    out.write_manifest(out.manifest(rows_in=2, rows_out=2))
    assert is_complete(step)


def test_an_eval_section_without_eval_prompts_is_said_to_be_unused(tmp_path, caplog):
    """A recipe may carry its eval section for when eval_prompts is set (scripts/gpu/rebel_ultrafeedback.yaml):
    without them it runs nothing, which is said rather than left to be found out."""
    with caplog.at_level("WARNING", logger="rlhf_pipeline.stages.iterate"):
        steps = plan(config(tmp_path, eval={"n": 2}))
    assert not [s for s in steps if s.stage == "eval"]
    assert [r.getMessage() for r in caplog.records] == [
        "the eval section and launchers.eval are not used: every iteration's rlhf eval runs only with eval_prompts"]


def test_a_launcher_is_a_command_line_or_a_list_of_words(tmp_path):
    """A YAML list is a natural way to write a command: it is taken word for word (a string is split as a shell
    would), and ``seed: null`` takes the seed away (0), as null does to every option."""
    steps = plan(config(tmp_path, launchers={"train": ["accelerate", "launch", "--config_file", "my cfg.yaml"],
                                             "score": "accelerate launch --config_file 'my cfg.yaml'"},
                        generate={"seed": None}))
    train, score, generate = (next(s for s in steps if s.stage == stage) for stage in ("train", "score", "generate"))
    assert train.launcher == score.launcher == ["accelerate", "launch", "--config_file", "my cfg.yaml"]
    assert generate.args[generate.args.index("--seed") + 1] == "0"


def test_plan_chains_policies_prompts_and_seeds(tmp_path):
    steps = plan(config(tmp_path, prompts_per_iteration=300, eval_prompts="e.jsonl", generate={"seed": 5, "n": 2},
                        launchers={"train": "accelerate launch --config_file z.yaml"}), num_prompts=640)
    names = [s.name for s in steps]
    assert names == ["iter_0/eval"] + [f"iter_{t}/{s}" for t in (1, 2, 3)
                                       for s in ("generate", "score", "filter", "train", "eval")]
    run = tmp_path / "run"
    by_name = {s.name: s for s in steps}

    def arg(step, flag):
        args = by_name[step].args
        return args[args.index(flag) + 1]

    # iteration t samples with policy t-1, and trains policy t from it
    assert arg("iter_1/generate", "--model") == "base"
    assert arg("iter_2/generate", "--model") == str(run / "iter_1" / "train")
    assert arg("iter_3/train", "--model") == str(run / "iter_2" / "train")
    assert arg("iter_3/filter", "--tokenizer") == str(run / "iter_2" / "train")
    # consecutive chunks of 300 prompts, wrapping around 640; seeds differ per iteration
    assert [arg(f"iter_{t}/generate", "--offset") for t in (1, 2, 3)] == ["0", "300", "600"]
    assert ["--wrap" in by_name[f"iter_{t}/generate"].args for t in (1, 2, 3)] == [False, False, True]  # 600..259
    assert [arg(f"iter_{t}/generate", "--seed") for t in (1, 2, 3)] == ["5", "6", "7"]
    # evaluation against the starting policy's samples; iteration 0 against itself
    assert arg("iter_0/eval", "--baseline") == "base"
    assert arg("iter_2/eval", "--baseline") == str(run / "iter_0" / "eval")
    assert arg("iter_2/eval", "--reward-model") == "rm"
    # training always resumes; launchers are command prefixes
    assert "--resume" in by_name["iter_1/train"].args
    assert by_name["iter_1/train"].command[:5] == ["accelerate", "launch", "--config_file", "z.yaml", "-m"]
    assert by_name["iter_1/generate"].command[:3] == [sys.executable, "-m", "rlhf_pipeline.stages.generate"]


def test_lora_options_reach_every_iterations_training(tmp_path):
    """iterate passes the train section's LoRA options through, and they parse as rlhf train's own."""
    from rlhf_pipeline.stages.iterate import _stage_config

    steps = plan(config(tmp_path, iterations=2, train={"lora_rank": 16, "lora_target_modules": ["q_proj", "v_proj"]}))
    trains = [s for s in steps if s.stage == "train"]
    assert len(trains) == 2
    for step in trains:
        parsed = _stage_config(step)
        assert parsed.lora_rank == 16 and parsed.lora_target_modules == ["q_proj", "v_proj"]
        assert parsed.lora_scale == 2.0  # alpha defaults to twice the rank


def test_a_run_pushes_every_stage_to_one_private_repo_a_configuration_each(tmp_path):
    from rlhf_pipeline.stages.iterate import _stage_config

    steps = plan(config(tmp_path, iterations=2, push_to_hub="me/run", private=True, eval_prompts="e.jsonl"))
    places = []
    for step in steps:
        parsed = _stage_config(step)
        assert (parsed.push_to_hub, parsed.private) == ("me/run", True), step.name
        places.append(parsed.hub_config)
    assert places == ["iter0-eval"] + [f"iter{t}-{s}" for t in (1, 2)
                                       for s in ("generate", "score", "filter", "train", "eval")]
    assert not any("--private" in s.args for s in plan(config(tmp_path, iterations=1, push_to_hub="me/run")))


@pytest.mark.parametrize("options,message", [
    ({"resume": True}, "resume takes finished stages from push_to_hub's repos: set push_to_hub too"),
    ({"private": True}, "private: set push_to_hub too"),
    ({"push_to_hub": "me/run", "hub_config": "x"}, "hub_config x: rlhf iterate names each stage's place"),
])
def test_the_runs_hub_options_are_checked(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **options)


def test_a_stage_another_run_directory_pushed_counts_as_finished_in_this_one(tmp_path, monkeypatch):
    """--resume on another machine: iteration 2's generate, pushed from a run directory elsewhere (its --model is
    that run's iteration-1 policy), matches this run's plan once the paths into the run are moved; another setting
    does not match."""
    import fake_hub
    import huggingface_hub

    from conftest import write_jsonl
    from rlhf_pipeline.stages.iterate import _stage_config, _stage_output, on_the_hub

    fake_hub.install(monkeypatch.setattr, tmp_path / "hub")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])

    def generate_2(run, **options):
        steps = plan(config(tmp_path, output=str(run), prompts=prompts, iterations=2, push_to_hub="me/run",
                            resume=True, generate=options))
        return next(s for s in steps if s.name == "iter_2/generate")

    pushed = generate_2(tmp_path / "there")
    manifest = _stage_output(pushed, _stage_config(pushed), {}).manifest(rows_in=1, rows_out=2)
    huggingface_hub.HfApi().upload_file(path_or_fileobj=json.dumps(manifest).encode(), repo_id="me/run",
                                        path_in_repo="manifests/iter2-generate.json", repo_type="dataset")
    found = on_the_hub(generate_2(tmp_path / "here"), {})
    assert found is not None and found.manifest["output_id"] == manifest["output_id"]
    assert found.manifest["config"]["model"] == str(tmp_path / "here" / "iter_1" / "train")
    assert on_the_hub(generate_2(tmp_path / "here", temperature=0.5), {}) is None
    assert on_the_hub(generate_2(tmp_path / "there"), {}) is not None  # the directory it was pushed from


def test_sections_may_not_set_what_iterate_sets(tmp_path):
    with pytest.raises(PipelineError, match="train section sets model"):
        plan(config(tmp_path, train={"model": "other"}))


def test_a_misspelt_option_fails_before_anything_runs(tmp_path):
    steps = plan(config(tmp_path, train={"learning_rat": 1e-6}))
    with pytest.raises(PipelineError, match=r"iter_1/train: .*unrecognized arguments: --learning-rat 1e-06; did you mean --learning-rate\?"):
        check(steps)
    assert not (tmp_path / "run").exists()


# A launcher that, like `accelerate launch` of one process or `conda run`, runs the stage as a child of its own and
# dies of SIGTERM without passing it on; the "stage" writes its pid and sleeps.
LAUNCHER = ("import subprocess, sys\n"
            "stage = 'import os, sys, time; open(sys.argv[1], \"w\").write(str(os.getpid())); time.sleep(300)'\n"
            "sys.exit(subprocess.call([sys.executable, '-c', stage, sys.argv[-1]]))\n")
RUN_ONE_STEP = ("import sys\n"
                "from pathlib import Path\n"
                "from rlhf_pipeline.stages.iterate import Step, run_steps\n"
                "run, launcher, pid_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]\n"
                "run_steps([Step('iter_1/generate', 'generate', [pid_file], run / 'iter_1' / 'generate',\n"
                "                launcher=[sys.executable, launcher])], run)\n")
# The same, with SIGTERM arriving just as the step's process has started (before iterate records it as running):
# iterate's Popen sends it, once it has written the launcher's pid and the launcher has started the stage (so that
# the test knows a stage is there to be stopped, rather than finding out only sometimes).
SIGNALLED_AT_START = ("import os, signal, subprocess, sys, time\n"
                      "import rlhf_pipeline.stages.iterate as iterate\n"
                      "class Popen(subprocess.Popen):\n"
                      "    def __init__(self, *args, **kwargs):\n"
                      "        super().__init__(*args, **kwargs)\n"
                      "        open(sys.argv[3] + '.launcher', 'w').write(str(self.pid))\n"
                      "        deadline = time.time() + 60\n"
                      "        while time.time() < deadline and not (os.path.exists(sys.argv[3])\n"
                      "                                              and open(sys.argv[3]).read()):\n"
                      "            time.sleep(0.01)\n"
                      "        os.kill(os.getpid(), signal.SIGTERM)\n"
                      "iterate.subprocess.Popen = Popen\n") + RUN_ONE_STEP


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_to_iterate_alone_stops_every_process_of_the_running_stage(tmp_path, sig):
    """A scheduler or a container's stop sends SIGTERM to rlhf iterate alone (a closed terminal, SIGHUP). The stage
    under a launcher that does not pass it on went on running (vLLM holding its GPUs beside the rerun); now iterate
    passes it to every process of the stage, waits for them, and says how to resume."""
    launcher, pid_file = tmp_path / "launcher.py", tmp_path / "stage.pid"
    launcher.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, "-c", RUN_ONE_STEP, str(tmp_path / "run"), str(launcher), str(pid_file)],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stage_pid = None
    try:
        deadline = time.time() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        stage_pid = int(pid_file.read_text())
        proc.send_signal(sig)  # to iterate's process alone, not its group
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert f"stopped by {sig.name} during iter_1/generate; run the same command again" in output, output
        assert not _alive(stage_pid), "the stage under the launcher outlived rlhf iterate"
        record = json.loads((tmp_path / "run" / "steps.jsonl").read_text())
        assert record["step"] == "iter_1/generate" and record["rc"] == "interrupted"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if stage_pid is not None and _alive(stage_pid):
            os.kill(stage_pid, signal.SIGKILL)


def test_a_stop_signal_as_a_step_starts_stops_it_too(tmp_path):
    """SIGTERM between starting a step's process and recording it as running waits until it is recorded, then
    stops it: it was taken for the step failing to start, and iterate waited for the stage to finish."""
    launcher, pid_file = tmp_path / "launcher.py", tmp_path / "stage.pid"
    launcher.write_text(LAUNCHER)
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", SIGNALLED_AT_START, str(tmp_path / "run"), str(launcher),
                           str(pid_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode != 0 and time.time() - started < 60  # not the stage's 300 s
    assert "stopped by SIGTERM during iter_1/generate; run the same command again" in proc.stdout, proc.stdout
    assert not _alive(int(Path(f"{pid_file}.launcher").read_text()))
    assert not _alive(int(pid_file.read_text())), "the stage under the launcher outlived rlhf iterate"
    assert json.loads((tmp_path / "run" / "steps.jsonl").read_text())["rc"] == "interrupted"


def test_a_closed_terminal_stops_the_running_stage(tmp_path):
    """A closed terminal sends SIGHUP, and writing to it then fails: iterate stopped nothing when its message about
    stopping could not be written. The stage is stopped and recorded as interrupted all the same."""
    import pty

    launcher, pid_file = tmp_path / "launcher.py", tmp_path / "stage.pid"
    launcher.write_text(LAUNCHER)
    terminal, side = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", RUN_ONE_STEP, str(tmp_path / "run"), str(launcher), str(pid_file)],
                            start_new_session=True, stdout=side, stderr=side)
    os.close(side)
    stage_pid = None
    try:
        deadline = time.time() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        stage_pid = int(pid_file.read_text())
        os.close(terminal)  # the terminal goes away
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) != 0
        assert not _alive(stage_pid), "the stage outlived rlhf iterate"
        assert json.loads((tmp_path / "run" / "steps.jsonl").read_text())["rc"] == "interrupted"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if stage_pid is not None and _alive(stage_pid):
            os.kill(stage_pid, signal.SIGKILL)


# Each script below takes SIGINT as Python does by default: started from a shell's background job (as a test may be),
# Python leaves SIGINT ignored.
SIGINT_DEFAULT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
# A stage that, as every stage does in run_stage, dies with the rlhf iterate that launched it; on SIGINT it takes
# CLEANUP seconds, then marks that it finished cleaning up.
STAGE_DYING_WITH_THE_RUN = SIGINT_DEFAULT + (
    "import os, sys, time\n"
    "from rlhf_pipeline.machine import die_with_the_run\n"
    "die_with_the_run()\n"
    "try:  # the pid is written inside: the test sends SIGINT once it is there\n"
    "    open(sys.argv[-1], 'w').write(str(os.getpid()))\n"
    "    time.sleep(300)\n"
    "except KeyboardInterrupt:\n"
    "    time.sleep(float(os.environ.get('CLEANUP', '0')))\n"
    "    open(sys.argv[-1] + '.cleaned', 'w').close()\n")
# A launcher that passes nothing on and exits at once on SIGINT or SIGTERM (as accelerate launch of one process).
PLAIN_LAUNCHER = SIGINT_DEFAULT + (
    "import subprocess, sys\n"
    "stage = subprocess.Popen([sys.executable, *sys.argv[1:]])\n"
    "try:\n"
    "    sys.exit(stage.wait())\n"
    "except KeyboardInterrupt:\n"
    "    sys.exit(130)\n")
RUN_STAGE_FILE = SIGINT_DEFAULT + (
    "import os, sys\n"
    "from pathlib import Path\n"
    "import rlhf_pipeline.stages.iterate as iterate\n"
    "iterate.STOP_GRACE_SECONDS = float(os.environ.get('GRACE', '3'))\n"
    "run, launcher, stage, pid_file = Path(sys.argv[1]), *sys.argv[2:5]\n"
    "step = iterate.Step('iter_1/train', 'train', [pid_file], run / 'iter_1' / 'train',\n"
    "                    launcher=[sys.executable, launcher, stage])\n"
    "try:\n"
    "    iterate.run_steps([step], run)\n"
    "except iterate.RunStopped as e:\n"
    "    print(e, flush=True)\n"
    "    sys.exit(e.exit_status)\n")


def _start_run(tmp_path: Path, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """rlhf iterate's run_steps with one step, a stage under a plain launcher, in a session of its own; returns the
    process and the stage's pid file once the stage has written it. The output goes to a file (``_output``), not a
    pipe: waiting for the end of a pipe would wait for every process holding it, the stage included."""
    launcher, stage, pid_file = tmp_path / "launcher.py", tmp_path / "stage.py", tmp_path / "stage.pid"
    launcher.write_text(PLAIN_LAUNCHER)
    stage.write_text(STAGE_DYING_WITH_THE_RUN)
    with open(tmp_path / "output.txt", "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", RUN_STAGE_FILE, str(tmp_path / "run"), str(launcher),
                                 str(stage), str(pid_file)], start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **(env or {})))
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert proc.poll() is None and time.time() < deadline, _output(tmp_path)
        time.sleep(0.1)
    return proc, pid_file


def _output(tmp_path: Path) -> str:
    return (tmp_path / "output.txt").read_text()


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")
def test_a_killed_iterate_takes_the_stage_under_its_launcher_with_it(tmp_path):
    """SIGKILL to iterate runs none of its code: the launcher, its child, dies of the parent-death signal iterate set,
    and the stage under the launcher, which passes nothing on, of the one it set itself (run_stage does) from the
    RLHF_ITERATE_PID iterate gave it."""
    proc, pid_file = _start_run(tmp_path)
    stage_pid = int(pid_file.read_text())
    try:
        proc.kill()
        proc.wait()
        assert _gone_within(stage_pid, 20), "the stage under the launcher outlived the killed rlhf iterate"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_waits_for_a_stage_still_cleaning_up_after_its_launcher_exited(tmp_path):
    """Ctrl-C from a terminal reaches every process: the launcher exits at once, and iterate waited for the launcher
    alone, so a rerun could start beside the stage still cleaning up. Iterate now adopts the stage when its launcher
    exits and waits for it (the stage watches iterate, not its launcher, so it is not cut short either), and exits
    with 130 as an interrupted process does."""
    proc, pid_file = _start_run(tmp_path, env={"CLEANUP": "2", "GRACE": "120"})
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        output = _output(tmp_path)
        assert (Path(f"{pid_file}.cleaned")).exists(), output  # iterate returned after the stage had cleaned up
        assert proc.returncode == 130 and "interrupted during iter_1/train; run the same command again" in output
        assert "still running" not in output, output
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigint_to_iterate_alone_stops_the_stage_after_the_grace(tmp_path):
    """``kill -INT`` or a notebook's interrupt reaches iterate alone: it waited for the stage to finish by itself
    (hours, for a training run). Now what still runs after the grace is stopped as SIGTERM stops it."""
    proc, pid_file = _start_run(tmp_path)
    stage_pid = int(pid_file.read_text())
    try:
        started = time.time()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        output = _output(tmp_path)
        assert proc.returncode == 130 and time.time() - started < 30, output
        assert "iter_1/train still running 3 s after the interrupt: stopping it" in output, output
        assert not _alive(stage_pid)
        assert json.loads((tmp_path / "run" / "steps.jsonl").read_text())["rc"] == "interrupted"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_second_ctrl_c_stops_the_wait_and_still_records_the_stage_as_interrupted(tmp_path):
    """The second Ctrl-C ends iterate's wait for its stages at once (they die with it); it left steps.jsonl without
    the running step's "interrupted" record, which the first one writes."""
    proc, pid_file = _start_run(tmp_path, env={"CLEANUP": "120", "GRACE": "120"})
    stage_pid = int(pid_file.read_text())
    try:
        os.killpg(proc.pid, signal.SIGINT)  # the stage starts its 120 s clean-up, iterate its 120 s wait
        deadline = time.time() + 60  # once iterate says it waits: an arbitrary sleep here raced the signals
        while "Ctrl-C again to stop at once" not in _output(tmp_path) and time.time() < deadline:
            time.sleep(0.01)
        started = time.time()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        output = _output(tmp_path)
        assert proc.returncode == 130 and time.time() - started < 30, output
        assert "interrupted during iter_1/train; run the same command again" in output, output
        record = json.loads((tmp_path / "run" / "steps.jsonl").read_text())
        assert record["step"] == "iter_1/train" and record["rc"] == "interrupted"
        assert _gone_within(stage_pid, 20), "the stage outlived rlhf iterate"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and pidfd_open are Linux's")
def test_a_stage_watches_only_an_iterate_of_its_own_machine_and_namespace(tmp_path):
    """RLHF_ITERATE_PID names where iterate runs: a launcher that carries the environment to another node (srun)
    must not make the stage there stop itself because no process has that pid on its node; on iterate's own machine
    an iterate already gone stops the stage at once."""
    from rlhf_pipeline.machine import run_identity

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no process has now
    here, started, me = run_identity().rsplit(":", 2)
    stage = "from rlhf_pipeline.machine import die_with_the_run; die_with_the_run(); print('ran')"
    for value, survives in ((f"another-boot:1:{started}:{gone.pid}", True),  # srun's node
                            (f"{here}:{started}:{gone.pid}", False),  # ended
                            (f"{here}:{int(started) + 1}:{me}", False),  # its pid now another process's
                            (f"{here}:{started}:{me}", True), ("12", True)):
        done = subprocess.run([sys.executable, "-c", stage], env=dict(os.environ, RLHF_ITERATE_PID=value),
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout.strip()) == ((0, "ran") if survives else (-signal.SIGTERM, "")), value


@pytest.mark.skipif(sys.platform != "linux", reason="a child subreaper is Linux's prctl")
def test_processes_adopted_during_a_run_are_collected_when_they_end(tmp_path):
    """A stage's helper that outlives it (its multiprocessing resource tracker) is adopted by iterate, and ended it
    would stay a zombie until the run ends, hundreds of steps later: collected after each step instead."""
    import psutil

    from rlhf_pipeline.machine import adopt_orphans
    from rlhf_pipeline.stages.iterate import _reap_adopted

    me = psutil.Process()
    before = frozenset(c.pid for c in me.children())
    orphan_pid, leaver = tmp_path / "orphan.pid", tmp_path / "leaver.py"
    leaver.write_text("import os, subprocess, sys\n"  # leaves a child that ends once its parent has
                      "waits = 'import os, sys, time\\nwhile os.getppid() == int(sys.argv[1]): time.sleep(0.01)'\n"
                      "child = subprocess.Popen([sys.executable, '-c', waits, str(os.getpid())])\n"
                      "open(sys.argv[1], 'w').write(str(child.pid))\n")
    adopt_orphans(True)
    try:
        subprocess.run([sys.executable, str(leaver), str(orphan_pid)], check=True, timeout=60)
        pid = int(orphan_pid.read_text())
        deadline = time.time() + 30
        while not (psutil.pid_exists(pid) and psutil.Process(pid).status() == psutil.STATUS_ZOMBIE):
            assert time.time() < deadline, "the orphan was not adopted, or did not end"
            time.sleep(0.05)
        assert psutil.Process(pid).ppid() == os.getpid()
        _reap_adopted(before, set())
        assert not psutil.pid_exists(pid)
    finally:
        adopt_orphans(False)


def test_a_second_run_of_the_same_stages_is_refused_while_the_first_runs(tmp_path):
    """Two rlhf iterate on one run (a scheduler's requeue beside the first) would launch the same stages beside
    each other, two writers in one output: the second is refused before it writes anything, iterate.json included."""
    import re

    from rlhf_pipeline.stages.iterate import run_iterations, run_lock, run_steps

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path\n"
                               "from rlhf_pipeline.stages.iterate import run_lock\n"
                               "with run_lock(Path(sys.argv[1]), 'iterate'):\n"
                               "    print('held', flush=True); time.sleep(60)\n", str(run)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = rf"^iterate: another process is running the stages of {re.escape(str(run))} \(pid {holder.pid}\); "
        with pytest.raises(PipelineError, match=refused + "wait for it to finish"):
            run_iterations(config(tmp_path, iterations=1))
        assert not (run / "iterate.json").exists()
        with pytest.raises(PipelineError, match=refused):
            run_steps([], run)
    finally:
        holder.kill()
        holder.wait()
    with run_lock(run, "iterate"):  # free again, and the process that holds it may take it again
        assert run_steps([], run) == []


def test_a_stage_killed_by_a_signal_is_named_as_such(tmp_path):
    """A stage the kernel's out-of-memory killer ends prints nothing: the failure said "its error is above"."""
    from rlhf_pipeline.stages.iterate import Step, run_steps

    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    step = Step("iter_1/train", "train", [], tmp_path / "out", launcher=[sys.executable, "-c", suicide])
    with pytest.raises(PipelineError, match=r"^iter_1/train failed \(killed by SIGKILL, so nothing above says why, "
                                            r"often the kernel's out-of-memory killer \(see dmesg\)\)\. Fix the cause"):
        run_steps([step], tmp_path / "run")


DEMO_SMALL = ["--iterations", "1", "--prompts-per-iteration", "48", "--n", "2", "--max-new-tokens", "12",
              "--eval-prompts", "16", "--eval-n", "1", "--sft-epochs", "1", "--rm-epochs", "1", "--hidden-size", "32"]


def _demo(out: Path) -> subprocess.Popen:
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "rlhf_pipeline.stages.demo", "--output", str(out), *DEMO_SMALL],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _output_ids(run: Path) -> dict[str, str]:
    return {str(p.parent.relative_to(run)): json.loads(p.read_text())["output_id"]
            for p in run.rglob("manifest.json")}


@pytest.mark.slow
def test_demo_interrupted_resumes_without_redoing_finished_stages(tmp_path):
    run = tmp_path / "demo"
    proc = _demo(run)
    deadline = time.time() + 300
    # Ctrl-C (SIGINT to the whole process group, as a terminal sends it) once the first iteration has its samples
    while not (run / "iter_1" / "generate" / "manifest.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "the demo did not reach iter_1/generate"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output
    finished_before = _output_ids(run)
    assert {"sft", "reward_model", "iter_0/eval", "iter_1/generate"} <= set(finished_before)
    launched_before = [json.loads(l)["step"] for l in (run / "steps.jsonl").read_text().splitlines()]

    proc = _demo(run)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    after = _output_ids(run)
    for name, output_id in finished_before.items():  # nothing that had finished was redone
        assert after[name] == output_id, name
    launched_after = [json.loads(l)["step"] for l in (run / "steps.jsonl").read_text().splitlines()]
    relaunched = launched_after[len(launched_before):]
    assert not set(relaunched) & set(finished_before), relaunched
    assert "iter_1/train" in relaunched and "iter_1/eval" in relaunched

    summary = json.loads((run / "summary.json").read_text())
    assert [row["iteration"] for row in summary["iterations"]] == [0, 1]
    assert summary["iterations"][0]["rm_win_rate_vs_base"] == 0.5
    for key in ("gold_reward_mean", "gold_reward_stderr", "rm_reward_mean", "rm_win_rate_vs_base"):
        assert isinstance(summary["iterations"][1][key], float)
    # iteration 1 was evaluated against iteration 0's samples: its gain over them is the gold gain, paired by prompt
    gold_1 = json.loads((run / "iter_1" / "eval" / "results.json").read_text())["scores"]["reward_fn"]
    assert gold_1["gain"] == pytest.approx(summary["gold_gain"], abs=1e-9)
    # (two steps of a 32-wide model may leave every paired difference 0: both evaluations draw the same random
    # numbers for a prompt, and most samples come out the same; the ratio is then undefined)
    paired = gold_1["gain_stderr"]
    assert summary["gold_gain_in_paired_stderr"] == (pytest.approx(gold_1["gain"] / paired) if paired else None)
    assert (run / "report.md").exists() and (run / "plots" / "reward_per_iteration.png").exists()

    # a third run finds everything finished and launches nothing
    proc = _demo(run)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert len((run / "steps.jsonl").read_text().splitlines()) == len(launched_after)
    assert _output_ids(run) == after


def test_ppo_family_plans_groups_a_fixed_reference_and_a_critic_carried_over(tmp_path):
    steps = plan(config(tmp_path, algo="ppo", train={"kl_coef": 0.1}))
    run = tmp_path / "run"
    by_name = {s.name: s for s in steps}

    def arg(step, flag):
        args = by_name[step].args
        return args[args.index(flag) + 1]

    assert all(arg(f"iter_{t}/filter", "--mode") == "groups" for t in (1, 2, 3))
    # the KL reference stays the starting policy; the critic starts from the reward model, then carries over
    assert all(arg(f"iter_{t}/train", "--ref-model") == "base" for t in (1, 2, 3))
    assert arg("iter_1/train", "--critic-model") == "rm"
    assert arg("iter_3/train", "--critic-model") == str(run / "iter_2" / "train" / "critic")
    assert arg("iter_2/train", "--kl-coef") == "0.1"
    check(steps)  # every stage parses its options
    grpo = plan(config(tmp_path, algo="grpo"))
    assert not any("--critic-model" in s.args for s in grpo)
    # with a python reward alone, the critic starts from the policy (a new value head), then carries over
    by_name = {s.name: s for s in plan(config(tmp_path, algo="ppo", reward_model=None, reward_fn="my_rewards:r"))}
    assert arg("iter_1/train", "--critic-model") == "base"
    assert arg("iter_2/train", "--critic-model") == str(run / "iter_1" / "train" / "critic")
    with pytest.raises(PipelineError, match="trains on groups"):
        plan(config(tmp_path, algo="grpo", filter={"mode": "pairs"}))


def test_a_plan_that_cannot_work_fails_before_any_stage_runs(tmp_path, tiny_policy, small_prompts, capsys):
    """iterate checks the plan against what the algorithm's training needs (the registry's declarations) before
    anything runs: GDPO with one reward source fails in seconds with one line, leaving no run directory, instead of
    after iteration 1's generate, score and filter."""
    from conftest import LENGTH_REWARD

    from rlhf_pipeline.stages.iterate import cli

    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    assert cli(["--algo", "gdpo", "--model", tiny_policy, "--prompts", small_prompts, "--reward-fn",
                f"{tmp_path / 'reward.py'}:reward", "--output", str(run)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: run config: --algo gdpo normalises each reward source within its group, and this run scores with "
        "one; give two or more (reward_model and reward_fn, or several reward_fn)"]
    assert not run.exists()


@pytest.mark.parametrize("overrides, message", [
    (dict(algo="gdpo"), "run config: --algo gdpo normalises each reward source within its group"),
    (dict(algo="dpo", filter={"mode": "groups"}), "run config: --algo dpo trains on pairs; remove filter mode 'groups'"),
    (dict(algo="rebel", train={"ref_model": "sft"}), "run config: --algo rebel's reference is the policy that sampled "
     "each iteration's data, which iterate passes itself (as train's --model, or with overlap 1 as its "
     "--ref-model); remove ref_model from the train section"),
    (dict(algo="grpo", generate={"n": 1}), "run config: --algo grpo learns by comparing the responses to a prompt, "
     "and generate samples n=1; give n 2 or more (4 or more for a group baseline)"),
    (dict(algo="dpo", generate={"n": 1}), "run config: --algo dpo learns by comparing"),
])
def test_the_plan_is_checked_against_the_algorithms_declared_needs(tmp_path, overrides, message):
    with pytest.raises(PipelineError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        plan(config(tmp_path, **overrides))


def test_each_problem_of_a_plan_is_a_line_and_the_plans_that_work_pass(tmp_path):
    with pytest.raises(PipelineError) as e:
        plan(config(tmp_path, algo="gdpo", filter={"mode": "pairs"}))
    assert [line.split(";")[0] for line in str(e.value).splitlines()] == [
        "run config: --algo gdpo trains on groups", "run config: --algo gdpo normalises each reward source within "
        "its group, and this run scores with one"]
    # what each algorithm reads is refused by train's own options before anything runs, the critic's included
    for algo, train, flag in [("grpo", {"critic_model": "rm"}, "--critic-model"), ("simpo", {"ref_model": "sft"},
                                                                                   "--ref-model")]:
        with pytest.raises(PipelineError, match=f"iter_1/train: .*{flag} is not read by --algo {algo}"):
            check(plan(config(tmp_path, algo=algo, train=train)))
    # and the plans that work: GDPO with two sources, iterative DPO keeping the SFT model as its reference
    check(plan(config(tmp_path, algo="gdpo", reward_fn="my_rewards:r")))
    check(plan(config(tmp_path, algo="ppo", generate={"n": 1})))  # no group baseline: one response a prompt serves
    dpo = plan(config(tmp_path, algo="dpo", train={"ref_model": "sft"}))
    check(dpo)
    assert all(s.args[s.args.index("--ref-model") + 1] == "sft" for s in dpo if s.stage == "train")


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")
def test_a_stage_does_not_outlive_a_killed_iterate(tmp_path):
    """SIGKILL to iterate (a scheduler's kill) takes its running stage with it: a rerun must not find the old stage
    still writing the output it is about to redo."""
    pidfile = tmp_path / "child.pid"
    child = "import os, sys, time; open(sys.argv[-1], 'w').write(str(os.getpid())); time.sleep(120)"
    parent = (
        "import sys; from pathlib import Path; from rlhf_pipeline.stages.iterate import Step, run_steps; "
        f"run_steps([Step('iter_1/generate', 'generate', [{str(pidfile)!r}], Path({str(tmp_path / 'out')!r}), "
        f"launcher=[sys.executable, '-c', {child!r}])], Path({str(tmp_path / 'run')!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.time() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def alive() -> bool:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False
        return "\nState:\tZ" not in state  # a zombie has exited, only not yet reaped

    deadline = time.time() + 10
    while alive() and time.time() < deadline:
        time.sleep(0.1)
    still = alive()
    if still:
        os.kill(pid, signal.SIGKILL)
    assert not still, "the stage kept running after iterate was killed"


def test_score_and_eval_take_an_accelerate_launcher(tmp_path):
    """Data-parallel scoring: the score and eval steps run under their launchers, the other stages under theirs."""
    launch = "accelerate launch --multi_gpu --num_processes 8"
    steps = plan(config(tmp_path, iterations=1, eval_prompts="e.jsonl",
                        launchers={"score": launch, "eval": launch + " --main_process_port 29600"}))
    by_name = {s.name: s for s in steps}
    assert by_name["iter_1/score"].command[:7] == [
        "accelerate", "launch", "--multi_gpu", "--num_processes", "8", "-m", "rlhf_pipeline.stages.score"]
    assert by_name["iter_1/score"].command[7:9] == ["--input", str(tmp_path / "run" / "iter_1" / "generate")]
    for name in ("iter_0/eval", "iter_1/eval"):
        assert by_name[name].command[:9] == [*launch.split(), "--main_process_port", "29600", "-m",
                                             "rlhf_pipeline.stages.eval"]
    for name in ("iter_1/generate", "iter_1/filter", "iter_1/train"):
        assert by_name[name].command[0] == sys.executable


def test_a_reward_model_and_a_reward_function_are_both_given_to_score(tmp_path):
    """Several reward sources (what GDPO reads): score gets both, and eval scores with both by default."""
    steps = plan(config(tmp_path, iterations=1, algo="gdpo", reward_fn="task.py:brief"))
    score = next(s for s in steps if s.stage == "score")
    assert score.args[score.args.index("--reward-model") + 1] == "rm"
    assert score.args[score.args.index("--reward-fn") + 1] == "task.py:brief"
    with pytest.raises(ValueError, match="give reward_model, reward_fn, or both"):
        config(tmp_path, reward_model=None)


def test_eval_reads_the_score_sections_reference_column_unless_it_sets_its_own(tmp_path):
    """A verifiable reward needs its ground truth column in eval too: the training reward comes with it."""
    fn = "rlhf_pipeline.rewards.verifiable:math_equal"

    def eval_args(**sections):
        steps = plan(config(tmp_path, iterations=1, eval_prompts="e.jsonl", reward_model=None, reward_fn=fn,
                            **sections))
        return next(s for s in steps if s.name == "iter_1/eval").args

    args = eval_args(score={"reference_column": "answer"})
    assert args[args.index("--reference-column") + 1] == "answer"
    args = eval_args(score={"reference_column": "answer"}, eval={"reference_column": "gold"})
    assert args[args.index("--reference-column") + 1] == "gold" and args.count("--reference-column") == 1
    assert "--reference-column" not in eval_args()


def test_eval_reports_the_combination_of_several_sources_when_its_section_weighs_them(tmp_path):
    """With a reward model and a function the iterations train on their combination; the eval section's weights
    report it too (results.json's "combined"). None are passed unless asked for: an eval finished before the run
    was resumed under a newer version would otherwise be another config, and the resume refused."""

    def weights(**kw):
        steps = plan(config(tmp_path, iterations=1, eval_prompts="e.jsonl", **kw))
        args = next(s for s in steps if s.name == "iter_1/eval").args
        if "--reward-weights" not in args:
            return None
        i = args.index("--reward-weights") + 1
        return args[i : i + 2]

    assert weights(reward_fn="task.py:brief") is None
    assert weights(reward_fn="task.py:brief", eval={"reward_weights": [2.0, 1.0]}) == ["2.0", "1.0"]


def test_the_runs_attn_implementation_reaches_the_stages_that_load_with_transformers(tmp_path):
    """train and score always (score's engine is hf unless set), generate and eval where their section says engine:
    hf (auto may be vLLM, which refuses one); a section's own value wins; the default adds no flag at all."""

    def attn(**options):
        steps = plan(config(tmp_path, iterations=1, eval_prompts="e.jsonl", attn_implementation="varlen", **options))
        check(steps)  # every stage parses what it is given
        return {s.name: s.args[s.args.index("--attn-implementation") + 1] if "--attn-implementation" in s.args
                else None for s in steps}

    assert attn() == {"iter_0/eval": None, "iter_1/generate": None, "iter_1/score": "varlen", "iter_1/filter": None,
                      "iter_1/train": "varlen", "iter_1/eval": None}
    assert attn(generate={"engine": "hf"}, eval={"engine": "hf"}, score={"attn_implementation": "eager"}) == {
        "iter_0/eval": "varlen", "iter_1/generate": "varlen", "iter_1/score": "eager", "iter_1/filter": None,
        "iter_1/train": "varlen", "iter_1/eval": "varlen"}
    assert attn(score={"engine": "vllm"})["iter_1/score"] is None
    assert not any("--attn-implementation" in s.args for s in plan(config(tmp_path, eval_prompts="e.jsonl")))


def test_the_topics_tasks_reward_by_hand():
    from rlhf_pipeline.demo.topics import gold_reward, list_format_reward

    responses = ["A hotel has a room, staff and a bed.", "It has a view, a lobby, a bed and breakfast.",
                 "A hotel has a screen and a battery.", "Nothing comes to mind.", "The room and the plot."]
    assert gold_reward([""] * 5, responses, topic=["hotel"] * 5) == pytest.approx([1.0, 1.0, -2 / 3, -1 / 3, 0.0])
    # the topic's own name is no answer ("coffee" of "coffee shop"); "coffee" named as a thing elsewhere is wrong
    assert gold_reward(["", ""], ["A coffee shop has pastries.", "A park has coffee."], topic=["coffee shop", "park"]
                       ) == pytest.approx([1 / 3, -1 / 3])
    assert list_format_reward([""] * 3, ["It has a bed.", "It has a bed. And a view.", "no period"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="'topic' column"):
        gold_reward([""], ["x"])


def test_the_first_word_tasks_reward_by_hand():
    from rlhf_pipeline.demo.first_word import gold_reward

    responses = ["Lovely room and staff.", "lovely.", "The room was lovely.", "A lovelyish room.", "", "Room, lovely"]
    assert gold_reward([""] * 6, responses, word=["lovely"] * 6) == [1.0, 1.0, 0.0, -1.0, -1.0, 0.0]
    with pytest.raises(ValueError, match="'word' column"):
        gold_reward([""], ["x"])


def test_every_demo_task_is_registered_with_valid_data_and_rewards(tmp_path):
    """Each task of TASKS (the third, first_word, among them) writes the same bytes for the same seed, prompts with
    ids of their own and held-out phrasings no training file holds; its gold reward scores its data in [-1, 1] with
    a spread (the SFT data is neither all right nor all wrong) and its second reward is a function."""
    from rlhf_pipeline.algorithms.registry import resolve
    from rlhf_pipeline.demo import TASKS

    assert list(TASKS) == ["reviews", "topics", "first_word"]
    for name, task in TASKS.items():
        files = task.write_data(tmp_path / name, seed=0)
        first = {k: p.read_bytes() for k, p in files.items()}
        assert {k: p.read_bytes() for k, p in task.write_data(tmp_path / name, seed=0).items()} == first
        rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in files.items()}
        ids = [r["id"] for r in rows["prompts"] + rows["eval_prompts"]]
        assert len(ids) == len(set(ids)), name
        train_text = {r["prompt"] for r in rows["prompts"]} | {r["prompt"] for r in rows["sft"]}
        assert not train_text & {r["prompt"] for r in rows["eval_prompts"]}, name
        assert callable(resolve(task.second)), name
        columns = {k: [r[k] for r in rows["prompts"]] for k in rows["prompts"][0] if k not in ("id", "prompt")}
        by_prompt = {r["prompt"]: {k: r[k] for k in columns} for r in rows["prompts"]}
        sft_columns = {k: [by_prompt[r["prompt"]][k] for r in rows["sft"]] for k in columns}
        gold = resolve(task.gold)([r["prompt"] for r in rows["sft"]], [r["answer"] for r in rows["sft"]],
                                      **sft_columns)
        assert all(-1 <= g <= 1 for g in gold) and min(gold) < max(gold), name


def test_the_learning_matrix_keeps_each_iterations_clip_fraction(tmp_path, monkeypatch):
    """scripts/learning_matrix.py: per iteration, the training steps and the mean ppo/train_clip_frac over them and
    over their last quarter (the eval records, which have none, are skipped); every registry entry is a setting and
    every candidate runs a registered algorithm."""
    import importlib.util

    from rlhf_pipeline.algorithms import ALGORITHMS

    spec = importlib.util.spec_from_file_location("learning_matrix", Path(__file__).parents[1] / "scripts" /
                                                  "learning_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    for t, values in ((1, [0.1, 0.2, 0.3, 0.6]), (10, [0.5, 0.3])):
        metrics = tmp_path / f"iter_{t}" / "train" / "metrics.jsonl"
        metrics.parent.mkdir(parents=True)
        metrics.write_text("".join(json.dumps({"step": i, "ppo/train_clip_frac": v}) + "\n" for i, v in
                                   enumerate(values)) + json.dumps({"step": 0, "loss/eval": 1.0}) + "\n")
    assert matrix.clip_fractions(tmp_path) == {"train_steps": [4, 2], "clip_frac": [0.3, 0.4],
                                               "clip_frac_end": [0.6, 0.3]}
    assert matrix.clip_fractions(tmp_path / "none") == {}
    assert set(ALGORITHMS) <= set(matrix.settings(None))
    assert all(algo in ALGORITHMS for algo, _ in matrix.settings(None).values())
    # the overlapped settings run the demo with --overlap 1, the others without
    commands = []
    monkeypatch.setattr(matrix.subprocess, "run",
                        lambda cmd, **kw: commands.append(cmd) or subprocess.CompletedProcess(cmd, 1))
    for name in ("rebel+overlap", "rebel"):
        algo, train = matrix.settings([name])[name]
        matrix.run_one("topics", name, algo, train, tmp_path / name, tmp_path / "log")
    assert commands[0][-2:] == ["--overlap", "1"] and "--algo" in commands[0] and "rebel" in commands[0]
    assert "--overlap" not in commands[1]


def test_the_demo_plans_each_task_with_its_own_reward(tmp_path):
    """reviews: a reward model trained on gold-labelled pairs; topics: its python reward, no reward model, PPO's
    critic from the policy, and GDPO with a second function beside it."""
    from rlhf_pipeline.demo import TASKS
    from rlhf_pipeline.stages.demo import DemoConfig
    from rlhf_pipeline.stages.demo import plan as demo_plan

    def steps(task, algo):
        run = tmp_path / task / algo
        data = TASKS[task].write_data(run / "data", seed=0)
        return {s.name: s.args for s in demo_plan(DemoConfig(output=str(run), task=task, algo=algo), run, data)}

    def arg(args, flag):
        return args[args.index(flag) + 1]

    reviews, topics = steps("reviews", "ppo"), steps("topics", "ppo")
    assert "reward_model" in reviews and "reward_model" not in topics
    assert arg(reviews["iter_1/score"], "--reward-model").endswith("reward_model")
    assert arg(topics["iter_1/score"], "--reward-fn") == "rlhf_pipeline.demo.topics:gold_reward"
    assert "--reward-model" not in topics["iter_1/score"] and "--reward-model" not in topics["iter_0/eval"]
    assert arg(topics["iter_1/train"], "--critic-model") == str(tmp_path / "topics" / "ppo" / "sft")
    gdpo = steps("topics", "gdpo")["iter_1/score"]
    at = gdpo.index("--reward-fn")
    assert gdpo[at + 1 : at + 3] == ["rlhf_pipeline.demo.topics:gold_reward",
                                    "rlhf_pipeline.demo.topics:list_format_reward"]
    # more prompts an iteration than the task has: said with the demo's flag, not iterate's key
    run = tmp_path / "topics" / "many"
    data = TASKS["topics"].write_data(run / "data", seed=0)
    count = sum(1 for _ in open(data["prompts"]))
    with pytest.raises(PipelineError, match=rf"^--prompts-per-iteration {count + 1}: the topics task has {count} "
                                            rf"training prompts; give at most {count}$"):
        demo_plan(DemoConfig(output=str(run), task="topics", prompts_per_iteration=count + 1), run, data)


def test_the_demo_passes_options_to_sft_and_train_rm_and_places_its_stages(tmp_path, monkeypatch):
    """--sft and --train-rm reach their stages' command lines (over the demo's own settings); --device auto keeps a
    small model's stages on the CPU by hiding the GPUs from them, and --device cuda without a GPU is one error."""
    from rlhf_pipeline.demo import TASKS
    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.stages.demo import CPU_UP_TO_HIDDEN, DemoConfig, place_stages
    from rlhf_pipeline.stages.demo import plan as demo_plan

    run = tmp_path / "run"
    data = TASKS["reviews"].write_data(run / "data", seed=0)
    config = DemoConfig(output=str(run), sft={"max_steps": 7, "learning_rate": 1e-4}, train_rm={"bf16": True})
    steps = {s.name: s.args for s in demo_plan(config, run, data)}
    sft, rm = steps["sft"], steps["reward_model"]
    assert sft[sft.index("--max-steps") + 1] == "7" and sft[sft.index("--learning-rate") + 1] == "0.0001"
    assert sft.count("--learning-rate") == 1 and "--bf16" in rm and "--bf16" not in sft

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    place_stages(DemoConfig(output=str(run), hidden_size=CPU_UP_TO_HIDDEN))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(PipelineError, match="--device cuda: torch sees no GPU"):
            place_stages(DemoConfig(output=str(run), device="cuda"))


@pytest.mark.slow
def test_the_topics_demo_runs_ppo_on_its_python_reward(tmp_path):
    """The second bundled task end to end at small sizes: no reward model, PPO's critic started from the policy."""
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    run = tmp_path / "topics"
    res = subprocess.run([sys.executable, "-m", "rlhf_pipeline.stages.demo", "--task", "topics", "--algo", "ppo",
                          "--output", str(run), *DEMO_SMALL], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not (run / "reward_model").exists()
    training = json.loads((run / "iter_1" / "train" / "manifest.json").read_text())["training"]
    assert training["critic_model"] == str(run / "sft")
    summary = json.loads((run / "summary.json").read_text())
    first, last = summary["iterations"]
    assert first["rm_reward_mean"] is None and first["gold_win_rate_vs_base"] == 0.5
    assert isinstance(last["gold_reward_mean"], float) and isinstance(last["gold_lc_win_rate_vs_base"], float)
    assert "topics:" in res.stdout
