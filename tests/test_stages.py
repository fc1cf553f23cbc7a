"""Integration: the real stage programs on the tiny offline kit, checked as a user would check them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import load_from_disk

from conftest import run, write_jsonl

GENERATIONS = ["prompt_id", "prompt_token_ids", "responses", "response_token_ids", "finish_reasons"]
PAIRS = ["prompt_id", "prompt_token_ids", "chosen_token_ids", "rejected_token_ids", "chosen_reward",
         "rejected_reward", "chosen", "rejected"]
GROUPS = ["prompt_id", "prompt_token_ids", "response_token_ids", "rewards", "responses"]

REWARD_FN = '''
def reward(prompts, responses, **columns):
    assert len(columns["label"]) == len(responses) == len(columns["finish_reasons"])
    return [len(r) / 10 + (1.0 if f == "stop" else 0.0) for r, f in zip(responses, columns["finish_reasons"])]

def nan_at_seven(prompts, responses, **columns):
    return [float("nan") if i == 7 else 0.0 for i in range(len(responses))]
'''


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_policy, tiny_rm, bundled_prompts):
    """generate -> score (both reward kinds) -> filter (both modes), once for the module."""
    d = tmp_path_factory.mktemp("pipeline")
    (d / "rewards.py").write_text(REWARD_FN)
    assert run("generate", "--model", tiny_policy, "--prompts", bundled_prompts, "--output", d / "gen",
               "--n", 4, "--max-new-tokens", 24, "--limit", 40, "--engine", "hf") == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored_fn", "--reward-fn", f"{d}/rewards.py:reward") == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored_rm", "--reward-model", tiny_rm,
               "--batch-size", 8) == 0
    assert run("filter", "--input", d / "scored_rm", "--output", d / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 5) == 0
    lengths = sorted(len(ids) for ids in load_from_disk(str(d / "gen"))["prompt_token_ids"])
    assert run("filter", "--input", d / "scored_fn", "--output", d / "groups", "--tokenizer", tiny_policy,
               "--mode", "groups", "--test-size", 0.25, "--max-prompt-tokens", lengths[20]) == 0
    return d


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_generations_follow_the_contract(pipeline, tiny_policy):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    ds = load_from_disk(str(pipeline / "gen"))
    assert ds.num_rows == 40
    assert set(GENERATIONS + ["id", "prompt", "label"]) <= set(ds.column_names)  # extra columns carried
    for row in ds:
        assert row["prompt_id"] == row["id"]
        assert row["prompt_token_ids"].count(tok.bos_token_id) == 1
        assert len(row["responses"]) == len(row["response_token_ids"]) == len(row["finish_reasons"]) == 4
        for ids, reason in zip(row["response_token_ids"], row["finish_reasons"]):
            assert reason in ("stop", "length")
            assert (ids[-1] == tok.eos_token_id) == (reason == "stop")
            assert len(ids) <= 24
    m = manifest(pipeline / "gen")
    assert m["sampling"]["temperature"] == 0.8 and m["sampling"]["n"] == 4
    assert m["sampling"]["stop_token_ids"] == [tok.eos_token_id]
    assert m["rows_in"] == m["rows_out"] == 40
    # the engine's own time, apart from the process's: loading and starting it, then sampling every new token
    timing = m["timing"]
    assert timing["new_tokens"] == sum(len(ids) for row in ds["response_token_ids"] for ids in row)
    assert timing["engine_start_s"] > 0 and 0 < timing["sampling_s"] < m["wall_time_s"]
    assert timing["new_tokens_per_s"] == pytest.approx(timing["new_tokens"] / timing["sampling_s"], rel=0.01)


def test_scored_rewards_for_both_reward_kinds(pipeline):
    for name in ("scored_fn", "scored_rm"):
        ds = load_from_disk(str(pipeline / name))
        assert ds.num_rows == 40
        assert all(len(r) == 4 for r in ds["rewards"])
        assert manifest(pipeline / name)["sampling"]["temperature"] == 0.8  # carried down the lineage
    fn = load_from_disk(str(pipeline / "scored_fn"))
    row = fn[0]
    expected = [len(r) / 10 + (1.0 if f == "stop" else 0.0) for r, f in zip(row["responses"], row["finish_reasons"])]
    assert row["rewards"] == pytest.approx(expected)


def test_pairs_follow_the_contract(pipeline):
    dd = load_from_disk(str(pipeline / "pairs"))
    assert set(dd) == {"train", "test"} and dd["test"].num_rows == 5
    scored = {r["prompt_id"]: r for r in load_from_disk(str(pipeline / "scored_rm"))}
    m = manifest(pipeline / "pairs")
    assert m["rows_in"] == 40 and dd["train"].num_rows + 5 + sum(m["dropped"].values()) == 40
    for split in dd.values():
        assert set(PAIRS + ["label"]) <= set(split.column_names)
        for row in split:
            source = scored[row["prompt_id"]]
            assert row["chosen_reward"] == max(source["rewards"]) > row["rejected_reward"] == min(source["rewards"])
            assert row["chosen_token_ids"] == source["response_token_ids"][source["rewards"].index(max(source["rewards"]))]
            assert row["prompt_token_ids"] == source["prompt_token_ids"]


def test_groups_follow_the_contract_and_record_drops(pipeline):
    dd = load_from_disk(str(pipeline / "groups"))
    m = manifest(pipeline / "groups")
    limit = m["config"]["max_prompt_tokens"]
    too_long = sum(len(ids) > limit for ids in load_from_disk(str(pipeline / "gen"))["prompt_token_ids"])
    assert too_long > 0 and m["dropped"] == {"prompt_too_long": too_long}
    assert dd["train"].num_rows + dd["test"].num_rows == 40 - too_long
    assert dd["test"].num_rows == round(0.25 * (40 - too_long))
    for row in dd["train"]:
        assert set(GROUPS) <= set(row)
        assert len(row["response_token_ids"]) == len(row["rewards"]) == 4
        assert len(row["prompt_token_ids"]) <= limit


def test_same_seed_same_output(pipeline, tiny_policy, bundled_prompts, tmp_path):
    args = ["--model", tiny_policy, "--prompts", bundled_prompts, "--n", 4, "--max-new-tokens", 24, "--limit", 40,
            "--engine", "hf"]
    assert run("generate", *args, "--output", tmp_path / "again") == 0
    a, b = load_from_disk(str(pipeline / "gen")), load_from_disk(str(tmp_path / "again"))
    assert a["response_token_ids"] == b["response_token_ids"] and a["responses"] == b["responses"]
    assert run("generate", *args, "--output", tmp_path / "seed1", "--seed", 1) == 0
    assert load_from_disk(str(tmp_path / "seed1"))["response_token_ids"] != a["response_token_ids"]


def test_second_identical_run_is_skipped(pipeline, tiny_policy, capsys):
    before = {name: manifest(pipeline / name)["output_id"] for name in ("scored_rm", "pairs")}
    capsys.readouterr()
    assert run("filter", "--input", pipeline / "scored_rm", "--output", pipeline / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 5) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert manifest(pipeline / "pairs")["output_id"] == before["pairs"]
    # A different config is refused, and nothing is touched.
    assert run("filter", "--input", pipeline / "scored_rm", "--output", pipeline / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 6) == 1
    assert "test_size 5.0 -> 6.0" in capsys.readouterr().err
    assert manifest(pipeline / "pairs")["output_id"] == before["pairs"]


def test_an_output_from_before_an_option_existed_is_reused_while_the_option_keeps_its_default(
        pipeline, tiny_policy, tmp_path, capsys):
    """An output whose manifest predates an option (no key for it) is the same run as long as the option is left at
    its default; set to something else, the run differs and is refused."""
    import shutil

    out = tmp_path / "pairs"
    shutil.copytree(pipeline / "pairs", out)
    recorded = manifest(out)
    for key in ("overlong_buffer", "overlong_penalty", "drop_uniform_groups"):
        del recorded["config"][key]
    (out / "manifest.json").write_text(json.dumps(recorded))
    args = ["filter", "--input", pipeline / "scored_rm", "--output", out, "--tokenizer", tiny_policy, "--test-size", 5]
    capsys.readouterr()
    assert run(*args) == 0 and "nothing to do" in capsys.readouterr().out
    assert run(*args, "--overlong-buffer", 4) == 1
    assert "overlong_buffer None -> 4" in capsys.readouterr().err


def test_shards_merge_into_the_whole(tiny_policy, bundled_prompts, tmp_path):
    common = ["--model", tiny_policy, "--prompts", bundled_prompts, "--n", 2, "--max-new-tokens", 4, "--limit", 7]
    for i in range(3):
        assert run("generate", *common, "--shard", f"{i}/3", "--output", tmp_path / f"s{i}") == 0
    assert run("merge", "--inputs", tmp_path / "s2", tmp_path / "s0", tmp_path / "s1", "--output", tmp_path / "m") == 0
    merged = load_from_disk(str(tmp_path / "m"))
    assert merged["id"] == [json.loads(l)["id"] for l in open(bundled_prompts).read().splitlines()[:7]]
    assert manifest(tmp_path / "m")["sampling"]["n"] == 2
    assert run("merge", "--inputs", tmp_path / "s0", tmp_path / "s1", "--output", tmp_path / "m2") == 1
    assert not (tmp_path / "m2").exists()


def test_merge_takes_the_shards_of_one_run_however_named_and_ordered_and_no_others(tiny_policy, bundled_prompts,
                                                                                   tmp_path, capsys):
    """The shards' order and how each spells the prompts' path do not matter; the engine that sampled a shard, or a
    policy written again between the shards under the same path, do."""
    spelled = [bundled_prompts, str(Path(bundled_prompts).parent / "." / Path(bundled_prompts).name)]
    for i in range(2):
        assert run("generate", "--model", tiny_policy, "--prompts", spelled[i], "--n", 1, "--max-new-tokens", 2,
                   "--limit", 4, "--shard", f"{i}/2", "--output", tmp_path / f"s{i}") == 0
    assert run("merge", "--inputs", tmp_path / "s0", tmp_path / "s1", "--output", tmp_path / "m") == 0
    capsys.readouterr()
    assert run("merge", "--inputs", tmp_path / "s1", tmp_path / "s0", "--output", tmp_path / "m") == 0
    assert "nothing to do" in capsys.readouterr().out
    recorded = manifest(tmp_path / "s1")
    for change, expect in [({"sampling": dict(recorded["sampling"], engine="vllm")}, "sampling engine"),
                           ({"used_outputs": {"model": "another"}}, "the model, written again between the shards")]:
        (tmp_path / "s1" / "manifest.json").write_text(json.dumps(dict(recorded, **change)))
        assert run("merge", "--inputs", tmp_path / "s0", tmp_path / "s1", "--output", tmp_path / "m2") == 1
        assert expect in capsys.readouterr().err and not (tmp_path / "m2").exists()


def test_generate_wraps_past_the_last_prompt_and_records_its_rows(tiny_policy, small_prompts, tmp_path):
    """--wrap (rlhf iterate's last chunk of prompts_per_iteration) goes on from the first prompt."""
    assert run("generate", "--model", tiny_policy, "--prompts", small_prompts, "--n", 1, "--max-new-tokens", 2,
               "--offset", 10, "--limit", 4, "--wrap", "--output", tmp_path / "gen") == 0
    ids = [json.loads(line)["id"] for line in open(small_prompts).read().splitlines()]
    assert load_from_disk(str(tmp_path / "gen"))["id"] == [ids[10], ids[11], ids[0], ids[1]]
    assert manifest(tmp_path / "gen")["shard"]["rows"] == [[10, 12], [0, 2]]


def test_generate_closes_its_engine_even_when_sampling_fails(tiny_policy, small_prompts, tmp_path, monkeypatch):
    """A stage frees its engine when done (eval goes on to score, or to start a baseline's engine), and on failure."""
    import rlhf_pipeline.engines as engines

    real, closed = engines.load_engine, []

    def load_engine(*args, **kwargs):
        engine = real(*args, **kwargs)
        close = engine.close
        monkeypatch.setattr(engine, "close", lambda: (closed.append(engine.name), close()))
        return engine

    monkeypatch.setattr(engines, "load_engine", load_engine)
    args = ["--model", tiny_policy, "--prompts", small_prompts, "--n", 2, "--max-new-tokens", 4, "--engine", "hf"]
    assert run("generate", *args, "--output", tmp_path / "ok") == 0
    assert closed == ["hf"]
    monkeypatch.setattr("rlhf_pipeline.engines.hf.HFEngine.generate", lambda *a, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run("generate", *args, "--output", tmp_path / "failed")
    assert closed == ["hf", "hf"] and not (tmp_path / "failed").exists()


def _fails(capsys, *args, output: Path, expect: list[str]):
    capsys.readouterr()
    assert run(*args, "--output", output) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    for part in expect:
        assert part in err, err
    assert not output.exists() and not list(output.parent.glob(f".{output.name}*"))


def test_prompts_without_prompt_or_messages(capsys, tmp_path, tiny_policy):
    bad = write_jsonl(tmp_path / "questions.jsonl", [{"question": "a"}, {"question": "b"}])
    _fails(capsys, "generate", "--model", tiny_policy, "--prompts", bad, output=tmp_path / "out",
           expect=["questions.jsonl", "'prompt'", "'messages'", "rename"])


def test_prompt_column_names_the_prompts_of_a_dataset_that_calls_them_otherwise(capsys, tmp_path, tiny_policy):
    """--prompt-column question (text) and --prompt-column conversation (turns): sampled as 'prompt' and 'messages'
    prompts, and written under those names, so that every later stage reads them as it reads any prompts; the
    other columns (the ground truth of a verifiable reward) come along."""
    rows = [{"question": f"Review park {i}.", "answer": str(i)} for i in range(4)]
    qa = write_jsonl(tmp_path / "qa.jsonl", rows)
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": r["question"], "answer": r["answer"]} for r in rows])
    common = ["--model", tiny_policy, "--n", 2, "--max-new-tokens", 6]
    assert run("generate", "--prompts", qa, "--prompt-column", "question", *common, "--output", tmp_path / "qa") == 0
    assert run("generate", "--prompts", plain, *common, "--output", tmp_path / "plain") == 0
    got, expected = load_from_disk(str(tmp_path / "qa")), load_from_disk(str(tmp_path / "plain"))
    assert got.column_names == expected.column_names and got.to_list() == expected.to_list()
    assert manifest(tmp_path / "qa")["config"]["prompt_column"] == "question"

    turns = [{"conversation": [{"role": "user", "content": r["question"]}]} for r in rows]
    chat = write_jsonl(tmp_path / "chat.jsonl", turns)
    assert run("generate", "--prompts", chat, "--prompt-column", "conversation", *common,
               "--output", tmp_path / "chat") == 0
    assert load_from_disk(str(tmp_path / "chat"))["messages"] == [t["conversation"] for t in turns]

    # ShareGPT's {from, value} turns are read as the {role, content} turns they stand for: the same samples
    speakers = {"user": "human", "system": "system"}
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in t["conversation"]]}
        for t in turns])
    assert run("generate", "--prompts", sharegpt, "--prompt-column", "conversations", *common,
               "--output", tmp_path / "sharegpt") == 0
    assert load_from_disk(str(tmp_path / "sharegpt")).to_list() == load_from_disk(str(tmp_path / "chat")).to_list()
    _fails(capsys, "generate", "--prompts", sharegpt, *common, output=tmp_path / "v",
           expect=["looks like ShareGPT's turns: --prompt-column conversations reads them"])
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"conversations": [{"from": "human", "value": "a"}]},
                                               {"conversations": [{"from": "tool", "value": "b"}]}])
    _fails(capsys, "generate", "--prompts", odd, "--prompt-column", "conversations", *common, output=tmp_path / "u",
           expect=["odd.jsonl: row 1: a ShareGPT turn is from 'tool'; the speakers read are human, user, gpt"])

    _fails(capsys, "generate", "--prompts", qa, "--prompt-column", "questions", *common, output=tmp_path / "x",
           expect=["qa.jsonl: --prompt-column questions: no such column (columns: question, answer)"])
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"q": 5}, {"q": 6}])
    _fails(capsys, "generate", "--prompts", numbers, "--prompt-column", "q", *common, output=tmp_path / "w",
           expect=["numbers.jsonl: --prompt-column q: holds Value('int64'), neither text nor a list of"])
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "a", "question": "b"}])
    _fails(capsys, "generate", "--prompts", both, "--prompt-column", "question", *common, output=tmp_path / "y",
           expect=["--prompt-column question: it also has a 'prompt' column"])


