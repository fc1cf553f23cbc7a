"""scripts/gpu_check.sh --cpu: the GPU check's whole path (every stage of an iteration through rlhf demo, the
reference pass, DPO plain and under ZeRO-3 with their losses compared, generation, the trainer benchmark against
TRL, our step eager and compiled, each profiled) run on a CPU with tiny sizes, as a smoke test of what a session lent a GPU runs there:
first --bench-only (the GPU tests and the benchmark), then the rest with --resume into the same summary; then
--resume again after a run that did not pass two of its steps, which runs only those."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_every_step_on_a_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    check = ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)]
    res = subprocess.run([*check, "--bench-only"], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    first = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert first["passed"] and first["bench_only"] and [s["step"] for s in first["steps"]] == ["gpu_tests", "bench"]
    assert not (tmp_path / "demo").exists()

    res = subprocess.run([*check, "--resume"], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert res.stdout.count("passed in an earlier run (--resume), kept") == 2
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["passed"] and summary["cpu"] and summary["device"] == "cpu" and not summary["bench_only"]
    steps = {s["step"]: s["rc"] for s in summary["steps"]}
    assert set(steps) == {"gpu_tests", "bench", "demo", "ref_logps", "train_plain", "train_zero3",
                          "generate_check_size_model_default"}
    assert set(steps.values()) == {0}
    checks = summary["checks"]
    assert all(checks["outputs"].values()) and checks["report"]
    # the same three DPO steps plain and under ZeRO-3 agree, and they are three real steps
    zero3 = checks["zero3_vs_plain"]
    assert zero3["agree"] and len(zero3["plain_loss_grad_norm"]) == 3
    # the benchmark ran our step as the check trains (bf16 weights with float32 masters) eager and compiled, the
    # same step to float rounding with no compilation inside the timed steps, and profiled each for 3 more steps
    bench = json.loads((tmp_path / "out" / "bench.json").read_text())
    sides = bench["sides"]
    assert "runs_pending" not in bench and not any(v.get("pending") for v in sides.values())  # every side ran
    for side in ("ours_bf16", "ours_compile", "ours_compile@16384"):
        assert "error" not in sides[side]
    # the sides a GPU run compares against: TRL's DPOTrainer, with and without precomputed reference log-probs (the
    # dev extra installs trl, so that they are exercised here before a lease rather than first on the device)
    for side in ("trl", "trl_precomputed"):
        assert "error" not in sides[side] and sides[side]["tokens_per_s_steps"] > 0, sides[side]
    for side in ("ours_compile", "ours_compile@16384"):
        assert sides[side]["compiled_graphs"]["in_window"] == 0 and sides[side]["compiled_graphs"]["before_window"] > 0
    assert sides["ours_compile@16384"]["max_tokens_per_micro_batch"] == 16384
    same = checks["compile_vs_eager"]  # each compiled side against the eager one, in the summary's verdict
    assert same["agree"] and {k: v["compared_with"] for k, v in same["sides"].items()} == {
        "ours_compile": "ours_bf16", "ours_compile@16384": "ours_bf16"}
    assert all(v["frames_fell_back"] == 0 for v in same["sides"].values())
    for side in ("ours_bf16", "ours_compile"):
        assert sides[side]["profile"]["steps"] == 3 and sides[side]["profile"]["wall_ms"] > 0
        assert checks["bench"]["profiles"][side]["steps"] == 3

    # --resume, as after a run that did not pass two of its steps (the first, the last): only those run again, into the
    # same summary, and every step the first run passed is kept as it was
    lines = (tmp_path / "out" / "steps.jsonl").read_text().splitlines()
    cut = ["gpu_tests", "generate_check_size_model_default"]
    skipped = {name: json.dumps({"step": name, "rc": -1, "seconds": 0, "skipped": "deadline"}) for name in cut}
    lines = [skipped.get(json.loads(l)["step"], l) for l in lines]  # each in its place
    (tmp_path / "out" / "steps.jsonl").write_text("\n".join(lines) + "\n")
    shutil.rmtree(tmp_path / "generate_check_size_model_default")
    res = subprocess.run([*check, "--resume"], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert res.stdout.count("passed in an earlier run (--resume), kept") == len(steps) - len(cut)
    again = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert again["passed"] and [s["step"] for s in again["steps"]] == [s["step"] for s in summary["steps"]]
    before = {s["step"]: s["seconds"] for s in summary["steps"]}
    for s in again["steps"]:
        assert s["rc"] == 0 and (s["seconds"] == before[s["step"]]) == (s["step"] not in cut)
    assert (tmp_path / "generate_check_size_model_default" / "manifest.json").is_file()
