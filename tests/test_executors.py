"""rlhf generate --executor ray: N replicas of the hf engine on a local Ray write what the --shard i/N runs merged
write, and with --batch-size 1 (each prompt sampled from its own seed) what one local engine writes; a replica that
dies is retried once, one that keeps failing fails the stage with one line and no output.

One in-process Ray serves the module (the stage uses a Ray this process already started, and leaves it running). It
declares 4 CPUs and 4 GPUs it does not have, so that replicas of several GPUs get their placement groups on this machine
(their tasks are plain functions, which use none). Its workers start with a setup hook that can make the hf engine fail,
by a marker file: ``die-once`` (the first replica to sample exits its process, as a lost node would) or ``raise`` (every
attempt raises)."""

import json
import sys
from pathlib import Path

import pytest
from datasets import load_from_disk

from conftest import run


def columns(path: Path) -> dict:
    """Every column but the sampler's log-probs, which depend on how prompts share a batch to float noise (the same
    tokens sampled: :func:`logprobs_close`)."""
    ds = load_from_disk(str(path))
    return {c: ds[c] for c in ds.column_names if c != "response_logprobs"}


def logprobs_close(a: Path, b: Path) -> bool:
    flat = [[x for rs in load_from_disk(str(p))["response_logprobs"] for r in rs for x in r] for p in (a, b)]
    return len(flat[0]) == len(flat[1]) and max(abs(x - y) for x, y in zip(*flat)) < 1e-4


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


COMMON = ["--n", 2, "--max-new-tokens", 6, "--limit", 7, "--engine", "hf", "--temperature", 1.0]


