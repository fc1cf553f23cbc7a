"""Rejection-sampling fine-tuning (RAFT / best-of-n): ``rlhf filter --mode best`` keeps each prompt's best response
on its sampled token ids, ``rlhf sft`` and ``rlhf train --algo raft`` train on exactly those ids, and ``rlhf
iterate`` runs it as an algorithm."""

import json
from pathlib import Path

import pytest
from datasets import load_from_disk
from safetensors.torch import load_file

from conftest import LENGTH_REWARD, logged, max_weight_diff, run

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def data(tmp_path_factory, stop_prone_policy, bundled_prompts) -> Path:
    """generate (n 4, responses of uneven lengths, some stopped) -> score -> filter --mode best."""
    d = tmp_path_factory.mktemp("raft")
    (d / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", stop_prone_policy, "--prompts", bundled_prompts, "--output", d / "gen",
               "--n", 4, "--max-new-tokens", 16, "--limit", 40) == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored", "--reward-fn", f"{d}/reward.py:reward") == 0
    assert run("filter", "--input", d / "scored", "--output", d / "best", "--tokenizer", stop_prone_policy,
               "--mode", "best", "--test-size", 6) == 0
    return d


def test_best_mode_keeps_each_prompts_best_response_on_its_sampled_ids(data):
    scored = {row["prompt_id"]: row for row in load_from_disk(str(data / "scored"))}
    best = load_from_disk(str(data / "best"))
    manifest = json.loads((data / "best" / "manifest.json").read_text())
    rows = [*best["train"], *best["test"]]
    assert len(rows) == best["train"].num_rows + best["test"].num_rows == 40 - sum(manifest["dropped"].values())
    assert best["test"].num_rows == 6 and manifest["mode"] == "best"
    for row in rows:
        source = scored[row["prompt_id"]]
        rewards = source["rewards"]
        j = max(range(len(rewards)), key=lambda i: (rewards[i], -i))  # the best, the first on a tie
        assert row["completion_token_ids"] == source["response_token_ids"][j]
        assert row["completion"] == source["responses"][j] and row["reward"] == rewards[j]
        assert row["finish_reason"] == source["finish_reasons"][j]
        assert row["prompt_token_ids"] == source["prompt_token_ids"]
    assert {"completion", "completion_token_ids", "reward", "finish_reason"} <= set(best["train"].column_names)
    assert "responses" not in best["train"].column_names and "rewards" not in best["train"].column_names


def test_sft_on_best_responses_trains_on_the_sampled_ids_and_equals_train_algo_raft(data, stop_prone_policy,
                                                                                     tmp_path):
    """No re-rendering: the SFT rows are prompt ids + the sampled ids (stop token included when sampling stopped).
    ``rlhf train --algo raft`` is that same training: with the same options both give the same weights."""
    from rlhf_pipeline.algorithms.supervised import sampled_rows

    best = load_from_disk(str(data / "best"))
    rows, dropped = sampled_rows(best, max_length=10_000, source="best")
    assert dropped == {}
    assert rows["train"]["answer_token_ids"] == best["train"]["completion_token_ids"]
    assert rows["train"]["prompt_token_ids"] == best["train"]["prompt_token_ids"]
    assert any(r == "stop" for r in best["train"]["finish_reason"])

    common = ["--data", data / "best", "--model", stop_prone_policy, "--max-steps", 3, "--batch-size", 4,
              "--learning-rate", 1e-3, "--report-to", "none", "--seed", 0]
    assert run("sft", *common, "--output", tmp_path / "sft") == 0
    assert run("train", "--algo", "raft", *common, "--output", tmp_path / "raft") == 0
    assert max_weight_diff(tmp_path / "sft", tmp_path / "raft") == 0.0
    assert logged(tmp_path / "sft") == logged(tmp_path / "raft") and len(logged(tmp_path / "raft")) == 3
    before = load_file(Path(stop_prone_policy) / "model.safetensors")
    after = load_file(tmp_path / "raft" / "model.safetensors")
    assert any((before[k] != after[k]).any() for k in before)
    training = json.loads((tmp_path / "raft" / "manifest.json").read_text())["training"]
    assert training["algo"] == "raft" and training["steps"] == 3
    sft = json.loads((tmp_path / "sft" / "manifest.json").read_text())["training"]
    assert sft["answer_tokenized_alone"] == 0


def test_raft_on_other_data_is_one_clean_error(data, stop_prone_policy, tmp_path, capsys):
    assert run("filter", "--input", data / "scored", "--output", tmp_path / "pairs", "--tokenizer", stop_prone_policy,
               "--test-size", 0) == 0
    capsys.readouterr()
    assert run("train", "--algo", "raft", "--model", stop_prone_policy, "--data", tmp_path / "pairs",
               "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing column(s) completion_token_ids" in err and "--mode best" in err
    assert not (tmp_path / "out").exists()


def test_iterate_runs_raft_with_the_best_filter_mode(tmp_path):
    from rlhf_pipeline.algorithms import BEST, get
    from rlhf_pipeline.stages.iterate import IterateConfig, plan

    assert get("raft").data == BEST and get("raft").demo
    steps = plan(IterateConfig(output=str(tmp_path / "run"), model="base", prompts="p.jsonl", iterations=2,
                               reward_model="rm", algo="raft"))
    filters = [s for s in steps if s.stage == "filter"]
    assert len(filters) == 2 and all(s.args[s.args.index("--mode") + 1] == "best" for s in filters)
    trains = [s for s in steps if s.stage == "train"]
    assert all(s.args[s.args.index("--algo") + 1] == "raft" for s in trains)
    assert not any("--ref-model" in s.args for s in steps)


def test_sft_on_best_responses_saves_the_template_they_were_rendered_with(stop_prone_policy, bundled_prompts,
                                                                          tmp_path, capsys):
    """Sampled with --chat-template zephyr, the ids are zephyr's: the SFT model is saved with zephyr's template, as
    rlhf train --algo raft saves it, so that the next generate renders prompts as they were trained on. It kept
    --model's own (or --chat-template's, unchecked) and sampled from prompts rendered otherwise."""
    from transformers import AutoTokenizer

    from rlhf_pipeline.chat_templates import BUILTIN_TEMPLATES

    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", stop_prone_policy, "--prompts", bundled_prompts, "--output", tmp_path / "gen",
               "--n", 2, "--max-new-tokens", 8, "--limit", 12, "--chat-template", "zephyr") == 0
    assert run("score", "--input", tmp_path / "gen", "--output", tmp_path / "scored", "--reward-fn",
               f"{tmp_path}/reward.py:reward") == 0
    assert run("filter", "--input", tmp_path / "scored", "--output", tmp_path / "best", "--tokenizer",
               stop_prone_policy, "--mode", "best", "--test-size", 0) == 0
    common = ["--data", tmp_path / "best", "--model", stop_prone_policy, "--max-steps", 1, "--batch-size", 2,
              "--report-to", "none"]
    assert AutoTokenizer.from_pretrained(stop_prone_policy).chat_template != BUILTIN_TEMPLATES["zephyr"]
    assert run("sft", *common, "--output", tmp_path / "sft") == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "sft").chat_template == BUILTIN_TEMPLATES["zephyr"]
    assert json.loads((tmp_path / "sft" / "manifest.json").read_text())["chat_template"]["name"] == "zephyr"
    capsys.readouterr()
    assert run("sft", *common, "--chat-template", "chatml", "--output", tmp_path / "other") == 1
    err = capsys.readouterr().err
    assert "was rendered with the chat template" in err and "--chat-template chatml renders with" in err, err
    assert not (tmp_path / "other").exists()
