"""Options declared once: generate and eval share their sampling and engine options (flags, help, checks), and
eval hands them to generate whole. Regression tests for ``rlhf eval --temperature 0 --n 2``, which ended in a
ValueError traceback and left OUTPUT/run_started.json behind, where ``rlhf generate`` gave a one-line error."""

import dataclasses

import pytest

from conftest import run, write_jsonl
from rlhf_pipeline.config import build_parser, options_of, semantic_dict
from rlhf_pipeline.sampling_options import SamplingOptions
from rlhf_pipeline.stages.eval import EvalConfig
from rlhf_pipeline.stages.generate import GenerateConfig


def stage_args(stage: str, tmp_path) -> list:
    """The required options of each stage, with real prompt and reward files (as in the report of the bug)."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Hello."}, {"prompt": "Name a colour."}])
    (tmp_path / "rewards.py").write_text("def reward(prompts, responses, **c):\n    return [0.0] * len(responses)\n")
    common = ["--model", tmp_path / "no_model", "--prompts", prompts]
    return [stage, *common] + (["--reward-fn", f"{tmp_path}/rewards.py:reward"] if stage == "eval" else [])


def fails_at_parse_time(capsys, tmp_path, stage: str, *options) -> str:
    """Runs ``rlhf STAGE ... OPTIONS``: exit status 1, one ``error:`` line, nothing written. Returns the line."""
    output = tmp_path / "out"
    assert run(*stage_args(stage, tmp_path), "--output", output, *options) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: rlhf {stage}: "), err
    assert "Traceback" not in err
    assert not output.exists() and not list(tmp_path.glob(".out*"))
    return err


@pytest.mark.parametrize("stage", ["generate", "eval"])
def test_greedy_with_several_samples_fails_with_one_line_and_leaves_nothing(capsys, tmp_path, stage):
    err = fails_at_parse_time(capsys, tmp_path, stage, "--temperature", 0, "--n", 2)
    assert "--temperature 0 (greedy) gives n identical samples; use --n 1 or a temperature > 0" in err


@pytest.mark.parametrize(
    "options, message",
    [
        (["--n", 0], "--n must be at least 1"),
        (["--temperature", -0.5], "--temperature must be >= 0"),
        (["--top-p", 0], "--top-p must be in (0, 1]"),
        (["--top-p", 1.5], "--top-p must be in (0, 1]"),
        (["--top-k", -1], "--top-k must be >= 0"),
        (["--max-new-tokens", 0], "--max-new-tokens must be at least 1"),
        (["--limit", 0], "--limit must be at least 1"),
        (["--batch-size", 0], "--batch-size must be at least 1"),
        (["--tensor-parallel-size", 0], "--tensor-parallel-size must be at least 1"),
        (["--gpu-memory-utilization", 1.5], "--gpu-memory-utilization must be in (0, 1]"),
        (["--max-model-len", 0], "--max-model-len must be at least 1"),
    ],
)
def test_generate_and_eval_refuse_the_same_options_with_the_same_message(capsys, tmp_path, options, message):
    errors = {stage: fails_at_parse_time(capsys, tmp_path, stage, *options) for stage in ("generate", "eval")}
    reasons = {stage: err.removeprefix(f"error: rlhf {stage}: ") for stage, err in errors.items()}
    assert reasons["generate"] == reasons["eval"]
    assert message in errors["eval"]


def test_generate_keeps_its_own_checks(capsys, tmp_path):
    assert "--offset must be >= 0" in fails_at_parse_time(capsys, tmp_path, "generate", "--offset", -1)
    assert "--shard '3/2': need 0 <= i < N" in fails_at_parse_time(capsys, tmp_path, "generate", "--shard", "3/2")


def test_greedy_eval_with_one_sample_is_valid():
    config = EvalConfig(model="m", prompts="p", reward_fn="f.py:r", output="o", temperature=0.0)
    assert config.n == 1


def flags(parser, title: str) -> dict[str, tuple]:
    """(default, help) of each flag in the help section ``title``."""
    (group,) = [g for g in parser._action_groups if g.title == title]
    return {a.option_strings[0]: (a.default, a.help) for a in group._group_actions}


def test_eval_lists_generates_sampling_options_with_the_same_help_and_eval_defaults():
    title = SamplingOptions.options_group
    gen, ev = (flags(build_parser(cls, "rlhf x"), title) for cls in (GenerateConfig, EvalConfig))
    shared = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(SamplingOptions)]
    assert list(gen) == list(ev) == shared
    assert {k: v for k, v in gen.items() if k != "--n"} == {k: v for k, v in ev.items() if k != "--n"}
    assert gen["--n"] == (5, "Responses sampled per prompt, in one request. (default: 5)")
    assert ev["--n"] == (1, "Responses sampled per prompt, in one request. (default: 1)")  # eval's default stays 1
    for stage_only in ("--model", "--prompts", "--shard", "--offset", "--chat-template"):
        assert stage_only in flags(build_parser(GenerateConfig, "rlhf generate"), "stage options")


def test_eval_leaves_batch_size_out_of_its_reuse_check_as_before():
    gen = GenerateConfig(model="m", prompts="p", output="o")
    ev = EvalConfig(model="m", prompts="p", reward_fn="f.py:r", output="o")
    assert "batch_size" in semantic_dict(gen) and "batch_size" not in semantic_dict(ev)
    assert "gpu_memory_utilization" not in semantic_dict(ev)


def test_eval_hands_every_sampling_option_to_generate(monkeypatch, tmp_path):
    """What eval samples with is exactly its own options: each set to a non-default value arrives in generate."""
    from rlhf_pipeline.stages import eval as eval_stage
    from rlhf_pipeline.stages import generate, score

    values = dict(n=3, temperature=0.5, top_p=0.7, top_k=4, max_new_tokens=9, seed=7, engine="hf", limit=2,
                  batch_size=5, dtype="float32", attn_implementation="varlen", tensor_parallel_size=2,
                  gpu_memory_utilization=0.5, max_model_len=64, trust_remote_code=True, executor="ray", replicas=3,
                  gpus_per_replica=1, ray_address="head:6379", prompt_column="question")
    assert set(values) == {f.name for f in dataclasses.fields(SamplingOptions)}
    config = EvalConfig(model="policy", prompts="p.jsonl", reward_fn="f.py:r", output=str(tmp_path), **values)
    seen, scored = [], []
    monkeypatch.setattr(generate, "main", lambda c: seen.append(c) or tmp_path / "generate")
    monkeypatch.setattr(score, "score", lambda c, accelerator=None: scored.append(c) or tmp_path / "score")
    eval_stage._sample_and_score(config, "baseline-model", tmp_path / "baseline")
    (gen,) = seen
    assert options_of(gen, SamplingOptions) == values
    assert [c.attn_implementation for c in scored] == ["varlen"]  # the reward model's too
    assert (gen.model, gen.prompts) == ("baseline-model", "p.jsonl")
    assert gen.output == str(tmp_path / "baseline" / "generate")
    assert (gen.offset, gen.shard, gen.chat_template) == (0, None, None)  # generate's defaults


def test_shards_cover_every_row_once():
    from rlhf_pipeline.sharding import parse_shard, request_seed, shard_indices

    for rows in (0, 1, 7, 10):
        for shards in (1, 3, 4):
            parts = [shard_indices(rows, i, shards) for i in range(shards)]
            assert [r for part in parts for r in part] == list(range(rows))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parse_shard("1/4") == (1, 4)
    with pytest.raises(ValueError, match="expected i/N"):
        parse_shard("1-4")
    # Pinned: a prompt's seed, hence its samples, must not change when the function moves or is refactored.
    assert [request_seed(0, row) for row in range(3)] == [171340460, 709825519, 1554589843]
    assert request_seed(7, 123) == 1839556505


# ----------------------------------------------------------------------------------------------------------------
# --attn-implementation: declared once (rlhf_pipeline.attention), on every stage that loads a model


MODEL_STAGES = ("train", "sft", "train-rm", "ref-logps", "score", "generate", "eval", "iterate")


@pytest.mark.parametrize("stage", MODEL_STAGES)
def test_every_stage_that_loads_a_model_takes_attn_implementation(stage, capsys):
    from rlhf_pipeline.attention import ATTENTION_IMPLEMENTATIONS

    with pytest.raises(SystemExit) as exit_:
        run(stage, "--help")
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--attn-implementation {" + ",".join(ATTENTION_IMPLEMENTATIONS) + "}" in out
    assert "implementation: sdpa (transformers' default)" in out or stage == "iterate"


@pytest.mark.parametrize("stage", ["generate", "eval"])
def test_the_vllm_engine_refuses_an_attn_implementation_with_one_line(capsys, tmp_path, stage):
    err = fails_at_parse_time(capsys, tmp_path, stage, "--engine", "vllm", "--attn-implementation", "varlen")
    assert "--attn-implementation varlen: applies to the hf engine only" in err
    assert "drop --attn-implementation, or use --engine hf" in err
    assert GenerateConfig(model="m", prompts="p", output="o", engine="vllm").attn_implementation == "sdpa"


def test_score_with_vllm_refuses_an_attn_implementation(capsys, tmp_path):
    assert run("score", "--input", tmp_path, "--output", tmp_path / "out", "--reward-model", "rm", "--engine", "vllm",
               "--attn-implementation", "eager") == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: rlhf score: --attn-implementation eager: applies to the hf engine only (with --engine vllm, "
                   "vLLM picks its own attention backend); drop --attn-implementation, or use --engine hf")


def test_attn_implementation_does_not_decide_reuse():
    """It changes results by float rounding only: a finished output made with another one is reused (as with
    --pack-ratio), and the manifest still records it with the whole config."""
    from rlhf_pipeline.config import to_dict
    from rlhf_pipeline.stages.ref_logps import RefLogpsConfig
    from rlhf_pipeline.stages.score import ScoreConfig
    from rlhf_pipeline.stages.train import TrainConfig

    for config in (TrainConfig(model="m", data="d", output="o", attn_implementation="varlen"),
                   RefLogpsConfig(model="m", input="i", output="o", attn_implementation="varlen"),
                   ScoreConfig(input="i", output="o", reward_model="rm", attn_implementation="varlen"),
                   GenerateConfig(model="m", prompts="p", output="o", attn_implementation="varlen")):
        assert "attn_implementation" not in semantic_dict(config)
        assert to_dict(config)["attn_implementation"] == "varlen"