def test_without_ray_installed_the_error_names_the_extra(tiny_policy, bundled_prompts, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, as where it is not installed
    for stage in (["generate"], ["eval", "--reward-fn", "rlhf_pipeline.demo.task:gold_reward"]):
        capsys.readouterr()
        assert run(*stage, "--model", tiny_policy, "--prompts", bundled_prompts, "--executor", "ray",
                   "--output", tmp_path / "out") == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Ray is not installed; pip install 'rlhf-pipeline[ray]'" in err, err
        assert not (tmp_path / "out").exists()


def test_a_ray_address_where_nothing_listens(tiny_policy, bundled_prompts, tmp_path, capsys):
    """One line at once, not minutes of Ray retrying its connection."""
    pytest.importorskip("ray")
    from conftest import free_port

    capsys.readouterr()
    assert run("generate", "--model", tiny_policy, "--prompts", bundled_prompts, "--executor", "ray",
               "--ray-address", f"127.0.0.1:{free_port()}", "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --ray-address 127.0.0.1:") and "nothing answers there" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_a_ray_address_in_brackets_is_reached():
    """An IPv6 head node's address, as Ray prints it ([::1]:PORT), is checked at its host, not refused."""
    import socket

    from rlhf_pipeline.executors import _check_reachable

    try:
        listener = socket.socket(socket.AF_INET6)
        listener.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with listener:
        listener.listen()
        _check_reachable(f"[::1]:{listener.getsockname()[1]}")


def test_a_run_starts_and_stops_its_own_local_ray(tiny_policy, bundled_prompts, tmp_path):
    """Without --ray-address (and no Ray in the process yet) the stage starts a local Ray of --replicas CPUs and
    stops it when done. It runs in a process of its own, where no Ray runs whichever tests ran before (this module's
    in-process Ray among them)."""
    import subprocess

    pytest.importorskip("ray")
    args = ["generate", "--model", tiny_policy, "--prompts", bundled_prompts, *COMMON, "--batch-size", 1,
            "--limit", 3]
    script = ("import sys, ray\nfrom rlhf_pipeline.cli import main\nassert not ray.is_initialized()\n"
              "code = main(sys.argv[1:])\nassert not ray.is_initialized(), 'the stage left its Ray running'\n"
              "sys.exit(code)\n")
    res = subprocess.run([sys.executable, "-c", script, *map(str, args), "--executor", "ray", "--replicas", "2",
                          "--output", str(tmp_path / "ray")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert run(*args, "--output", tmp_path / "local") == 0
    assert columns(tmp_path / "ray") == columns(tmp_path / "local")
    assert logprobs_close(tmp_path / "ray", tmp_path / "local")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    ray = pytest.importorskip("ray")
    faults = tmp_path_factory.mktemp("faults")

    def inject_faults():  # a closure: Ray ships it to each worker by value and runs it there at start
        import os as os_

        import rlhf_pipeline.engines.hf as hf

        real = hf.HFEngine.generate

        def generate(self, *args, **kwargs):
            try:  # one replica claims the marker (a rename is atomic), the retry finds it gone
                os_.rename(faults / "die-once", faults / "claimed")
                os_._exit(1)
            except FileNotFoundError:
                pass
            if (faults / "raise").exists():
                raise RuntimeError("injected fault")
            return real(self, *args, **kwargs)

        hf.HFEngine.generate = generate

    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, logging_level="WARNING",
             runtime_env={"worker_process_setup_hook": inject_faults})
    yield faults
    ray.shutdown()


@pytest.mark.parametrize("batch_size", [1, 3])
def test_replicas_write_the_merged_shards(local_ray, tiny_policy, bundled_prompts, tmp_path, batch_size):
    """Token ids, texts, finish reasons, prompt columns: exactly the 2 shard runs merged. With --batch-size 1 also
    exactly the local run; with batches of 3 the hf engine's samples depend on the batch (a shard's batches differ
    from the whole run's), so there only the merged shards are the oracle, and they differ from the local run."""
    args = ["--model", tiny_policy, "--prompts", bundled_prompts, *COMMON, "--batch-size", batch_size]
    assert run("generate", *args, "--executor", "ray", "--replicas", 2, "--output", tmp_path / "ray") == 0
    for i in range(2):
        assert run("generate", *args, "--shard", f"{i}/2", "--output", tmp_path / f"s{i}") == 0
    assert run("merge", "--inputs", tmp_path / "s0", tmp_path / "s1", "--output", tmp_path / "merged") == 0
    assert run("generate", *args, "--output", tmp_path / "local") == 0
    ours, merged, local = (columns(tmp_path / d) for d in ("ray", "merged", "local"))
    assert ours == merged
    assert (ours == local) == (batch_size == 1)
    assert len(ours["response_token_ids"]) == 7 and all(len(r) == 2 for r in ours["response_token_ids"])
    recorded = manifest(tmp_path / "ray")
    assert recorded["executor"] == {"name": "ray", "replicas": 2, "gpus_per_replica": 0, "ray_address": None}
    assert recorded["sampling"] == manifest(tmp_path / "local")["sampling"]
    # The executor does not change the output: a local run over the ray run's output has nothing to do.
    assert run("generate", *args, "--output", tmp_path / "ray") == 0


def test_a_replica_that_dies_is_retried(local_ray, tiny_policy, bundled_prompts, tmp_path):
    args = ["--model", tiny_policy, "--prompts", bundled_prompts, *COMMON, "--batch-size", 1, "--limit", 4]
    assert run("generate", *args, "--output", tmp_path / "local") == 0
    (local_ray / "die-once").touch()
    assert run("generate", *args, "--executor", "ray", "--replicas", 2, "--output", tmp_path / "ray") == 0
    assert (local_ray / "claimed").exists()  # a replica's process did exit
    (local_ray / "claimed").unlink()
    assert columns(tmp_path / "ray") == columns(tmp_path / "local")


def test_a_replica_that_fails_twice_fails_the_stage(local_ray, tiny_policy, bundled_prompts, tmp_path, capfd):
    (local_ray / "raise").touch()
    try:
        capfd.readouterr()
        assert run("generate", "--model", tiny_policy, "--prompts", bundled_prompts, *COMMON, "--executor", "ray",
                   "--replicas", 2, "--output", tmp_path / "out") == 1
    finally:
        (local_ray / "raise").unlink()
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "replica" in errors[0] and "failed twice" in errors[0], errors
    assert "RuntimeError: injected fault" in errors[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_gpus_per_replica_without_gpus(local_ray, tiny_policy, bundled_prompts, tmp_path, capsys):
    capsys.readouterr()
    assert run("generate", "--model", tiny_policy, "--prompts", bundled_prompts, "--executor", "ray",
               "--gpus-per-replica", 8, "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: --gpus-per-replica 8: no node of this machine has that many GPUs (the most is 4); join GPU "
                   "nodes to the cluster, or pass --gpus-per-replica 0 for CPU replicas"), err
    assert not (tmp_path / "out").exists()


def test_replicas_of_several_gpus_run_in_their_placement_groups_and_free_them(local_ray, monkeypatch):
    """--gpus-per-replica K > 1 (vLLM's tensor parallelism): each replica's task runs in a placement group of K GPUs
    packed on one node, which the task can be scheduled in (it takes a bundle's CPU), and every group is removed
    after, also when reserving one failed. More replicas than the node holds at once are refused, not left waiting."""
    import ray
    from ray.util import placement_group_table

    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.executors import run_on_ray

    def live_groups():
        return [g for g in placement_group_table().values() if g["state"] != "REMOVED"]

    assert run_on_ray(json.dumps, [([1],), ({"a": 2},)], gpus_per_replica=2) == ["[1]", '{"a": 2}']
    assert live_groups() == []
    with pytest.raises(PipelineError, match=r"^--replicas 3 x --gpus-per-replica 2: each replica needs 2 GPUs and as "
                                            r"many CPUs on one node, and the nodes of this machine \(4 GPUs and 4 "
                                            r"CPUs\) hold 2 at once; pass at most --replicas 2$"):
        run_on_ray(json.dumps, [(1,), (2,), (3,)], gpus_per_replica=2)
    real, made = ray.util.placement_group, []

    def second_fails(*args, **kwargs):
        if made:
            raise ValueError("bundles invalid\nmore")
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(ray.util, "placement_group", second_fails)
    with pytest.raises(PipelineError, match=r"^--executor ray: could not reserve 2 GPUs on one node for replica 1 "
                                            r"\(ValueError: bundles invalid\)$"):
        run_on_ray(json.dumps, [(1,), (2,)], gpus_per_replica=2)
    assert made and live_groups() == []


def test_a_failed_replicas_reason_is_shown_without_the_hub_token(monkeypatch):
    """A replica's error can quote a request with the token (a worker inherits HF_TOKEN): redacted in the one line."""
    from types import SimpleNamespace

    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.executors import _gather

    token = "hf_" + "A1b2C3d4" * 4
    monkeypatch.setenv("HF_TOKEN", token)

    class RayError(Exception):
        cause = RuntimeError(f"401 Client Error (Authorization: Bearer {token})")

    def get(ref):
        raise RayError("task failed")

    ray = SimpleNamespace(wait=lambda pending, num_returns: (pending[:1], pending[1:]), get=get,
                          cancel=lambda ref, force: None, exceptions=SimpleNamespace(RayError=RayError))
    with pytest.raises(PipelineError) as info:
        _gather(ray, ["a"], lambda i: f"replica {i}", "replicas", 0.0)
    assert str(info.value) == ("--executor ray: replica 0 failed twice (once retried): RuntimeError: 401 Client Error "
                               "(Authorization: Bearer ***); nothing was written")


def test_eval_samples_on_replicas(local_ray, tiny_policy, bundled_prompts, tmp_path):
    """rlhf eval takes the same flags (SamplingOptions) and hands them to its generate step: the same samples and
    the same numbers as a local evaluation."""
    args = ["eval", "--model", tiny_policy, "--prompts", bundled_prompts, "--reward-fn",
            "rlhf_pipeline.demo.task:gold_reward", "--n", 2, "--max-new-tokens", 6, "--limit", 4, "--engine", "hf",
            "--batch-size", 1]
    assert run(*args, "--executor", "ray", "--replicas", 2, "--output", tmp_path / "ray") == 0
    assert run(*args, "--output", tmp_path / "local") == 0
    assert columns(tmp_path / "ray" / "generate") == columns(tmp_path / "local" / "generate")
    assert manifest(tmp_path / "ray" / "generate")["executor"]["replicas"] == 2
    assert manifest(tmp_path / "ray")["eval"] == manifest(tmp_path / "local")["eval"]



def test_one_line_first_line_only_serves_the_ray_failures():
    """errors.one_line(first_line_only=True) is what executors' own first_line gave (the first line of the message,
    as it is, after the type); the default joins every line, as before."""
    from rlhf_pipeline.errors import one_line

    many = RuntimeError("  injected   fault\nTraceback (most recent call last):\n  File \"x.py\", line 1\n")
    assert one_line(many, first_line_only=True) == "RuntimeError: injected   fault"
    assert one_line(many) == 'RuntimeError: injected fault Traceback (most recent call last): File "x.py", line 1'
    for blank in (ValueError(""), ValueError(" \n ")):
        assert one_line(blank, first_line_only=True) == one_line(blank) == "ValueError"


def test_a_failed_task_is_named_by_the_first_line_of_its_cause():
    """_gather's one line takes the first line of the task's cause (a RayTaskError's message goes on with the remote
    traceback), or of the Ray error itself when it has no cause; without a real Ray."""
    from types import SimpleNamespace

    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.executors import _gather

    class RayError(Exception):
        def __init__(self, message, cause=None):
            super().__init__(message)
            self.cause = cause

    for error, reason in (
        (RayError("ray: task failed\nremote traceback", RuntimeError("injected fault\nmore")), "RuntimeError: "
         "injected fault"),
        (RayError("worker died\nmore"), "RayError: worker died"),
    ):
        cancelled = []

        def get(ref, error=error):
            raise error

        ray = SimpleNamespace(wait=lambda pending, num_returns: (pending[:1], pending[1:]), get=get,
                              cancel=lambda ref, force: cancelled.append(ref),
                              exceptions=SimpleNamespace(RayError=RayError))
        with pytest.raises(PipelineError) as info:
            _gather(ray, ["a", "b"], lambda i: f"replica {i}", "replicas", 0.0)
        assert str(info.value) == (f"--executor ray: replica 0 failed twice (once retried): {reason}; "
                                   "nothing was written")
        assert cancelled == ["b"]
