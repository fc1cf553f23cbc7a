"""scripts/gpu_check.sh --cpu: the GPU check's whole path (every stage of an iteration through rlhf demo, the
reference pass, DPO plain and under ZeRO-3 with their losses compared, generation, the trainer benchmark against
TRL and its profile) run on a CPU with tiny sizes, as a smoke test of what a session lent a GPU runs there; then
--resume, which runs again only the steps a cut run did not pass."""

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
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["passed"] and summary["cpu"] and summary["device"] == "cpu"
    steps = {s["step"]: s["rc"] for s in summary["steps"]}
    assert set(steps) >= {"gpu_tests", "demo", "ref_logps", "train_plain", "train_zero3", "generate_demo_size_model_default",
                          "generate_check_size_model_default", "bench", "profile"}
    assert set(steps.values()) == {0}
    checks = summary["checks"]
    assert all(checks["outputs"].values()) and checks["report"]
    # the same three DPO steps plain and under ZeRO-3 agree, and they are three real steps
    zero3 = checks["zero3_vs_plain"]
    assert zero3["agree"] and len(zero3["plain_loss_grad_norm"]) == 3
    # the benchmark ran every side, TRL's too when it is installed, and the profile has a summary of its steps
    bench = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert "error" not in bench["sides"]["ours"] and "error" not in bench["sides"]["ours_bf16"]
    # the profile is of the path the check trains with on a GPU: bf16 weights with float32 masters
    profile = json.loads((tmp_path / "out" / "profile.json").read_text())["sides"]["ours_bf16"]["profile"]
    assert profile["steps"] == 3 and profile["wall_ms"] > 0

    # --resume, as after a lease's end or GPU_CHECK_DEADLINE cut the last two steps: only those run again, into the
    # same summary, and every step the first run passed is kept as it was
    lines = (tmp_path / "out" / "steps.jsonl").read_text().splitlines()
    cut = ["generate_demo_size_model_default", "generate_check_size_model_default"]
    kept = [l for l in lines if json.loads(l)["step"] not in cut]
    skipped = [json.dumps({"step": name, "rc": -1, "seconds": 0, "skipped": "deadline"}) for name in cut]
    (tmp_path / "out" / "steps.jsonl").write_text("\n".join(kept + skipped) + "\n")
    for name in cut:
        shutil.rmtree(tmp_path / name)
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path), "--resume"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert res.stdout.count("passed in an earlier run (--resume), kept") == len(steps) - len(cut)
    again = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert again["passed"] and [s["step"] for s in again["steps"]] == [s["step"] for s in summary["steps"]]
    before = {s["step"]: s["seconds"] for s in summary["steps"]}
    for s in again["steps"]:
        assert s["rc"] == 0 and (s["seconds"] == before[s["step"]]) == (s["step"] not in cut)
    assert all((tmp_path / name / "manifest.json").is_file() for name in cut)
