"""``rlhf bench --only overlap``: overlapped iterations (``rlhf iterate --overlap 1``) against sequential ones, wall
time per iteration, both in the same run; and a model of what overlapping buys on a GPU node.

Both sides are ``rlhf iterate`` with REBEL on the same random-initialised policy (``SIZES``), the topics task's
prompts and its python reward (no reward model), ``ITERATIONS`` iterations:

- sequential (the peer column): one stage at a time, each with every core;
- overlapped (ours): the sampling side (generate, score, filter) pinned to one core and the training side to
  another (``taskset`` in each stage's launcher, one torch thread each), where there are two cores and taskset.

Generation runs vLLM in its own environment when there is one (``RLHF_VLLM_PYTHON``, else ``.venv-vllm`` in the
repository), else the hf engine; the entry says which. Per iteration: the loop's wall time in ``steps.jsonl``, from
the first stage's start to the last one's end, over the iterations. Once under way an overlapped iteration costs the
longer of its two sides, so overlapping pays most where the phases take about the same time and where neither
gets much faster with the cores the other side would take (here: vLLM's start-up); the first sampling and the last
training still run alone.

The model (``Phase`` and below) is the same arithmetic with GPUs: each stage's time is a fixed part plus
GPU-seconds of work shared by its GPUs, so splitting a node gains only from the fixed parts; ``cluster_table`` puts
our estimates of REBEL's 8B recipe through it."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf_pipeline.bench.common import Entry
from rlhf_pipeline.machine import usable_cores

ITERATIONS = 4
TARGET = 1.3
# Prompts per iteration, responses per prompt, new tokens, training epochs, the policy's width and depth; quick /
# full. Chosen so that the two phases take about the same time on 2 CPU cores: sampling is mostly vLLM's start-up
# (the same whatever the prompts), so the training side is made as long by a wider policy (512 x 4 layers, 13M
# parameters) and epochs, not by more prompts (which lengthen both). The full setting doubles the prompts and
# halves the epochs: the same training work on more samples.
SIZES = {True: {"prompts": 96, "n": 4, "max_new_tokens": 32, "epochs": 10, "hidden_size": 512, "num_layers": 4},
         False: {"prompts": 192, "n": 4, "max_new_tokens": 32, "epochs": 5, "hidden_size": 512, "num_layers": 4}}
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

    size = SIZES[quick]
    policy, data = workdir / f"policy_{size['hidden_size']}x{size['num_layers']}", workdir / "data"
    if not (policy / "config.json").exists():
        save_tiny_model(policy, kind="policy", seed=0, hidden_size=size["hidden_size"], num_layers=size["num_layers"])
    prompts = write_task_data(data, seed=0)["prompts"]
    vllm = vllm_python()
    cores = usable_cores()
    pin = overlap and len(cores) >= 2 and shutil.which("taskset") is not None
    sample_launch = ["taskset", "-c", str(cores[0])] if pin else []
    train_launch = ["taskset", "-c", str(cores[1])] if pin else []
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
        config["lane_env"] = {"sample": {**threads, **({"VLLM_CPU_OMP_THREADS_BIND": str(cores[0])} if pin else {})},
                              "train": threads}
    return config


def per_iteration(run: Path) -> dict[str, Any]:
    """A finished run's seconds per iteration, from its steps.jsonl: once under way (from the end of the first
    iteration to the end of the last, over the iterations between: what each iteration adds) and over the whole run
    (its wall time over the iterations: the first sampling and the last training, which an overlapped run does
    alone, included); and each stage's total."""
    from rlhf_pipeline.stages.report import read_schedule

    records = read_schedule(run)
    wall = max(r["ended"] for r in records) - min(r["started"] for r in records)
    stages: dict[str, float] = {}
    ends: dict[int, float] = {}
    for r in records:
        it, _, stage = r["step"].partition("/")
        stages[stage] = round(stages.get(stage, 0.0) + r["ended"] - r["started"], 2)
        t = int(it.rpartition("_")[2])
        ends[t] = max(ends.get(t, 0.0), r["ended"])
    iterations = len(ends)
    first, last = min(ends), max(ends)
    under_way = (ends[last] - ends[first]) / (iterations - 1) if iterations > 1 else wall
    sampling = sum(v for k, v in stages.items() if k != "train") / iterations
    return {"seconds_per_iteration": round(under_way, 2),
            "whole_run_seconds_per_iteration": round(wall / iterations, 2), "wall_seconds": round(wall, 2),
            "stage_seconds": stages,
            "phase_seconds_per_iteration": {"sampling": round(sampling, 2),
                                            "training": round(stages.get("train", 0.0) / iterations, 2)}}


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
    median = {name: {key: statistics.median(r[key] for r in runs)
                     for key in ("seconds_per_iteration", "whole_run_seconds_per_iteration")}
              for name, runs in sides.items()}
    ours, peer = median["overlapped"]["seconds_per_iteration"], median["sequential"]["seconds_per_iteration"]
    whole = (median["sequential"]["whole_run_seconds_per_iteration"]
             / median["overlapped"]["whole_run_seconds_per_iteration"])
    engine = "vLLM (its own environment)" if vllm_python() else "hf (no vLLM environment found)"
    last = {name: runs[-1] for name, runs in sides.items()}
    phases = last["overlapped"]["phase_seconds_per_iteration"]
    entry = Entry(
        name="overlap_iterations", ours=round(ours, 2), peer=round(peer, 2), unit="s per iteration",
        ratio=peer / ours, target=TARGET,
        details={"rounds": sides, "sizes": SIZES[config.quick], "engine": engine, "iterations": ITERATIONS,
                 "whole_run_ratio": round(whole, 3)},
        notes=f"rlhf iterate, REBEL, {ITERATIONS} iterations on the topics task, generation with {engine}: "
              "overlapped (--overlap 1, sampling on one core, training on another) against sequential (every stage "
              "on every core); seconds per iteration once under way (from the first iteration's end to the last's, "
              f"over the {ITERATIONS - 1} iterations between), median of {rounds} round(s). Over the whole run "
              f"(wall time over {ITERATIONS} iterations, the overlapped run's first sampling and last training "
              f"alone included) the ratio is {whole:.2f}. Phases per iteration, overlapped side, last round: "
              f"sampling {phases['sampling']:.1f} s, training {phases['training']:.1f} s. Stage seconds, last round: "
              f"overlapped {last['overlapped']['stage_seconds']}, sequential {last['sequential']['stage_seconds']}.",
    )
    table = ["| side | s per iteration once under way (each round) | over the whole run (each round) | generate | "
             "score | filter | train (s, last round) |", "|---|---|---|---|---|---|---|"]
    for name, runs in sides.items():
        s = runs[-1]["stage_seconds"]
        per = ", ".join(f"{x['seconds_per_iteration']:.1f}" for x in runs)
        whole_run = ", ".join(f"{x['whole_run_seconds_per_iteration']:.1f}" for x in runs)
        table.append(f"| {name} | {per} | {whole_run} | "
                     + " | ".join(f"{s.get(k, 0):.1f}" for k in ("generate", "score", "filter", "train")) + " |")
    model = {"title": "Overlapped iterations on a GPU node, modelled (estimates, not measurements)",
             "markdown": "REBEL's 8B recipe on H100s, the phase times of `bench/overlap.py`'s `REBEL_8B_SAMPLING` "
                         "and `REBEL_8B_TRAINING`. Overlapped cells: minutes an iteration once under way (its "
                         f"speed-up; the speed-up over the recipe's {REBEL_ITERATIONS} iterations).\n\n"
                         + cluster_table()}
    return [entry], [{"title": "Overlapped against sequential iterations", "markdown": "\n".join(table)}, model]


