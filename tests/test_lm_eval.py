"""rlhf eval --lm-eval: EleutherAI's harness on the evaluated model, offline, with the bundled task (rlhf_arith).

The harness's accuracy is recomputed here from the tiny policy's own log-probs (transformers, no lm-eval), the
results are followed into results.json, the manifest and the printed summary, a rerun reuses them, a bad task name
is one line, and rlhf iterate passes the tasks to every evaluation. Tests that run lm-eval skip without it
(``pip install 'rlhf-pipeline[lm-eval]'``); the iterate and report parts do not need it.
"""

import importlib.util
import json
import math
import shutil

import pytest

from conftest import choice_logliks, run
from rlhf_pipeline.harness import bundled_tasks_dir, parse_tasks

ARITH = bundled_tasks_dir() / "rlhf_arith.jsonl"
REWARD = "def reward(prompts, responses, **columns):\n    return [float(len(r)) for r in responses]\n"


def _rows() -> list[dict]:
    return [json.loads(line) for line in ARITH.read_text().splitlines()]


@pytest.fixture(scope="module")
def harness_results(tiny_policy):
    pytest.importorskip("lm_eval")
    from rlhf_pipeline.harness import run_harness

    return run_harness(tiny_policy, ["rlhf_arith"], backend="hf", dtype="float32", batch_size=4)


def test_parse_tasks_takes_commas_and_lists():
    assert parse_tasks("a, b,,c") == ["a", "b", "c"]
    assert parse_tasks(["a,b", "my/t.yaml"]) == ["a", "b", "my/t.yaml"]
    assert parse_tasks(None) is None and parse_tasks(" , ") is None


def test_accuracy_is_the_models_own_choice_by_log_prob(harness_results, tiny_policy):
    rows = _rows()
    logliks = choice_logliks(tiny_policy, rows)
    hits = [max(range(len(s)), key=s.__getitem__) == r["answer"] for s, r in zip(logliks, rows)]
    # acc_norm divides each choice's log-prob by its length in characters (lm-eval's acc_norm)
    norm = [max(range(len(s)), key=lambda i: s[i] / len(r["choices"][i])) == r["answer"] for s, r in zip(logliks, rows)]
    task = harness_results["tasks"]["rlhf_arith"]
    assert task["rows"] == 20 and task["num_fewshot"] == 0
    acc, acc_norm = sum(hits) / 20, sum(norm) / 20
    assert task["metrics"]["acc"]["value"] == pytest.approx(acc, abs=1e-12)
    assert task["metrics"]["acc_norm"]["value"] == pytest.approx(acc_norm, abs=1e-12)
    # the standard error of a mean of 0/1 values with the sample variance: sqrt(p (1 - p) / (n - 1))
    assert task["metrics"]["acc"]["stderr"] == pytest.approx(math.sqrt(acc * (1 - acc) / 19), rel=1e-9)
    assert harness_results["backend"] == "hf" and harness_results["requested"] == ["rlhf_arith"]
    json.dumps(harness_results)  # plain JSON data


def test_a_users_yaml_file_with_absolute_data_files_runs_offline(tmp_path, tiny_policy):
    """The documented way to bring one's own task: a YAML with ``dataset_path: json`` and an absolute data file."""
    pytest.importorskip("lm_eval")
    from rlhf_pipeline.harness import run_harness

    data = tmp_path / "mine.jsonl"
    shutil.copy(ARITH, data)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.yaml").write_text(
        "task: my_arith\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    results = run_harness(tiny_policy, [str(tmp_path / "tasks" / "mine.yaml")], dtype="float32", batch_size=4,
                          limit=5)
    task = results["tasks"]["my_arith"]
    assert task["rows"] == 5 and set(task["metrics"]) == {"acc"}
    rows = _rows()[:5]
    hits = [max(range(4), key=s.__getitem__) == r["answer"] for s, r in zip(choice_logliks(tiny_policy, rows), rows)]
    assert task["metrics"]["acc"]["value"] == pytest.approx(sum(hits) / 5, abs=1e-12)


def _eval_args(model, prompts, out, reward, *extra):
    return ["eval", "--model", model, "--prompts", prompts, "--output", out, "--n", 1, "--max-new-tokens", 4,
            "--limit", 3, "--engine", "hf", "--dtype", "float32", "--batch-size", 4, "--reward-fn", f"{reward}:reward",
            *extra]


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory, tiny_policy, bundled_prompts):
    pytest.importorskip("lm_eval")
    d = tmp_path_factory.mktemp("lm_eval")
    (d / "reward.py").write_text(REWARD)
    assert run(*_eval_args(tiny_policy, bundled_prompts, d / "out", d / "reward.py", "--lm-eval", "rlhf_arith")) == 0
    return d


