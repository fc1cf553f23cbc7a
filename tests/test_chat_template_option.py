"""--chat-template FILE|NAME|none on every stage that renders conversations (config.ChatTemplateOptions,
chat.use_chat_template): the option wins over the tokenizer's own template, a tokenizer with none is an error naming
the model and the fix, `none` renders raw text on purpose (and refuses 'messages' rows, naming the row), the
manifest records what was really used, filter renders as the sampler did or refuses, sft / train-rm save the
template they trained with into the output tokenizer, and train the template its data was rendered with.

The base model is the tiny kit's ``--chat-format base``: its tokens, no chat template (as a pretrained-only
checkpoint ships)."""

import hashlib
import json
from pathlib import Path

import pytest

from conftest import run, write_jsonl

from rlhf_pipeline.chat_templates import CHATML, ZEPHYR
from rlhf_pipeline.tiny import CHAT_TEMPLATE

FIX = "--chat-template chatml|llama3|zephyr|FILE"
REWARD = "def reward(prompts, responses, **columns):\n    return [float(len(r)) for r in responses]\n"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def manifest(path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_text())


def tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def generated(path):
    from datasets import load_from_disk

    return load_from_disk(str(path))


@pytest.fixture(scope="module")
def base_policy(tmp_path_factory) -> str:
    from rlhf_pipeline.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "base", chat_format="base"))


@pytest.fixture(scope="module")
def base_rm(tmp_path_factory) -> str:
    from rlhf_pipeline.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "base-rm", kind="reward", seed=1,
                               chat_format="base"))


def generate(model, prompts, output, *extra) -> int:
    return run("generate", "--model", model, "--prompts", prompts, "--output", output, "--limit", 3, "--n", 2,
               "--max-new-tokens", 3, "--engine", "hf", *extra)


def test_the_base_kit_has_no_template(base_policy):
    assert not tokenizer(base_policy).chat_template


def test_a_model_without_a_template_is_an_error_naming_it_and_the_fix(base_policy, small_prompts, tmp_path, capsys):
    """Before: sampled on the raw prompt while the manifest said use_chat_template: true."""
    assert generate(base_policy, small_prompts, tmp_path / "gen") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert base_policy in err[0] and FIX in err[0] and "--chat-template none" in err[0]
    assert not (tmp_path / "gen").exists()


def test_a_builtin_template_renders_and_the_manifest_names_it(base_policy, small_prompts, tmp_path):
    assert generate(base_policy, small_prompts, tmp_path / "gen", "--chat-template", "chatml") == 0
    tok, ds = tokenizer(base_policy), generated(tmp_path / "gen")
    first = json.loads(Path(small_prompts).read_text().splitlines()[0])["prompt"]
    text = f"<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n"
    assert ds["prompt_token_ids"][0] == tok(text, add_special_tokens=False)["input_ids"]
    sampling = manifest(tmp_path / "gen")["sampling"]
    assert sampling["chat_template"] == {"source": "builtin", "name": "chatml", "sha256": sha(CHATML)}
    assert sampling["use_chat_template"] is True


def test_a_template_file_wins_over_the_tokenizer_own(tiny_policy, small_prompts, tmp_path):
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    assert generate(tiny_policy, small_prompts, tmp_path / "gen", "--chat-template", template) == 0
    tok, ds = tokenizer(tiny_policy), generated(tmp_path / "gen")
    assert tok.chat_template == CHAT_TEMPLATE  # the model's own is left as it was on disk
    first = ds["prompt"][0]
    assert ds["prompt_token_ids"][0] == tok(f"[user] {first}\n[assistant] ", add_special_tokens=False)["input_ids"]
    assert manifest(tmp_path / "gen")["sampling"]["chat_template"] == {
        "source": "file", "name": str(template), "sha256": sha(template.read_text())}

    assert generate(tiny_policy, small_prompts, tmp_path / "own") == 0  # no option: the tokenizer's, recorded
    assert manifest(tmp_path / "own")["sampling"]["chat_template"] == {"source": "tokenizer",
                                                                        "sha256": sha(CHAT_TEMPLATE)}


@pytest.mark.parametrize("bad, expected", [
    ("nowhere.jinja", "no such file, and not a built-in template (chatml, llama3, zephyr) or none"),
    ("broken.jinja", "not a Jinja template (line 1"),
])
def test_a_bad_template_option_is_one_line(bad, expected, tiny_policy, small_prompts, tmp_path, capsys):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    assert generate(tiny_policy, small_prompts, tmp_path / "gen", "--chat-template", tmp_path / bad) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--chat-template {tmp_path / bad}" in line and expected in line
    assert not (tmp_path / "gen").exists()


