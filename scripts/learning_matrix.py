"""Every algorithm on every bundled demo task, with its documented defaults: does it learn? (Not run in CI.)

For each task of ``rlhf_pipeline.demo.TASKS`` and each entry of the algorithm registry (and LoRA adapters on one
pair and one group algorithm, the settings of ``CANDIDATES`` beside the defaults: REBEL with
``--reward-gap-scale rms``, GSPO with the paper's clip and ten times it, SPPO with eta 1 and 10, and REBEL and GRPO
with overlapped iterations, ``rlhf demo --overlap 1``), runs
``rlhf demo --task T --algo A`` (3 iterations, the demo's sizes) into ``OUTPUT/T/A/`` and reads its
``summary.json``: the held-out gold reward of iterations 0..3 and the gain of iteration 3 over iteration 0 in
combined standard errors. Writes ``OUTPUT/matrix.json`` and ``OUTPUT/matrix.md`` (the table
of docs/algorithms.md), after every run, so an interrupted matrix keeps what it has; run the same command again and
finished runs are read, not redone (each demo resumes).

    python scripts/learning_matrix.py --output runs/matrix                 # everything: about 80 runs
    python scripts/learning_matrix.py --output runs/matrix --tasks topics --algos rebel dpo ppo

A cell "learns" when its gain is above 2 combined standard errors (LEARNS). For the PPO family each row also keeps,
per iteration, the training steps and the fraction of tokens the clip bound, over the whole iteration and over its
last quarter of steps (``ppo/train_clip_frac`` of ``iter_t/train/metrics.jsonl``): ``clip_frac``, ``clip_frac_end``.

``--train`` adds rlhf train options to every run, e.g. the setting of many steps per rollout (batch 8, 2 epochs):

    python scripts/learning_matrix.py --output runs/matrix_b8e2 --train '{batch_size: 8, epochs: 2}' --algos sppo gspo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlhf_pipeline.algorithms import ALGORITHMS  # noqa: E402
from rlhf_pipeline.demo import TASKS  # noqa: E402

LEARNS = 2.0
# LoRA instead of full fine-tuning, for one pair and one group algorithm (the settings docs/stages.md documents)
LORA = {"lora_rank": 16, "learning_rate": 3e-3}
LORA_RUNS = {"dpo+lora": ("dpo", LORA), "grpo+lora": ("grpo", LORA)}
# Settings beside the defaults: REBEL with its reward gaps rescaled to unit RMS, against the paper's raw gaps; GSPO
# with the paper's clip (3e-4 / 4e-4) and ten times it, against its default of a hundred times it, for a rollout
# that feeds a whole epoch of updates; SPPO with eta 1 (REBEL's, its default before) and 10, against its 100
CANDIDATES = {"rebel+rms": ("rebel", {"reward_gap_scale": "rms"}),
              "gspo+paper": ("gspo", {"clip": 3e-4, "clip_high": 4e-4}),
              "gspo+clip10x": ("gspo", {"clip": 3e-3, "clip_high": 4e-3}),
              "sppo+eta1": ("sppo", {"eta": 1.0}),
              "sppo+eta10": ("sppo", {"eta": 10.0})}
# Overlapped iterations (rlhf demo --overlap 1: iteration t+1 sampled by pi_{t-1} while iteration t trains), for a
# pair and a group algorithm, against their sequential rows; each side of an overlapped demo runs with half of the
# cores' threads, so compare it with sequential rows run with as many (OMP_NUM_THREADS=1 on 2 cores)
OVERLAP_RUNS = {"rebel+overlap": ("rebel", {}), "grpo+overlap": ("grpo", {})}
DEMO_ARGS = {name: ["--overlap", "1"] for name in OVERLAP_RUNS}


def settings(algos: list[str] | None) -> dict[str, tuple[str, dict]]:
    every = {name: (name, {}) for name in ALGORITHMS} | LORA_RUNS | CANDIDATES | OVERLAP_RUNS
    return every if not algos else {k: every[k] for k in algos}


def clip_fractions(run: Path) -> dict[str, list]:
    """Per iteration: its training steps, and the mean clip fraction over them and over their last quarter."""
    steps, whole, end = [], [], []
    for metrics in sorted(run.glob("iter_*/train/metrics.jsonl"), key=lambda p: int(p.parts[-3].split("_")[1])):
        values = [r["ppo/train_clip_frac"] for r in map(json.loads, metrics.read_text().splitlines())
                  if "ppo/train_clip_frac" in r]
        if values:
            steps.append(len(values))
            whole.append(round(sum(values) / len(values), 3))
            last = values[-max(1, len(values) // 4):]
            end.append(round(sum(last) / len(last), 3))
    return {"train_steps": steps, "clip_frac": whole, "clip_frac_end": end} if steps else {}


def run_one(task: str, name: str, algo: str, train: dict, out: Path, log: Path) -> dict:
    cmd = [sys.executable, "-m", "rlhf_pipeline.cli", "demo", "--task", task, "--algo", algo, "--output", str(out),
           *DEMO_ARGS.get(name, [])]
    if train:
        cmd += ["--train", json.dumps(train)]
    started = time.time()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        status = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    row = {"task": task, "setting": name, "algo": algo, "train": train, "exit": status,
           "wall_s": round(time.time() - started, 1), "command": " ".join(cmd[2:])}
    summary = out / "summary.json"
    if status == 0 and summary.exists():
        s = json.loads(summary.read_text())
        row.update(gold=[r["gold_reward_mean"] for r in s["iterations"]],
                   stderr=[r["gold_reward_stderr"] for r in s["iterations"]],
                   gain=s["gold_gain"], gain_se=s["gold_gain_in_combined_stderr"], **clip_fractions(out))
    return row


def table(rows: list[dict], tasks: list[str]) -> str:
    by = {(r["task"], r["setting"]): r for r in rows}
    names = list(dict.fromkeys(r["setting"] for r in rows))
    lines = ["| setting | " + " | ".join(f"{t}: gold reward 0 → 3 (gain in s.e.)" for t in tasks) + " |",
             "|---|" + "---|" * len(tasks)]
    for name in names:
        cells = []
        for t in tasks:
            r = by.get((t, name))
            if r is None:
                cells.append("–")
            elif "gain_se" not in r:
                cells.append(f"failed (exit {r['exit']})")
            else:
                mark = "" if r["gain_se"] > LEARNS else " **below 2**"
                cells.append(f"{r['gold'][0]:+.3f} → {r['gold'][-1]:+.3f} ± {r['stderr'][-1]:.3f} "
                             f"({r['gain_se']:.1f}){mark}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="runs/matrix")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--algos", nargs="+", choices=list(settings(None)), default=None,
                        help="settings to run (default: every registry entry and the LoRA runs)")
    parser.add_argument("--train", type=yaml.safe_load, default={},
                        help="rlhf train options added to every run (a YAML mapping), e.g. '{batch_size: 8, epochs: 2}'")
    args = parser.parse_args()
    if not isinstance(args.train, dict):
        parser.error(f"--train {args.train!r}: expected a YAML mapping, e.g. '{{batch_size: 8, epochs: 2}}'")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    # the rows of earlier invocations into the same output (other tasks or settings) are kept
    rows = json.loads((out / "matrix.json").read_text()) if (out / "matrix.json").exists() else []
    ran = []
    order = list(settings(None))  # the table's row order: the registry's, then LoRA and the candidates
    for task in args.tasks:
        for name, (algo, train) in settings(args.algos).items():
            print(f"[matrix] {task} / {name}", flush=True)
            r = run_one(task, name, algo, {**train, **args.train}, out / task / name, out / "matrix.log")
            rows = [x for x in rows if (x["task"], x["setting"]) != (task, name)] + [r]
            ran.append(r)
            print(f"[matrix] {task} / {name}: " + (f"gain {r['gain_se']:.1f} s.e. in {r['wall_s']:.0f}s"
                                                   if "gain_se" in r else f"exit {r['exit']}"), flush=True)
            (out / "matrix.json").write_text(json.dumps(rows, indent=2) + "\n")
            rows.sort(key=lambda x: (order.index(x["setting"]) if x["setting"] in order else len(order)))
            (out / "matrix.md").write_text(table(rows, [t for t in TASKS if any(x["task"] == t for x in rows)]))
    return 0 if all("gain_se" in r for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