def test_empty_prompt(capsys, tmp_path, tiny_policy):
    bad = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "fine"}, {"prompt": "ok"}, {"prompt": ""}])
    _fails(capsys, "generate", "--model", tiny_policy, "--prompts", bad, output=tmp_path / "out",
           expect=["prompts.jsonl", "row 2", "empty"])


def test_reward_function_returning_nan(capsys, pipeline, tmp_path):
    _fails(capsys, "score", "--input", pipeline / "gen", "--reward-fn", f"{pipeline}/rewards.py:nan_at_seven",
           output=tmp_path / "out", expect=["gen", "row 1", "response 3", "nan", "finite"])


def test_pairs_on_single_response_generations(capsys, tmp_path, tiny_policy, small_prompts, pipeline):
    assert run("generate", "--model", tiny_policy, "--prompts", small_prompts, "--n", 1, "--max-new-tokens", 4,
               "--output", tmp_path / "gen1") == 0
    assert run("score", "--input", tmp_path / "gen1", "--reward-fn", f"{pipeline}/rewards.py:reward",
               "--output", tmp_path / "scored1") == 0
    _fails(capsys, "filter", "--input", tmp_path / "scored1", "--tokenizer", tiny_policy, "--test-size", 2,
           output=tmp_path / "pairs1", expect=["scored1", "--mode pairs needs at least 2", "--n 1", "--mode groups"])