# ----------------------------------------------------------------------------------------------------------------
# A GPU node, modelled: what overlapping buys where each side gets part of the GPUs


@dataclass(frozen=True)
class Phase:
    """One stage's time on ``g`` GPUs: ``fixed`` seconds that more GPUs do not shorten (start-up, loading, saving,
    the longest responses' tail, CPU work) plus ``work`` GPU-seconds shared by the ``g``."""

    stage: str
    fixed: float
    work: float

    def seconds(self, gpus: int) -> float:
        return self.fixed + self.work / gpus


def side_seconds(phases: Sequence[Phase], gpus: int) -> float:
    """One side's stages, one after the other, on ``gpus``."""
    return sum(p.seconds(gpus) for p in phases)


def sequential_seconds(sampling: Sequence[Phase], training: Sequence[Phase], gpus: int) -> float:
    """An iteration of a sequential run: every stage in turn, each on all ``gpus``."""
    return side_seconds(sampling, gpus) + side_seconds(training, gpus)


def overlapped_seconds(sampling: Sequence[Phase], training: Sequence[Phase], sample_gpus: int,
                       train_gpus: int) -> float:
    """An iteration of an overlapped run once it is under way: the longer of the two sides, each on its own GPUs."""
    return max(side_seconds(sampling, sample_gpus), side_seconds(training, train_gpus))