def test_eval_puts_the_harness_results_in_results_json_and_the_manifest(eval_dir, harness_results):
    out = eval_dir / "out"
    kept = json.loads((out / "lm_eval" / "results.json").read_text())
    results = json.loads((out / "results.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert results["lm_eval"] == kept and manifest["eval"]["lm_eval"] == kept
    assert manifest["config"]["lm_eval"] == ["rlhf_arith"]
    # the same model, dtype and rows as the direct run: the same numbers
    assert kept["tasks"] == harness_results["tasks"]
    assert results["scores"]["reward_fn"]["mean"] is not None  # the rest of the evaluation is there too


def test_an_unfinished_eval_reuses_the_harness_results(eval_dir, tiny_policy, bundled_prompts, monkeypatch, capsys):
    """The evaluation stopped after the harness wrote its results (no manifest yet): the rerun finishes without
    running the harness again, and prints its numbers."""
    import rlhf_pipeline.harness as harness

    copy = eval_dir / "again"
    shutil.copytree(eval_dir / "out", copy)
    (copy / "manifest.json").unlink()

    def no_second_run(*args, **kwargs):
        raise AssertionError("the harness ran again")

    monkeypatch.setattr(harness, "run_harness", no_second_run)
    assert run(*_eval_args(tiny_policy, bundled_prompts, copy, eval_dir / "reward.py", "--lm-eval", "rlhf_arith")) == 0
    assert json.loads((copy / "results.json").read_text())["lm_eval"] == json.loads(
        (eval_dir / "out" / "lm_eval" / "results.json").read_text())
    printed = capsys.readouterr().out
    assert "[eval] lm-eval rlhf_arith: acc " in printed and "acc_norm" in printed


def test_a_bad_task_name_is_one_line_and_leaves_nothing(tmp_path, tiny_policy, bundled_prompts, capsys):
    pytest.importorskip("lm_eval")
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "out"
    assert run(*_eval_args(tiny_policy, bundled_prompts, out, tmp_path / "reward.py", "--lm-eval", "rlhf_arth")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no task, group or tag named 'rlhf_arth'" in err[0] and "close: rlhf_arith" in err[0]
    assert not out.exists()
    missing = tmp_path / "nope.yaml"
    assert run(*_eval_args(tiny_policy, bundled_prompts, out, tmp_path / "reward.py", "--lm-eval", missing)) == 1
    assert "no such file or directory" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:  # the test environment: the vllm backend is one line too
        assert run(*_eval_args(tiny_policy, bundled_prompts, out, tmp_path / "reward.py", "--lm-eval", "rlhf_arith",
                               "--lm-eval-backend", "vllm")) == 1
        assert "vLLM is not installed here; use --lm-eval-backend hf" in capsys.readouterr().err
    assert not out.exists()


def test_without_lm_eval_installed_the_error_names_the_extra(monkeypatch):
    import builtins

    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.harness import check_tasks

    real = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    with pytest.raises(PipelineError, match=r"pip install 'rlhf-pipeline\[lm-eval\]'"):
        check_tasks(["rlhf_arith"])


def test_iterate_passes_the_tasks_to_every_evaluation(tmp_path):
    from rlhf_pipeline.stages.iterate import IterateConfig, _stage_config, plan

    base = dict(output=str(tmp_path / "run"), model="base", prompts=str(tmp_path / "p.jsonl"), iterations=2,
                reward_model="rm", eval_prompts="e.jsonl")
    steps = [s for s in plan(IterateConfig(**base, lm_eval="rlhf_arith,my/tasks.yaml")) if s.stage == "eval"]
    assert len(steps) == 3  # iteration 0 (the starting policy), 1 and 2
    for step in steps:
        config = _stage_config(step)
        assert config.lm_eval == ["rlhf_arith", "my/tasks.yaml"]
    # the eval section's own lm_eval (with its limit) wins over the top-level option
    steps = plan(IterateConfig(**base, lm_eval="rlhf_arith", eval={"lm_eval": ["gsm8k"], "lm_eval_limit": 10}))
    config = _stage_config([s for s in steps if s.stage == "eval"][-1])
    assert config.lm_eval == ["gsm8k"] and config.lm_eval_limit == 10
    assert all(_stage_config(s).lm_eval is None for s in plan(IterateConfig(**base)) if s.stage == "eval")
    with pytest.raises(ValueError, match="set eval_prompts"):
        IterateConfig(**{**base, "eval_prompts": None}, lm_eval="rlhf_arith")


def _eval_results(acc: float, stderr: float) -> dict:
    return {"num_prompts": 3, "n": 1, "scores": {"reward_fn": {"mean": 1.0, "stderr": 0.1, "win_rate": None}},
            "lm_eval": {"tasks": {"rlhf_arith": {"metrics": {"acc": {"value": acc, "stderr": stderr},
                                                            "acc_norm": {"value": 0.5, "stderr": None}}}}}}


def test_report_shows_the_lm_eval_metrics_per_iteration(tmp_path):
    pytest.importorskip("matplotlib")
    from rlhf_pipeline.stages.report import write_report

    run_dir = tmp_path / "run"
    for t, acc in ((0, 0.25), (1, 0.4)):
        (run_dir / f"iter_{t}" / "eval").mkdir(parents=True)
        (run_dir / f"iter_{t}" / "eval" / "results.json").write_text(json.dumps(_eval_results(acc, 0.1)))
    md = write_report(run_dir).read_text()
    assert "## lm-eval per iteration" in md
    assert "| iter | rlhf_arith acc | rlhf_arith acc_norm |" in md
    assert "| 0 | 0.25 ± 0.1 | 0.5 |" in md and "| 1 | 0.4 ± 0.1 | 0.5 |" in md
    assert (run_dir / "plots" / "lm_eval.png").read_bytes().startswith(b"\x89PNG")
    assert "(plots/lm_eval.png)" in md

    for t in (0, 1):  # without lm-eval: no section, no plot, and no "not drawn" line for it
        (run_dir / f"iter_{t}" / "eval" / "results.json").write_text(json.dumps(
            {k: v for k, v in _eval_results(0.3, 0.1).items() if k != "lm_eval"}))
    md = write_report(run_dir).read_text()
    assert "lm-eval" not in md and "lm_eval.png" not in md
    assert not (run_dir / "plots" / "lm_eval.png").exists()


def test_the_vllm_backend_loads_weights_from_safetensors_only(monkeypatch, tiny_policy):
    """lm-eval hands its vllm model's extra arguments on to vLLM's ``LLM()``: ``load_format="safetensors"`` keeps it
    from loading a pickle (pytorch_model.bin), as the project's own engines. (The real-vLLM run is
    tests/vllm_env/test_vllm_lm_eval.py, where lm-eval is installed.)"""
    pytest.importorskip("lm_eval")
    import lm_eval.api.registry as registry

    from rlhf_pipeline import harness

    class Built(Exception):
        pass

    class FakeVLLM:
        @classmethod
        def create_from_arg_obj(cls, args, additional):
            raise Built(args)

    monkeypatch.setattr(harness, "check_tasks", lambda tasks, backend: list(tasks))
    monkeypatch.setattr(registry, "get_model", lambda name: FakeVLLM if name == "vllm" else None)
    with pytest.raises(Built) as built:
        harness.run_harness(tiny_policy, ["rlhf_arith"], backend="vllm",
                            vllm_options={"max_model_len": 256, "tensor_parallel_size": None})
    args = built.value.args[0]
    assert args["load_format"] == "safetensors" and args["pretrained"] == tiny_policy
    assert args["max_model_len"] == 256 and "tensor_parallel_size" not in args


def test_the_kept_harness_results_of_a_model_written_again_since_are_not_reused(tmp_path, tiny_policy, monkeypatch):
    """The results an unfinished evaluation kept are reused for the same model, options and files only: a policy
    retrained into the same directory since is another model, and the harness runs on it again."""
    import os

    import rlhf_pipeline.harness as harness
    from rlhf_pipeline.stages.eval import EvalConfig, _lm_eval

    model = shutil.copytree(tiny_policy, tmp_path / "policy")
    runs = []
    monkeypatch.setattr(harness, "run_harness", lambda model, tasks, backend, limit, num_fewshot, **kw: runs.append(1)
                        or {"model": model, "requested": list(tasks), "backend": backend, "limit": limit,
                            "num_fewshot": num_fewshot, "tasks": {"t": {"acc": len(runs)}}})
    config = EvalConfig(model=str(model), prompts="p.jsonl", output=str(tmp_path / "out"), reward_fn="r.py:reward",
                        lm_eval=["rlhf_arith"], engine="hf")
    first = _lm_eval(config, tmp_path / "out")
    assert _lm_eval(config, tmp_path / "out") == first and len(runs) == 1  # kept, reused
    later = os.stat(model / "config.json").st_mtime_ns + 10**9
    os.utime(model / "config.json", ns=(later, later))  # written again
    assert _lm_eval(config, tmp_path / "out")["tasks"] == {"t": {"acc": 2}} and len(runs) == 2