def test_wrong_tokenizer_is_caught(capsys, pipeline, tmp_path):
    from rlhf_pipeline.tiny import build_model, build_tokenizer

    small = tmp_path / "small_vocab"
    tok = build_tokenizer(vocab_size=300)
    build_model(tok).save_pretrained(small)
    tok.save_pretrained(small)
    # the sampler's tokenizer is recorded with the data: another one is refused at once, with the right one named
    _fails(capsys, "filter", "--input", pipeline / "scored_rm", "--tokenizer", small, "--test-size", 5,
           output=tmp_path / "out", expect=["mean other text under the tokenizer given", "--tokenizer"])
    # data with token ids and no record of what made them: the first id past the vocabulary names its row
    bare = tmp_path / "scored.jsonl"
    load_from_disk(str(pipeline / "scored_rm")).to_json(str(bare))
    _fails(capsys, "filter", "--input", bare, "--tokenizer", small, "--test-size", 5,
           output=tmp_path / "out", expect=["row", "ids of the tokenizer given", "--tokenizer"])


def test_the_same_vocabulary_cutting_text_otherwise_is_accepted(pipeline, tiny_policy, tmp_path):
    """One vocabulary whose pre-tokenizer cuts text otherwise (another backend or transformers release, or a
    tokenizer's digit rule fixed since): the sampled ids still mean what they did, so filter and train take them."""
    import shutil

    from rlhf_pipeline.chat import load_tokenizer, tokenizer_probe

    resplit = Path(shutil.copytree(tiny_policy, tmp_path / "digits_apart"))
    spec = json.loads((resplit / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                                   spec["pre_tokenizer"]]}
    (resplit / "tokenizer.json").write_text(json.dumps(spec))
    assert tokenizer_probe(load_tokenizer(str(resplit))) != tokenizer_probe(load_tokenizer(tiny_policy))
    assert run("filter", "--input", pipeline / "scored_rm", "--tokenizer", resplit, "--test-size", 5,
               "--output", tmp_path / "pairs") == 0
    assert run("train", "--algo", "dpo", "--model", resplit, "--data", tmp_path / "pairs", "--max-steps", 1,
               "--report-to", "none", "--output", tmp_path / "trained") == 0