def whole_run(sample_side: float, train_side: float, iterations: int) -> float:
    """An overlapped run of ``iterations`` from its two sides' seconds an iteration: the first sampling and the last
    training run alone, every other iteration costs the longer side."""
    return sample_side + (iterations - 1) * max(sample_side, train_side) + train_side


def best_split(sampling: Sequence[Phase], training: Sequence[Phase], gpus: int,
               min_train_gpus: int = 1) -> tuple[int, float]:
    """The sampling side's share of ``gpus`` (the rest train, at least ``min_train_gpus`` of them: what the
    training's memory needs) that makes an overlapped iteration shortest, and its seconds."""
    if gpus - min_train_gpus < 1:
        raise ValueError(f"{gpus} GPUs leave none to sample on beside the {min_train_gpus} that training needs")
    return min(((k, overlapped_seconds(sampling, training, k, gpus - k)) for k in range(1, gpus - min_train_gpus + 1)),
               key=lambda x: x[1])


def with_pool(sampling: Sequence[Phase], training: Sequence[Phase], gpus: int, pool: int,
              overlapped_training: Sequence[Phase] | None = None) -> tuple[float, float, float]:
    """``gpus`` that train plus a pool of ``pool`` more GPUs that only generate (Ray replicas): the seconds of a
    sequential iteration (generate on all ``gpus + pool``, every other stage on the ``gpus``), and the two sides of
    an overlapped one: sampling (generate on the pool, then scoring on the training GPUs) and the training GPUs'
    (``overlapped_training``, default ``training``, plus the scoring work they share with it)."""
    pooled = [p for p in sampling if p.stage == "generate"]
    local = [p for p in sampling if p.stage != "generate"]
    sequential = side_seconds(pooled, gpus + pool) + side_seconds(local, gpus) + side_seconds(training, gpus)
    sample_side = side_seconds(pooled, pool) + side_seconds(local, gpus)
    node = side_seconds(overlapped_training or training, gpus) + sum(p.work / gpus for p in local)
    return sequential, sample_side, node


# Our estimates of one iteration of REBEL's 8B recipe (Llama-3-8B-Instruct sampled 5 times on each of 60k
# UltraFeedback prompts, scored by ArmoRM, trained on the 60k best/worst pairs) on H100s, for the model above.
# Assumed: 400 tokens a response and 200 a prompt on average; vLLM at 4,000 output tokens/s per GPU (one bf16
# replica a GPU; cluster_table also shows 12,000); forward and backward passes at 40% and 35% of the H100's 989
# dense bf16 TFLOP/s.
#   generate: 300k responses x 400 tokens / 4,000 per s = 30,000 GPU-s; fixed: the engine's start (16 GB of
#             weights, CUDA graphs), about 90 s, and the longest responses' tail, about 60 s
#   score:    300k x 600 tokens x 2 x 7.5e9 FLOPs / 396 TFLOP/s = 6,800 GPU-s; fixed: loading ArmoRM, 60 s
#   filter:   one CPU process, 120 s
#   train:    the reference pass (2 x 8e9 FLOPs a token) and the update (6 x 8e9; 8 x 8e9 with gradient
#             checkpointing, as the recipe's config sets) over 60k x 2 x 600 tokens at 346 TFLOP/s = 16,700 GPU-s;
#             fixed: DeepSpeed's start, loading, checkpoints and the final save, 300 s. Overlapped, REBEL loads the
#             sampler as its reference (a second model, for the reference pass alone): 60 s more.
#   memory:   ZeRO-3 training holds 16 bytes a parameter (128 GB at 8B) over its GPUs, plus activations: at least
#             3 H100s of 80 GB, so the training side is never given fewer
REBEL_8B_SAMPLING = (Phase("generate", 150.0, 30_000.0), Phase("score", 60.0, 6_800.0), Phase("filter", 120.0, 0.0))
REBEL_8B_TRAINING = (Phase("train", 300.0, 16_700.0),)
OVERLAPPED_REFERENCE = Phase("load the sampler as reference", 60.0, 0.0)
REBEL_8B_MIN_TRAIN_GPUS = 3
REBEL_ITERATIONS = 3


