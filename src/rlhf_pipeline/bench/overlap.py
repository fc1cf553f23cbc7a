"""``rlhf bench --only overlap``: overlapped iterations (``rlhf iterate --overlap 1``) against sequential ones, wall
time per iteration, both in the same run.

Both sides are ``rlhf iterate`` with REBEL on the same tiny policy, the topics task's prompts and its python reward
(no reward model), ``ITERATIONS`` iterations:

- sequential (the peer column): one stage at a time, each with every core;
- overlapped (ours): the sampling side (generate, score, filter) pinned to core 0 and the training side to core 1
  (``taskset`` in each stage's launcher, one torch thread each), where there are two cores and taskset.

Generation runs vLLM in its own environment when there is one (``RLHF_VLLM_PYTHON``, else ``.venv-vllm`` in the
repository), else the hf engine; the entry says which. Per iteration: the loop's wall time in ``steps.jsonl``, from
the first stage's start to the last one's end, over the iterations. Overlapping pays most where sampling and
training take about the same time (the ideal ratio is then about 2); with one phase much longer than the other the
best it can do is (sampling + training) / the longer one.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from rlhf_pipeline.bench.common import Entry

ITERATIONS = 3
TARGET = 1.3
# prompts per iteration, responses per prompt, new tokens, training epochs; quick / full. On 2 CPU cores sampling
# (vLLM's start-up included) still takes several times longer than training at these sizes, which bounds the ratio
# well below the 2 that equal phases would allow (docs/benchmarks.md has the phase times)
SIZES = {True: {"prompts": 48, "n": 4, "max_new_tokens": 24, "epochs": 2},
         False: {"prompts": 128, "n": 4, "max_new_tokens": 32, "epochs": 2}}
REPO = Path(__file__).resolve().parents[3]


def vllm_python() -> Optional[str]:
    """The vLLM environment's python: RLHF_VLLM_PYTHON, or the repository's .venv-vllm, or None."""
    explicit = os.environ.get("RLHF_VLLM_PYTHON")
    if explicit:
        return explicit
    candidate = REPO / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.is_file() else None


def run_config(workdir: Path, name: str, overlap: bool, quick: bool) -> dict[str, Any]:
    """The rlhf iterate config of one side."""
    from rlhf_pipeline.demo.topics import write_task_data
    from rlhf_pipeline.tiny import save_tiny_model

    policy, data = workdir / "policy", workdir / "data"
    if not (policy / "config.json").exists():
        save_tiny_model(policy, kind="policy", seed=0)
    prompts = write_task_data(data, seed=0)["prompts"]
    size = SIZES[quick]
    vllm = vllm_python()
    pin = overlap and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    sample_launch = ["taskset", "-c", "0"] if pin else []
    train_launch = ["taskset", "-c", "1"] if pin else []
    launchers = {
        "generate": " ".join(sample_launch + [vllm or sys.executable]),
        "score": " ".join(sample_launch + [sys.executable]),
        "filter": " ".join(sample_launch + [sys.executable]),
        "train": " ".join(train_launch + [sys.executable]),
    }
    config: dict[str, Any] = {
        "output": str(workdir / name), "model": str(policy), "prompts": str(prompts), "iterations": ITERATIONS,
        "prompts_per_iteration": size["prompts"], "algo": "rebel",
        "reward_fn": "rlhf_pipeline.demo.topics:gold_reward", "launchers": launchers,
        "generate": {"n": size["n"], "max_new_tokens": size["max_new_tokens"], "temperature": 0.8,
                     "engine": "vllm" if vllm else "hf", "seed": 0},
        "filter": {"test_size": 0.1, "seed": 0},
        "train": {"batch_size": 8, "epochs": size["epochs"], "learning_rate": 3e-4, "report_to": "none", "seed": 0},
        "overlap": int(overlap),
    }
    if overlap:
        threads = {"OMP_NUM_THREADS": 1} if pin else {}
        config["lane_env"] = {"sample": {**threads, **({"VLLM_CPU_OMP_THREADS_BIND": "0"} if pin else {})},
                              "train": threads}
    return config


def per_iteration(run: Path) -> dict[str, Any]:
    """Seconds per iteration of a finished run, from its steps.jsonl, and each stage's total."""
    from rlhf_pipeline.stages.report import read_schedule

    records = read_schedule(run)
    wall = max(r["ended"] for r in records) - min(r["started"] for r in records)
    stages: dict[str, float] = {}
    for r in records:
        stage = r["step"].rpartition("/")[2]
        stages[stage] = round(stages.get(stage, 0.0) + r["ended"] - r["started"], 2)
    return {"seconds_per_iteration": wall / ITERATIONS, "wall_seconds": round(wall, 2), "stage_seconds": stages}


def run_side(workdir: Path, name: str, overlap: bool, quick: bool) -> dict[str, Any]:
    config = run_config(workdir, name, overlap, quick)
    shutil.rmtree(config["output"], ignore_errors=True)
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    env = dict(os.environ, TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, "-m", "rlhf_pipeline.stages.iterate", "--config", str(path)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return per_iteration(Path(config["output"]))


def run(config, workdir: Path) -> tuple[list[Entry], list[dict[str, Any]]]:
    workdir.mkdir(parents=True, exist_ok=True)
    rounds = max(1, config.num_rounds - 1)
    sides: dict[str, list[dict[str, Any]]] = {"overlapped": [], "sequential": []}
    for r in range(rounds):  # alternate which side runs first, so that neither always runs on a warmer machine
        order = ["overlapped", "sequential"] if r % 2 == 0 else ["sequential", "overlapped"]
        for name in order:
            sides[name].append(run_side(workdir, name, name == "overlapped", config.quick))
    ours = statistics.median(s["seconds_per_iteration"] for s in sides["overlapped"])
    peer = statistics.median(s["seconds_per_iteration"] for s in sides["sequential"])
    engine = "vLLM (its own environment)" if vllm_python() else "hf (no vLLM environment found)"
    last = {name: runs[-1] for name, runs in sides.items()}
    entry = Entry(
        name="overlap_iterations", ours=round(ours, 2), peer=round(peer, 2), unit="s per iteration",
        ratio=peer / ours, target=TARGET, details={"rounds": sides, "sizes": SIZES[config.quick], "engine": engine},
        notes=f"rlhf iterate, REBEL, {ITERATIONS} iterations on the topics task, generation with {engine}: "
              "overlapped (--overlap 1, sampling on core 0, training on core 1) against sequential (every stage on "
              "every core); wall time per iteration, median of "
              f"{rounds} round(s). Stage seconds, last round: overlapped {last['overlapped']['stage_seconds']}, "
              f"sequential {last['sequential']['stage_seconds']}.",
    )
    table = ["| side | s per iteration (each round) | generate | score | filter | train |", "|---|---|---|---|---|---|"]
    for name, runs in sides.items():
        s = runs[-1]["stage_seconds"]
        per = ", ".join(f"{x['seconds_per_iteration']:.1f}" for x in runs)
        table.append(f"| {name} | {per} | "
                     + " | ".join(f"{s.get(k, 0):.1f}" for k in ("generate", "score", "filter", "train")) + " |")
    return [entry], [{"title": "Overlapped against sequential iterations", "markdown": "\n".join(table)}]