def test_none_samples_the_raw_prompt_and_says_so(tiny_policy, small_prompts, tmp_path, capsys):
    assert generate(tiny_policy, small_prompts, tmp_path / "gen", "--chat-template", "none") == 0
    tok, ds = tokenizer(tiny_policy), generated(tmp_path / "gen")
    assert ds["prompt_token_ids"][0] == tok(ds["prompt"][0])["input_ids"]  # raw text, with the tokenizer's BOS
    sampling = manifest(tmp_path / "gen")["sampling"]
    assert sampling["chat_template"] == {"source": "none", "sha256": None} and sampling["use_chat_template"] is False

    convs = write_jsonl(tmp_path / "convs.jsonl", [{"messages": [{"role": "user", "content": f"Hi {i}"}]}
                                                   for i in range(3)])
    assert generate(tiny_policy, convs, tmp_path / "convs", "--chat-template", "none") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "row 0 is a 'messages' conversation" in line and "--chat-template none" in line and FIX in line


def test_filter_renders_as_the_sampler_did_or_refuses_and_train_saves_that_template(base_policy, small_prompts,
                                                                                   tmp_path, capsys):
    """filter reads the sampler's template from the generate manifest (its --tokenizer has none here), and refuses
    another one; train saves the policy with the template its data was rendered with, so that the next generate (or
    a server) renders as it was trained, not with --model's own (none here)."""
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD)
    assert generate(base_policy, small_prompts, tmp_path / "gen", "--chat-template", "chatml") == 0
    assert run("score", "--input", tmp_path / "gen", "--output", tmp_path / "score", "--reward-fn",
               f"{fn}:reward") == 0
    common = ["filter", "--input", tmp_path / "score", "--tokenizer", base_policy, "--test-size", 0]
    assert run(*common, "--output", tmp_path / "filter") == 0
    assert manifest(tmp_path / "filter")["chat_template"] == {"source": "builtin", "name": "chatml",
                                                              "sha256": sha(CHATML)}
    capsys.readouterr()
    assert run(*common, "--output", tmp_path / "other", "--chat-template", "zephyr") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"rendered with the chat template built-in chatml (sha256 {sha(CHATML)})" in line
    assert f"built-in zephyr (sha256 {sha(ZEPHYR)})" in line and "pass --chat-template chatml" in line
    assert not (tmp_path / "other").exists()
    assert run("train", "--algo", "dpo", "--model", base_policy, "--data", tmp_path / "filter", "--output",
               tmp_path / "train", "--max-steps", 1, "--batch-size", 1, "--report-to", "none") == 0
    assert tokenizer(tmp_path / "train").chat_template == CHATML and tokenizer(base_policy).chat_template is None


def test_train_keeps_a_template_file_only_as_it_was_when_the_data_was_sampled(base_policy, small_prompts, tmp_path,
                                                                             caplog):
    """A template file named by the sampling is saved with the trained policy only while it still reads as it did
    (its recorded sha256): edited since, the policy keeps --model's own, with a warning that says why."""
    template = tmp_path / "tpl.jinja"
    template.write_text(CHATML)
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD)
    assert generate(base_policy, small_prompts, tmp_path / "gen", "--chat-template", template) == 0
    assert run("score", "--input", tmp_path / "gen", "--output", tmp_path / "score", "--reward-fn",
               f"{fn}:reward") == 0
    assert run("filter", "--input", tmp_path / "score", "--tokenizer", base_policy, "--test-size", 0, "--output",
               tmp_path / "filter") == 0
    train = ["train", "--algo", "dpo", "--model", base_policy, "--data", tmp_path / "filter", "--max-steps", 1,
             "--batch-size", 1, "--report-to", "none"]
    assert run(*train, "--output", tmp_path / "same") == 0
    assert tokenizer(tmp_path / "same").chat_template == CHATML
    template.write_text(ZEPHYR)  # edited after the sampling
    assert run(*train, "--output", tmp_path / "edited") == 0
    assert tokenizer(tmp_path / "edited").chat_template is None
    assert "which reads otherwise now" in caplog.text


def test_score_renders_a_template_less_reward_model_only_when_told(base_rm, small_prompts, tiny_policy, tmp_path,
                                                                   capsys):
    assert generate(tiny_policy, small_prompts, tmp_path / "gen") == 0
    common = ["score", "--input", tmp_path / "gen", "--reward-model", base_rm]
    assert run(*common, "--output", tmp_path / "plain") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert base_rm in line and FIX in line
    assert run(*common, "--output", tmp_path / "score", "--chat-template", "zephyr") == 0
    assert manifest(tmp_path / "score")["reward"]["chat_template"] == {"source": "builtin", "name": "zephyr",
                                                                       "sha256": sha(ZEPHYR)}