def with_generation(sampling: Sequence[Phase], tokens_per_second_factor: float = 1.0, tail_share: float = 0.0,
                    gpus: int = 8) -> tuple[Phase, ...]:
    """``sampling`` with generate ``tokens_per_second_factor`` times as fast, and ``tail_share`` of its time on
    ``gpus`` fixed (the longest responses keeping the batch waiting, which more replicas do not shorten: long
    reasoning rollouts)."""
    out = []
    for p in sampling:
        if p.stage == "generate":
            p = Phase(p.stage, p.fixed, p.work / tokens_per_second_factor)
            total = p.seconds(gpus)
            p = Phase(p.stage, p.fixed + tail_share * (total - p.fixed), (1 - tail_share) * p.work)
        out.append(p)
    return tuple(out)


def cluster_table(sampling: Sequence[Phase] = REBEL_8B_SAMPLING, training: Sequence[Phase] = REBEL_8B_TRAINING,
                  gpus: int = 8, min_train_gpus: int = REBEL_8B_MIN_TRAIN_GPUS,
                  iterations: int = REBEL_ITERATIONS) -> str:
    """Markdown: one iteration on ``gpus`` GPUs, sequential against overlapped with the GPUs split evenly and at the
    best split, and with a pool of ``gpus`` more that only generate; as estimated, with generation three times
    as fast, and with half of generation a tail. Each overlapped cell: minutes an iteration once under way, its
    speed-up, and the speed-up over a whole run of ``iterations``."""
    overlapped_training = (*training, OVERLAPPED_REFERENCE)

    def cell(seq: float, sample_side: float, train_side: float) -> str:
        per = max(sample_side, train_side)
        whole = iterations * seq / whole_run(sample_side, train_side, iterations)
        return f"{per / 60:.0f} ({seq / per:.2f}; {whole:.2f})"

    def row(label: str, sampling: Sequence[Phase]) -> str:
        seq = sequential_seconds(sampling, training, gpus)
        half = gpus // 2
        k, _ = best_split(sampling, overlapped_training, gpus, min_train_gpus)
        pool_seq, *pool_sides = with_pool(sampling, training, gpus, gpus, overlapped_training)
        def split(k: int) -> str:
            return cell(seq, side_seconds(sampling, k), side_seconds(overlapped_training, gpus - k))

        return f"| {label} | {seq / 60:.0f} | {split(half)} | {k}/{gpus - k}: {split(k)} | {pool_seq / 60:.0f} | " \
               f"{cell(pool_seq, *pool_sides)} |"

    lines = [f"| generation | sequential, {gpus} GPUs: min an iteration | overlapped {gpus // 2}/{gpus - gpus // 2} | "
             f"overlapped, the best split (≥ {min_train_gpus} training) | sequential, {gpus} + {gpus} that only "
             f"generate | overlapped, those {gpus} generate, the {gpus} score and train |",
             "|---|---|---|---|---|---|"]
    lines.append(row("as estimated (4,000 tokens/s a GPU)", sampling))
    lines.append(row("3× as fast (12,000 tokens/s)", with_generation(sampling, 3.0, gpus=gpus)))
    lines.append(row("half of it a tail", with_generation(sampling, 1.0, 0.5, gpus=gpus)))
    return "\n".join(lines)