def test_token_ids_of_another_tokenizer_of_the_same_size_are_refused(capsys, pipeline, tiny_policy, tmp_path):
    """Two tokenizers with vocabularies of one size (Llama-2's and Mistral-7B's: 32,000) give the same text other
    ids; every id is in range, so only the probe the data records tells them apart. Filter, ref-logps and train
    each refuse the other one, naming the fix, before writing anything."""
    import shutil

    from rlhf_pipeline.chat import TOKENIZER_PROBE, load_tokenizer

    other = Path(shutil.copytree(tiny_policy, tmp_path / "other_tokenizer"))
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = list(dict.fromkeys(load_tokenizer(tiny_policy).tokenize(TOKENIZER_PROBE)))[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens of the probe text, ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    fix = f"--tokenizer {tiny_policy}"
    _fails(capsys, "filter", "--input", pipeline / "scored_rm", "--tokenizer", other, output=tmp_path / "out",
           expect=["mean other text under the tokenizer given", fix])
    for stage, args in (("ref-logps", ["--model", other, "--input", pipeline / "pairs", "--temperature", 1]),
                        ("train", ["--algo", "dpo", "--model", other, "--data", pipeline / "pairs"]),
                        ("train", ["--algo", "grpo", "--model", other, "--data", pipeline / "groups",
                                   "--temperature", 1])):
        _fails(capsys, stage, *args, output=tmp_path / "out",
               expect=[f"{other}'s tokenizer", f"rlhf filter --tokenizer {other}"])


def test_console_script_and_module_entry_points(tmp_path):
    exe = Path(sys.executable).parent / "rlhf"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    assert all(stage in out for stage in ("generate", "score", "filter", "merge", "tiny-model"))
    res = subprocess.run([sys.executable, "-m", "rlhf_pipeline.stages.tiny_model", "--output", tmp_path / "m",
                          "--kind", "reward"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m")
    assert rm.config.num_labels == 1 and (tmp_path / "m" / "model.safetensors").exists()


def test_messages_prompts_and_parallel_filter(tmp_path, tiny_policy, pipeline):
    """`messages` prompts go through the same template path; num_proc=2 gives exactly num_proc=1's output."""
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Review park {i}."}]}
            for i in range(6)]
    prompts = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert run("generate", "--model", tiny_policy, "--prompts", prompts, "--n", 3, "--max-new-tokens", 6,
               "--output", tmp_path / "gen") == 0
    gen = load_from_disk(str(tmp_path / "gen"))
    assert gen["messages"] == [r["messages"] for r in rows] and len(set(gen["prompt_id"])) == 6
    one = load_from_disk(str(pipeline / "pairs"))
    assert run("filter", "--input", pipeline / "scored_rm", "--output", tmp_path / "pairs2", "--tokenizer",
               tiny_policy, "--test-size", 5, "--num-proc", 2) == 0
    two = load_from_disk(str(tmp_path / "pairs2"))
    for split in ("train", "test"):
        assert one[split].to_list() == two[split].to_list()


def test_scored_data_without_token_ids_is_tokenized_once(tmp_path, tiny_policy):
    """External scored data (texts only) is tokenized in the filter: template for the prompt, EOS after responses."""
    from rlhf_pipeline.chat import encode_prompts, load_tokenizer

    rows = [{"prompt_id": str(i), "prompt": f"Review the cafe number {i}.",
             "responses": ["Great coffee.", "Bad coffee and rude staff.", "ok"], "rewards": [1.0, -1.0, 0.0]}
            for i in range(4)]
    data = write_jsonl(tmp_path / "external.jsonl", rows)
    assert run("filter", "--input", data, "--output", tmp_path / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 1) == 0
    tok = load_tokenizer(tiny_policy)
    pairs = load_from_disk(str(tmp_path / "pairs"))["train"]
    for row in pairs:
        assert row["prompt_token_ids"] == encode_prompts(tok, [row["prompt"]])[0]
        assert row["chosen"] == "Great coffee." and row["rejected"] == "Bad coffee and rude staff."
        assert row["chosen_token_ids"] == tok("Great coffee.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # the pairs' columns and nothing else: the ids filter made for all the responses are not carried along
    assert set(pairs.column_names) == {"prompt_id", "prompt", "prompt_token_ids", "chosen", "rejected",
                                       "chosen_token_ids", "rejected_token_ids", "chosen_reward", "rejected_reward"}


def test_input_columns_named_like_pair_columns_are_kept_renamed(tmp_path, tiny_policy):
    """Prompt sets such as UltraFeedback carry their own chosen/rejected columns through generate and score; the
    filter keeps them as source_chosen/source_rejected instead of failing on the clash."""
    rows = [{"prompt": f"Review number {i}.", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "no"}
            for i in range(8)]
    write_jsonl(tmp_path / "p.jsonl", rows)
    assert run("generate", "--model", tiny_policy, "--prompts", tmp_path / "p.jsonl", "--output", tmp_path / "gen",
               "--n", 3, "--max-new-tokens", 8, "--engine", "hf") == 0
    (tmp_path / "r.py").write_text("def by_index(prompts, responses, **c):\n    return [float(i % 3) for i in "
                                   "range(len(responses))]\n")
    assert run("score", "--input", tmp_path / "gen", "--output", tmp_path / "scored",
               "--reward-fn", f"{tmp_path}/r.py:by_index") == 0
    assert run("filter", "--input", tmp_path / "scored", "--output", tmp_path / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 1) == 0
    dd = load_from_disk(str(tmp_path / "pairs"))
    assert sum(ds.num_rows for ds in dd.values()) == 8
    for ds in dd.values():
        assert {"source_chosen", "source_rejected", "chosen", "rejected"} <= set(ds.column_names)
        assert all(r == "no" for r in ds["source_rejected"])
        assert all(isinstance(c, str) for c in ds["chosen"])
    assert manifest(tmp_path / "pairs")["renamed_columns"] == {"chosen": "source_chosen",
                                                               "rejected": "source_rejected"}


def test_generate_finished_chunks_of_another_engine_and_a_failed_overwrite(tiny_policy, small_prompts, tmp_path,
                                                                            monkeypatch, capsys):
    """Finished chunks that --engine auto sampled with another engine than it picks now are refused with a fix that
    works (--overwrite samples them all again); and a finished output that --overwrite replaces is kept whole when
    the new run fails before it is saved."""
    import dataclasses

    from datasets import load_from_disk

    import rlhf_pipeline.engines as engines
    from rlhf_pipeline.stages import generate

    args = ["generate", "--model", tiny_policy, "--prompts", small_prompts, "--n", 2, "--max-new-tokens", 6,
            "--batch-size", 1, "--output", tmp_path / "out"]
    assert run(*args, "--engine", "hf", "--output", tmp_path / "whole") == 0
    monkeypatch.setattr(generate, "CHUNK_PROMPTS", 5)
    real_generate = generate_once_with(monkeypatch, fail_at=2)
    with pytest.raises(ZeroDivisionError):
        run(*args)  # --engine auto: hf here; one chunk finished
    monkeypatch.setattr("rlhf_pipeline.engines.hf.HFEngine.generate", real_generate)
    monkeypatch.setattr(engines, "resolve_engine_name", lambda name: "vllm" if name == "auto" else name)  # vLLM here
    capsys.readouterr()
    assert run(*args) == 1
    err = capsys.readouterr().err
    assert "its finished chunks were sampled with the hf engine, and --engine auto is vllm here" in err
    assert "pass --overwrite to sample every chunk with vllm" in err
    calls = []
    real_open = generate.open_engine

    def hf_engine(config, tokenizer):  # the "vllm" this test has is the hf engine
        engine = real_open(dataclasses.replace(config, engine="hf"), tokenizer)
        inner = engine.generate
        monkeypatch.setattr(engine, "generate", lambda *a, **kw: calls.append(len(a[0])) or inner(*a, **kw))
        return engine

    monkeypatch.setattr(generate, "open_engine", hf_engine)
    assert run(*args, "--overwrite") == 0
    assert calls == [5, 5, 2]  # every chunk again
    assert load_from_disk(str(tmp_path / "out")).to_dict() == load_from_disk(str(tmp_path / "whole")).to_dict()

    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    monkeypatch.setattr(generate, "open_engine", lambda *a: 1 / 0)  # the replacing run fails
    with pytest.raises(ZeroDivisionError):
        run(*args, "--seed", 7, "--overwrite")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before
    assert load_from_disk(str(tmp_path / "out")).to_dict() == load_from_disk(str(tmp_path / "whole")).to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "prompts.jsonl", "whole"]


def test_a_prompt_too_long_in_a_later_chunk_stops_generate_before_the_engine_loads(tiny_policy, tmp_path,
                                                                                     monkeypatch, capsys):
    """Prompts are encoded a chunk at a time; one that fills the context in the third chunk stopped the run only
    when its chunk came, with everything sampled before it lost. Every chunk is checked before the engine starts."""
    from rlhf_pipeline.stages import generate

    rows = [{"prompt": f"Say something about the number {i}."} for i in range(12)]
    rows[11] = {"prompt": "word " * 200}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    monkeypatch.setattr(generate, "CHUNK_PROMPTS", 5)
    monkeypatch.setattr(generate, "open_engine", lambda *a: pytest.fail("the engine was started"))
    capsys.readouterr()
    assert run("generate", "--model", tiny_policy, "--prompts", prompts, "--engine", "hf", "--max-model-len", 64,
               "--output", tmp_path / "out") == 1
    assert "prompts.jsonl: row 11: the prompt is" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def generate_once_with(monkeypatch, fail_at: int):
    """Make the hf engine's ``generate`` raise ZeroDivisionError on its ``fail_at``-th call (from now on); return the
    real one."""
    from rlhf_pipeline.engines.hf import HFEngine

    real, seen = HFEngine.generate, []

    def failing(self, *a, **kw):
        seen.append(1)
        if len(seen) == fail_at:
            raise ZeroDivisionError("the machine went away")
        return real(self, *a, **kw)

    monkeypatch.setattr(HFEngine, "generate", failing)
    return real


def test_generate_samples_and_writes_a_chunk_of_prompts_at_a_time(tiny_policy, small_prompts, tmp_path, monkeypatch):
    """Chunks of 5 prompts, written one after another, give the output of one chunk (at --batch-size 1 every prompt
    is sampled from its own seed, so chunking changes nothing), with nothing left beside the output; a run that
    failed keeps the chunks it finished, and its rerun samples only the others."""
    from datasets import load_from_disk

    from rlhf_pipeline.stages import generate

    args = ["--model", tiny_policy, "--prompts", small_prompts, "--n", 2, "--max-new-tokens", 6, "--engine", "hf",
            "--batch-size", 1]
    assert run("generate", *args, "--output", tmp_path / "whole") == 0
    monkeypatch.setattr(generate, "CHUNK_PROMPTS", 5)
    calls = []
    real = generate.open_engine

    def counting(config, tokenizer):
        engine = real(config, tokenizer)
        generate_once = engine.generate
        monkeypatch.setattr(engine, "generate", lambda *a, **kw: calls.append(len(a[0])) or generate_once(*a, **kw))
        return engine

    monkeypatch.setattr(generate, "open_engine", counting)
    assert run("generate", *args, "--output", tmp_path / "chunked") == 0
    assert calls == [5, 5, 2]  # the 12 prompts
    whole, chunked = load_from_disk(str(tmp_path / "whole")), load_from_disk(str(tmp_path / "chunked"))
    assert whole.features == chunked.features and whole.to_dict() == chunked.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunked", "prompts.jsonl", "whole"]

    # A run that fails in its third chunk keeps the two it finished (and is not taken for finished); run again, it
    # samples the third alone and writes what the uninterrupted run wrote, saying it resumed.
    real_generate, calls[:] = generate_once_with(monkeypatch, fail_at=3), []
    with pytest.raises(ZeroDivisionError):
        run("generate", *args, "--output", tmp_path / "cut")
    assert not (tmp_path / "cut" / "manifest.json").exists()
    assert sorted(p.name for p in (tmp_path / "cut" / "parts").glob("*.arrow")) == [
        "rows-000000000-000000005.arrow", "rows-000000005-000000010.arrow"]
    monkeypatch.setattr("rlhf_pipeline.engines.hf.HFEngine.generate", real_generate)
    assert run("generate", *args, "--output", tmp_path / "cut") == 0
    assert calls == [5, 5, 2, 2]  # the cut run's three calls, then the rerun's one
    cut = load_from_disk(str(tmp_path / "cut"))
    assert cut.features == whole.features and cut.to_dict() == whole.to_dict()
    assert json.loads((tmp_path / "cut" / "manifest.json").read_text())["resumed"] is True
    assert not (tmp_path / "cut" / "parts").exists()
    assert json.loads((tmp_path / "cut" / "manifest.json").read_text())["responses"] == \
        json.loads((tmp_path / "whole" / "manifest.json").read_text())["responses"]


def count_calls(monkeypatch, owner, name: str, fail_at: int | None = None) -> list:
    """Count the calls of ``owner.name`` (one entry each, from now on); the ``fail_at``-th raises
    ZeroDivisionError."""
    real, seen = getattr(owner, name), []

    def counted(*a, **kw):
        seen.append(1)
        if len(seen) == fail_at:
            raise ZeroDivisionError("the machine went away")
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, counted)
    return seen


def test_score_keeps_each_chunk_and_a_rerun_scores_only_the_unfinished_ones(pipeline, tiny_rm, tmp_path,
                                                                             monkeypatch, capsys):
    """A reward model's chunks of 7 rows and a function's of 3 batches of 8 responses (40 rows x 4 responses: 6 and
    7 chunks). A run that fails in the function's third chunk keeps the model's six and the function's first two; run
    again, it loads no model, calls the function on the other batches alone, and writes what one uninterrupted run
    writes, its manifest included, saying it resumed."""
    import rlhf_pipeline.rewards as rewards
    from rlhf_pipeline.stages import score

    monkeypatch.setattr(score, "CHUNK_ROWS", 7)
    monkeypatch.setattr(score, "FN_CHUNK_RESPONSES", 20)  # rounded up to whole batches: 24 responses
    monkeypatch.setattr(score, "FN_CHUNK_BATCHES", 1)
    args = ["--input", pipeline / "gen", "--reward-model", tiny_rm, "--reward-fn", f"{pipeline}/rewards.py:reward",
            "--batch-size", 8, "--max-length", 40]
    assert run("score", *args, "--output", tmp_path / "whole") == 0
    assert manifest(tmp_path / "whole")["reward"]["sources"][0]["truncated_sequences"] > 0  # summed over chunks

    calls = count_calls(monkeypatch, rewards, "call_reward_fn", fail_at=7)  # the third chunk's first batch
    with pytest.raises(ZeroDivisionError):
        run("score", *args, "--output", tmp_path / "cut")
    assert not (tmp_path / "cut" / "manifest.json").exists()
    kept = sorted(p.stem for p in (tmp_path / "cut" / "parts").glob("*.arrow"))
    assert kept == [f"reward_fn-{a:010d}-{b:010d}" for a, b in ((0, 24), (24, 48))] + [
        f"reward_model-{7 * 4 * k:010d}-{min(7 * 4 * (k + 1), 160):010d}" for k in range(6)]

    assert len(calls) == 7
    monkeypatch.undo()
    monkeypatch.setattr(score, "CHUNK_ROWS", 7)
    monkeypatch.setattr(score, "FN_CHUNK_RESPONSES", 20)
    monkeypatch.setattr(score, "FN_CHUNK_BATCHES", 1)
    fn_calls = count_calls(monkeypatch, rewards, "call_reward_fn")
    models = count_calls(monkeypatch, rewards, "RewardModelScorer")
    capsys.readouterr()
    assert run("score", *args, "--output", tmp_path / "cut") == 0
    assert "reusing 8 of 13 chunks an interrupted run finished" in capsys.readouterr().out
    assert (len(models), len(fn_calls)) == (0, 20 - 6)  # 160 responses in batches of 8; six were scored
    whole, cut = load_from_disk(str(tmp_path / "whole")), load_from_disk(str(tmp_path / "cut"))
    assert cut.features == whole.features and cut.to_dict() == whole.to_dict()
    assert manifest(tmp_path / "cut")["reward"] == manifest(tmp_path / "whole")["reward"]
    assert manifest(tmp_path / "cut")["resumed"] is True
    assert not (tmp_path / "cut" / "parts").exists()

    # --overwrite with other options, failing after the model's chunks were kept: the finished output stays whole
    count_calls(monkeypatch, rewards, "call_reward_fn", fail_at=3)
    with pytest.raises(ZeroDivisionError):
        run("score", *args[:-2], "--max-length", 60, "--overwrite", "--output", tmp_path / "cut")
    assert load_from_disk(str(tmp_path / "cut")).to_dict() == whole.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut", "whole"]  # no hidden scratch left


SCALED_REWARD = """
def reward(prompts, responses, **columns):
    return [{scale} * len(r) for r in responses]
"""


def test_a_rerun_scores_again_the_chunks_of_a_source_changed_since(pipeline, tiny_rm, tmp_path, monkeypatch, capsys):
    """Chunks of a function whose file was edited since, or of a reward model directory written again, are scored
    again, not reused; a rerun with other options is refused, with the fix."""
    import os
    import shutil

    import rlhf_pipeline.rewards as rewards
    from rlhf_pipeline.stages import score

    monkeypatch.setattr(score, "FN_CHUNK_RESPONSES", 16)  # the function's 10 chunks of 2 batches; the model's 1
    monkeypatch.setattr(score, "FN_CHUNK_BATCHES", 1)
    fn, rm = tmp_path / "scaled.py", tmp_path / "rm"
    fn.write_text(SCALED_REWARD.format(scale=1))
    shutil.copytree(tiny_rm, rm)
    args = ["--input", pipeline / "gen", "--reward-model", rm, "--reward-fn", f"{fn}:reward", "--batch-size", 8,
            "--output", tmp_path / "out"]
    calls = count_calls(monkeypatch, rewards, "call_reward_fn", fail_at=5)
    with pytest.raises(ZeroDivisionError):
        run("score", *args)
    assert len(list((tmp_path / "out" / "parts").glob("*.arrow"))) == 3
    assert run("score", *args[:-4], "--batch-size", 4, "--output", tmp_path / "out") == 1
    assert "its unfinished run was started with another config or inputs (batch_size 8 -> 4)" in capsys.readouterr().err

    fn.write_text(SCALED_REWARD.format(scale=2))
    later = os.stat(rm / "config.json").st_mtime_ns + 10**9
    os.utime(rm / "config.json", ns=(later, later))  # written again
    monkeypatch.undo()
    monkeypatch.setattr(score, "FN_CHUNK_RESPONSES", 16)
    monkeypatch.setattr(score, "FN_CHUNK_BATCHES", 1)
    again = count_calls(monkeypatch, rewards, "call_reward_fn")
    models = count_calls(monkeypatch, rewards, "RewardModelScorer")
    assert run("score", *args) == 0
    assert "reusing 0 of 11 chunks an interrupted run finished; 3 made by an earlier version of a reward source " \
           "are scored again" in capsys.readouterr().out
    assert len(calls) == 5 and len(again) == 20 and len(models) == 1  # everything scored again
    data = load_from_disk(str(tmp_path / "out"))
    assert data["rewards_reward_fn"] == [[2.0 * len(r) for r in rs] for rs in data["responses"]]


def test_a_reward_functions_chunks_hold_whole_batches_and_work_for_many_processes():
    """A chunk is whole batches (each call sees the batch one process would give it), of at least FN_CHUNK_BATCHES
    batches, so that 8 processes at --batch-size 2048 do not leave half of them idle in every chunk; neither
    depends on the number of processes, so a rerun with another number reuses the chunks."""
    from rlhf_pipeline.stages import score

    locations = score.Locations()
    locations.extend(0, [4] * 100_000)
    source = score.RewardSource("reward_fn", "f.py:f", "reward_fn")
    for batch_size, size in ((16, 8192), (1000, 64_000), (2048, 2048 * 64)):
        config = score.ScoreConfig(input="in", output="out", reward_fn="f.py:f", batch_size=batch_size)
        chunks = score._chunks(source, config, locations)
        assert chunks[0] == (0, size) and chunks[-1][1] == 400_000 and size % batch_size == 0
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