def sft(model, data, output, *extra) -> int:
    return run("sft", "--model", model, "--data", data, "--output", output, "--test-size", 0, "--max-steps", 1,
               "--batch-size", 2, "--report-to", "none", *extra)


def test_sft_on_messages_rows_saves_the_template_it_trained_with(base_policy, tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": f"Review the park number {i}."},
                          {"role": "assistant", "content": "The trees were lovely."}]} for i in range(4)]
    data = write_jsonl(tmp_path / "demos.jsonl", rows)
    assert sft(base_policy, data, tmp_path / "refused") == 1  # before: no way to give one
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert base_policy in line and FIX in line

    assert sft(base_policy, data, tmp_path / "sft", "--chat-template", "chatml") == 0
    assert tokenizer(tmp_path / "sft").chat_template == CHATML  # the next stages render as it was trained
    assert manifest(tmp_path / "sft")["chat_template"] == {"source": "builtin", "name": "chatml",
                                                           "sha256": sha(CHATML)}

    assert sft(base_policy, data, tmp_path / "raw", "--chat-template", "none") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "demos.jsonl: row 0 is a 'messages' conversation" in line


def test_train_rm_saves_the_template_it_trained_with(base_policy, tmp_path):
    rows = [{"prompt": f"Review the park number {i}.", "chosen": "Lovely trees.", "rejected": "Awful."}
            for i in range(4)]
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    assert run("train-rm", "--model", base_policy, "--data", data, "--output", tmp_path / "rm", "--test-size", 0,
               "--max-steps", 1, "--batch-size", 2, "--report-to", "none", "--chat-template", "zephyr") == 0
    assert tokenizer(tmp_path / "rm").chat_template == ZEPHYR
    assert manifest(tmp_path / "rm")["chat_template"]["name"] == "zephyr"


def test_the_fast_path_renders_a_supplied_template_directly():
    """chat._render's direct Jinja rendering serves a template given with --chat-template (no fallback to
    apply_chat_template) and gives its text."""
    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="base")
    assert chat.use_chat_template(tok, "zephyr", "base").source == "builtin"
    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Hi {i}"}] for i in range(3)]
    expected = tok.apply_chat_template(convs, add_generation_prompt=True, tokenize=False)
    assert chat._render(tok, True)(convs) == expected
    assert (ZEPHYR, True) not in chat._RENDERED_OTHERWISE
    assert expected[0] == f"<|system|>\nBe brief.{tok.eos_token}\n<|user|>\nHi 0{tok.eos_token}\n<|assistant|>\n"


def test_iterate_and_eval_pass_the_option_on(monkeypatch, tmp_path):
    """rlhf iterate's chat_template goes to every stage that renders (a section's own wins); rlhf eval's to the
    policy's sampling and the reward model, not to a judge."""
    from rlhf_pipeline.stages import eval as eval_stage
    from rlhf_pipeline.stages import generate as generate_stage
    from rlhf_pipeline.stages import score
    from rlhf_pipeline.stages.iterate import IterateConfig, plan

    config = IterateConfig(model="m", prompts="p.jsonl", reward_fn="f.py:r", output=str(tmp_path), iterations=1,
                           eval_prompts="e.jsonl", chat_template="chatml", score={"chat_template": "zephyr"})
    args = {step.stage: step.args for step in plan(config)}
    for stage, expected in (("generate", "chatml"), ("score", "zephyr"), ("filter", "chatml"), ("eval", "chatml")):
        assert args[stage][args[stage].index("--chat-template") + 1] == expected
    assert "--chat-template" not in args["train"]

    ev = eval_stage.EvalConfig(model="p", prompts="p.jsonl", reward_model="rm", output=str(tmp_path / "ev"),
                               chat_template="llama3")
    seen, scored = [], []
    monkeypatch.setattr(generate_stage, "main", lambda c: seen.append(c) or tmp_path / "generate")
    monkeypatch.setattr(score, "score", lambda c, accelerator=None: scored.append(c) or tmp_path / "score")
    eval_stage._sample_and_score(ev, "p", tmp_path / "ev")
    assert [c.chat_template for c in seen + scored] == ["llama3", "llama3"]


def test_the_docs_name_every_builtin_template():
    from rlhf_pipeline.chat_templates import BUILTIN_TEMPLATES

    text = (Path(__file__).resolve().parents[1] / "docs" / "stages.md").read_text()
    section = text.split("### Chat templates", 1)[1].split("\n## ", 1)[0]
    assert f"`--chat-template {'|'.join(BUILTIN_TEMPLATES)}|FILE`" in section
    for name in BUILTIN_TEMPLATES:
        assert f"`{name}`:" in section, name
