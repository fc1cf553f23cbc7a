"""``memory_growth_<stage>``: how a data stage's peak memory grows with its rows.

For each of generate, score, filter, ref-logps and eval, the stage runs on synthetic data at three sizes 10x apart
(the tiny model kit, a python reward), each run in a fresh process so that peaks do not mix. The process imports
everything first and notes its anonymous memory (``RssAnon``: what the process holds, not the page cache of the
memory-mapped datasets it reads); a thread samples it every 2 ms while the stage runs, and the stage's peak memory is
the highest sample minus that baseline: what the run added, not the interpreter and its libraries. The entry's ``ours`` is the least
squares slope of log(peak increment) against log(rows): about 1 for a stage that holds every row, about 0 for one
whose memory stays flat; the target is 0.2 or less. The rows are made long (prompts and responses of a few hundred
words) so that holding them would show: at the largest size they are tens of MB as text, and more as Python lists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.common import Entry, growth_exponent

STAGES = ("generate", "score", "filter", "ref_logps", "eval")
TARGET = 0.2
QUICK_SIZES = (100, 1000, 10000)
FULL_SIZES = (300, 3000, 30000)
WORDS = "the park was quiet and the trees were tall and the lake was calm in the morning light".split()
REWARD = "def reward(prompts, responses, **columns):\n    return [len(r) / 100 for r in responses]\n"


def _text(i: int, words: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)) + f" {i}."


def make_inputs(directory: Path, rows: int, policy: Path) -> dict[str, Path]:
    """Synthetic inputs of ``rows`` rows for every stage, saved with ``save_to_disk`` (read back memory-mapped)."""
    from datasets import Dataset

    from rlhf_pipeline.chat import load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(str(policy))
    paths = {name: directory / name for name in ("prompts", "generations", "scored", "pairs")}
    (directory / "reward.py").write_text(REWARD)

    def prompts(batch_rows):
        return {"prompt": [_text(i, 200) for i in batch_rows]}

    def generations(batch_rows):
        return {"prompt_id": [f"p{i}" for i in batch_rows], "prompt": [_text(i, 40) for i in batch_rows],
                "responses": [[_text(i + j, 150) for j in range(4)] for i in batch_rows]}

    def scored(batch_rows):
        out = generations(batch_rows)
        ids = [[tok(r, add_special_tokens=False)["input_ids"][:120] for r in rs] for rs in out["responses"]]
        out.update(prompt_token_ids=[tok(p)["input_ids"] for p in out["prompt"]], response_token_ids=ids,
                   rewards=[[float((i + j) % 5) for j in range(4)] for i in batch_rows],
                   finish_reasons=[["stop"] * 4 for _ in batch_rows])
        return out

    def pairs(batch_rows):
        ids = [tok(_text(i, 60), add_special_tokens=False)["input_ids"][:48] for i in batch_rows]
        return {"prompt_id": [f"p{i}" for i in batch_rows], "prompt_token_ids": ids,
                "chosen_token_ids": [x[::-1] for x in ids], "rejected_token_ids": [x[1::2] for x in ids],
                "chosen_reward": [1.0] * len(batch_rows), "rejected_reward": [0.0] * len(batch_rows)}

    for name, fn in (("prompts", prompts), ("generations", generations), ("scored", scored), ("pairs", pairs)):
        Dataset.from_dict({"_row": list(range(rows))}).map(
            lambda b, fn=fn: fn(b["_row"]), batched=True, batch_size=1000, remove_columns=["_row"],
        ).save_to_disk(str(paths[name]))
    return paths


def stage_argv(stage: str, inputs: dict[str, Path], policy: Path, out: Path) -> list[str]:
    """The stage's command line (after ``rlhf``) on the synthetic inputs."""
    reward = f"{inputs['prompts'].parent / 'reward.py'}:reward"
    small = ["--max-new-tokens", "8", "--engine", "hf", "--batch-size", "64"]
    return {
        "generate": ["generate", "--model", str(policy), "--prompts", str(inputs["prompts"]), "--n", "2", *small],
        "score": ["score", "--input", str(inputs["generations"]), "--reward-fn", reward],
        "filter": ["filter", "--input", str(inputs["scored"]), "--tokenizer", str(policy), "--test-size", "0.1"],
        "ref_logps": ["ref-logps", "--model", str(policy), "--input", str(inputs["pairs"]), "--temperature", "1",
                      "--batch-size", "64"],
        "eval": ["eval", "--model", str(policy), "--prompts", str(inputs["prompts"]), "--reward-fn", reward, *small],
    }[stage] + ["--output", str(out)]


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(argv: list[str]) -> dict[str, Any]:
    """In a fresh process: import what the stage imports, note the memory, run the stage while a thread samples the
    memory every 2 ms, report the baseline and the peak. Anonymous memory (``RssAnon``): what the process holds, not
    the pages of memory-mapped datasets it reads, which are the kernel's page cache and grow with any file read."""
    import threading

    import datasets  # noqa: F401  the libraries the stages load, before the baseline
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from rlhf_pipeline.stages import eval, filter, generate, ref_logps, score

    program = {"generate": generate, "score": score, "filter": filter, "ref-logps": ref_logps, "eval": eval}[argv[0]]
    baseline = _status("RssAnon")
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], _status("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.time()
    try:
        rc = program.cli(argv[1:])
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    return {"rc": rc, "baseline": baseline, "peak": peak[0], "seconds": round(time.time() - t0, 2)}


def measure(stage: str, sizes: tuple[int, ...], scratch: Path, policy: Path) -> dict[str, Any]:
    """Peak-memory increments of ``stage`` at ``sizes``, each in a fresh process, and their growth exponent."""
    increments, runs = [], []
    for rows in sizes:
        inputs = {k: scratch / f"inputs_{rows}" / k for k in ("prompts", "generations", "scored", "pairs")}
        out = scratch / f"{stage}_{rows}"
        env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        code = ("import json, sys; from rlhf_pipeline.bench.memory import child; "
                "print('MEMORY ' + json.dumps(child(sys.argv[1:])))")
        res = subprocess.run([sys.executable, "-c", code, *stage_argv(stage, inputs, policy, out)],
                             capture_output=True, text=True, env=env)
        lines = [line for line in res.stdout.splitlines() if line.startswith("MEMORY ")]
        if res.returncode != 0 or not lines or json.loads(lines[-1][7:])["rc"] != 0:
            raise RuntimeError(f"memory bench: {stage} at {rows} rows failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        record = json.loads(lines[-1][7:])
        increments.append(max(record["peak"] - record["baseline"], 1 << 20))  # at least 1 MiB: log of a positive
        runs.append({"rows": rows, "increment_mb": round(increments[-1] / 2**20, 1),
                     "baseline_mb": round(record["baseline"] / 2**20, 1), "seconds": record["seconds"]})
    return {"exponent": growth_exponent(list(sizes), increments), "runs": runs}


def run(config, scratch: Path) -> tuple[list[Entry], list[dict[str, Any]]]:
    from rlhf_pipeline.tiny import save_tiny_model

    sizes = QUICK_SIZES if config.quick else FULL_SIZES
    scratch.mkdir(parents=True, exist_ok=True)
    policy = scratch / "policy"
    if not (policy / "config.json").exists():
        save_tiny_model(policy)
    for rows in sizes:
        if not (scratch / f"inputs_{rows}" / "pairs").exists():
            make_inputs(scratch / f"inputs_{rows}", rows, policy)
    entries, table = [], ["| stage | " + " | ".join(f"{r} rows" for r in sizes) + " | exponent |",
                          "|---|" + "---|" * len(sizes) + "---|"]
    for stage in STAGES:
        result = measure(stage, sizes, scratch, policy)
        exponent = result["exponent"]
        entries.append(Entry(
            name=f"memory_growth_{stage}", ours=exponent, peer=1.0, unit="exponent", ratio=exponent, target=TARGET,
            lower_is_better=True, details=result,
            notes=f"Peak RSS added by `rlhf {stage.replace('_', '-')}` over its baseline at {', '.join(map(str, sizes))} "
                  "rows (a fresh process each), fitted as rows^exponent; 1 would be memory in proportion to the rows "
                  f"(the peer column), the target is {TARGET} or less. Increments (MB): "
                  + ", ".join(f"{r['increment_mb']}" for r in result["runs"]) + ".",
        ))
        table.append(f"| {stage} | " + " | ".join(f"{r['increment_mb']} MB ({r['seconds']} s)" for r in result["runs"])
                     + f" | {exponent:.2f} |")
    return entries, [{"title": "Peak memory against rows", "markdown": "\n".join(table)}]
