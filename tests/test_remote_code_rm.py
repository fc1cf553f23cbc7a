"""Reward models that ship their own code, as ArmoRM does (issue 37, point 6): REBEL's recipe scores with
RLHFlow/ArmoRM-Llama3-8B-v0.1, whose config.json names ``modeling_custom.LlamaForRewardModelWithGating`` in its
``auto_map`` and whose output's ``score`` is the reward.

The tiny kit's ``armo`` kind (``rlhf tiny-model --kind armo``) is such a model, built offline: its own modeling file
and ``model_type``, a multi-objective head with a gating layer, an output with ``rewards``, ``gating_output`` and
``score`` and no ``logits``. With ``--trust-remote-code`` ``rlhf score`` gives each response the model's own
``score`` (the oracle: its forward on each conversation alone); without it the stage stops with one line before any
of the model's code runs or anything is written, also for ArmoRM's own layout (a standard ``model_type``), which
transformers would otherwise load as a standard classifier with a new, random head.
"""

import json
import shutil
from pathlib import Path

import pytest
from datasets import load_from_disk

from conftest import armo_scores, run
from rlhf_pipeline.compat import allow_legacy_remote_code

REMOTE_CLASS = "modeling_tiny_armo.TinyArmoForRewardModel"


@pytest.fixture(scope="module")
def armo(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny_armo"
    assert run("tiny-model", "--kind", "armo", "--seed", 2, "--output", path) == 0
    return path


@pytest.fixture(scope="module")
def gens(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    out = tmp_path_factory.mktemp("remote_rm") / "gen"
    assert run("generate", "--model", tiny_policy, "--prompts", bundled_prompts, "--limit", 3, "--n", 2,
               "--max-new-tokens", 8, "--engine", "hf", "--output", out) == 0
    return out


def test_the_tiny_armo_model_ships_its_own_code_and_armorms_output(armo):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = json.loads((armo / "config.json").read_text())
    assert config["model_type"] == "tiny_armo" and config["architectures"] == ["TinyArmoForRewardModel"]
    assert config["auto_map"] == {"AutoConfig": "modeling_tiny_armo.TinyArmoConfig",
                                  "AutoModelForSequenceClassification": REMOTE_CLASS}
    assert (armo / "modeling_tiny_armo.py").is_file() and (armo / "model.safetensors").is_file()
    assert not list(armo.glob("*.bin")) and not list(armo.glob("*.pt"))
    with pytest.raises(ValueError, match="custom code"):  # its model_type is registered nowhere but in its code
        AutoConfig.from_pretrained(armo, trust_remote_code=False)

    tok = AutoTokenizer.from_pretrained(armo, trust_remote_code=False)
    allow_legacy_remote_code()
    model = AutoModelForSequenceClassification.from_pretrained(armo, trust_remote_code=True).eval()
    conversations = [[{"role": "user", "content": "Review the phone Nova."}, {"role": "assistant", "content": a}]
                     for a in ("Great battery.", "The screen cracked and the battery died.")]
    batch = tok.apply_chat_template(conversations, tokenize=True, padding=True, return_dict=True, return_tensors="pt")
    assert tok.padding_side == "right"
    with torch.no_grad():
        out = model(**batch)
    assert set(out.keys()) == {"rewards", "gating_output", "score"}  # no logits: a reader of logits fails on it
    assert out.rewards.shape == out.gating_output.shape == (2, 4) and out.score.shape == (2,)
    assert torch.allclose(out.gating_output.sum(-1), torch.ones(2))
    assert torch.allclose(out.score, (out.gating_output * out.rewards).sum(-1))
    assert out.score[0] != out.score[1]
    # padded and batched, each conversation scores as it does alone
    assert out.score.tolist() == pytest.approx(
        armo_scores(armo, ["Review the phone Nova."] * 2, [c[1]["content"] for c in conversations]), abs=1e-5)


def test_its_code_imports_what_transformers_5_removed_as_armorms_does_and_the_stages_load_it(armo):
    """ArmoRM's code imports ``LLAMA_INPUTS_DOCSTRING``, which transformers 5 no longer has, so transformers alone
    cannot load it; the tiny model's code does the same, and loads once ``compat.allow_legacy_remote_code`` (which
    every stage given --trust-remote-code calls) has given the name back. In a fresh process: this one has it."""
    import subprocess
    import sys

    load = ("from transformers import AutoModelForSequenceClassification as A\n"
            f"A.from_pretrained({str(armo)!r}, trust_remote_code=True)\n")
    alone = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert alone.returncode != 0 and "LLAMA_INPUTS_DOCSTRING" in alone.stderr
    shimmed = subprocess.run([sys.executable, "-c", "from rlhf_pipeline.compat import allow_legacy_remote_code\n"
                              "allow_legacy_remote_code()\n" + load], capture_output=True, text=True)
    assert shimmed.returncode == 0, shimmed.stderr[-2000:]


def test_score_with_trust_remote_code_gives_each_response_the_models_score(armo, gens, tmp_path):
    out = tmp_path / "scored"
    assert run("score", "--input", gens, "--output", out, "--reward-model", armo, "--trust-remote-code",
               "--batch-size", 4) == 0
    ds = load_from_disk(str(out))
    prompts = [p for row in ds for p in [row["prompt"]] * len(row["responses"])]
    responses = [r for row in ds for r in row["responses"]]
    got = [x for row in ds["rewards"] for x in row]
    expected = armo_scores(armo, prompts, responses)
    assert len(got) == 6 and got == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 1e-3  # the responses' scores differ: the check is not empty
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["trust_remote_code"] is True
    assert manifest["reward"]["reward_model"] == str(armo)


@pytest.mark.parametrize("layout", ["own_model_type", "armorm"])
def test_without_the_flag_it_is_one_line_and_none_of_its_code_runs(layout, armo, gens, tmp_path, capsys):
    """``armorm``: ArmoRM's config.json, whose model_type is llama and whose auto_map names the reward head's class
    alone; without the check, transformers loaded it as LlamaForSequenceClassification with a new, random score
    head and the stage scored with that."""
    model = tmp_path / f"armo_{layout}"  # a name of its own: transformers caches remote code by directory name
    shutil.copytree(armo, model)
    marker = tmp_path / "imported"
    with (model / "modeling_tiny_armo.py").open("a") as f:  # the model's code leaves a mark when it is imported
        f.write(f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n")
    if layout == "armorm":
        config = json.loads((model / "config.json").read_text())
        config.update(model_type="llama", auto_map={"AutoModelForSequenceClassification": REMOTE_CLASS})
        (model / "config.json").write_text(json.dumps(config))

    capsys.readouterr()
    assert run("score", "--input", gens, "--output", tmp_path / "out", "--reward-model", model) == 1
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: --reward-model {model}: ships its own code for its reward head (config.json's auto_map: "
        f"AutoModelForSequenceClassification -> {REMOTE_CLASS}), which is not run unless allowed; read that code, "
        "then allow it with --trust-remote-code"], err
    assert "Traceback" not in err
    assert not marker.exists()
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))

    # the mark is left when the code does run: with the flag, and then the rewards are the model's score
    assert run("score", "--input", gens, "--output", tmp_path / "out", "--reward-model", model,
               "--trust-remote-code") == 0
    assert marker.read_text() == "imported"
    ds = load_from_disk(str(tmp_path / "out"))
    assert [x for row in ds["rewards"] for x in row] == pytest.approx(
        armo_scores(armo, [p for row in ds for p in [row["prompt"]] * 2], [r for row in ds for r in row["responses"]]),
        abs=1e-5)


@pytest.mark.parametrize("stage", ["eval", "iterate"])
def test_eval_and_iterate_refuse_it_before_they_start(stage, armo, tiny_policy, bundled_prompts, tmp_path, capsys):
    """rlhf eval takes --trust-remote-code as score does; rlhf iterate passes its score section's to every score."""
    allow = "--trust-remote-code" if stage == "eval" else "--score '{trust_remote_code: true}'"
    capsys.readouterr()
    assert run(stage, "--model", tiny_policy, "--prompts", bundled_prompts, "--reward-model", armo,
               "--output", tmp_path / "out") == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: --reward-model {armo}: ships its own code for its "
                                                     "reward head (config.json's auto_map: "), errors
    assert errors[0].endswith(f"read that code, then allow it with {allow}"), errors
    assert not (tmp_path / "out").exists()


def test_armorm_itself_from_the_hub_cache_is_refused_without_the_flag(monkeypatch, tmp_path):
    """The Hub id REBEL's recipe passes, offline, with ArmoRM's config.json (its fields that matter here) in the
    local Hub cache: refused without the flag before anything is loaded, accepted with it."""
    import huggingface_hub.constants

    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.modeling import check_reward_model

    repo, revision = "RLHFlow/ArmoRM-Llama3-8B-v0.1", "0" * 40
    cached = tmp_path / "models--RLHFlow--ArmoRM-Llama3-8B-v0.1"
    (cached / "refs").mkdir(parents=True)
    (cached / "refs" / "main").write_text(revision)
    snapshot = cached / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({
        "auto_map": {"AutoModelForSequenceClassification": "modeling_custom.LlamaForRewardModelWithGating"},
        "architectures": ["LlamaForRewardModelWithGating"], "model_type": "llama", "num_objectives": 19}))
    (snapshot / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PipelineError, match=r"^--reward-model RLHFlow/ArmoRM-Llama3-8B-v0.1: ships its own code for "
                       r"its reward head \(config.json's auto_map: AutoModelForSequenceClassification -> "
                       r"modeling_custom.LlamaForRewardModelWithGating\)"):
        check_reward_model("--reward-model", repo)
    check_reward_model("--reward-model", repo, trust_remote_code=True)


def test_what_config_json_says_about_a_reward_model():
    from rlhf_pipeline.modeling import reward_model_problem

    assert reward_model_problem({"architectures": ["GPT2LMHeadModel"]}, False).startswith(
        "is a causal language model (GPT2LMHeadModel), not a reward model")
    assert reward_model_problem({"architectures": ["Qwen2ForCausalLM"]}, True, judge=True).endswith(
        "with --reward-fn, or give it as --judge to compare answers pairwise")  # trusting code changes nothing here
    for fine in ({"architectures": ["LlamaForSequenceClassification"]}, {},
                 {"architectures": ["LlamaForCausalLM", "LlamaForSequenceClassification"]},  # not every one causal
                 {"architectures": ["LlamaForSequenceClassification"], "auto_map": ["a", "b"]}):  # a malformed map
        assert reward_model_problem(fine, False) is None, fine
    remote = {"architectures": ["TinyArmoForRewardModel"], "auto_map": {"AutoModelForSequenceClassification": "m.C"}}
    assert "auto_map: AutoModelForSequenceClassification -> m.C" in reward_model_problem(remote, False)
    assert reward_model_problem(remote, True) is None


@pytest.fixture(scope="module")
def armo_groups(armo, gens, tmp_path_factory, tiny_policy) -> Path:
    """The generations scored by the tiny ArmoRM and laid out as groups, as PPO trains on them."""
    d = tmp_path_factory.mktemp("armo_groups")
    assert run("score", "--input", gens, "--output", d / "scored", "--reward-model", armo, "--trust-remote-code") == 0
    assert run("filter", "--input", d / "scored", "--output", d / "groups", "--tokenizer", tiny_policy,
               "--mode", "groups", "--test-size", 1) == 0
    return d / "groups"


@pytest.mark.parametrize("how", ["--critic-model", "--critic-model, trusted", "the scoring model, trusted"])
def test_a_ppo_critic_from_a_model_with_its_own_head_code_is_one_line_before_anything_is_written(
        how, armo, armo_groups, tiny_policy, tmp_path, capsys):
    """PPO's critic reads a value at every token through a ``score`` head of one label. A model with its own
    reward-head code (ArmoRM's gating head) given as --critic-model has none: named in one line, the fix with it,
    before the output exists; with --trust-remote-code its code loads and the head it has is refused, also when it is
    the reward model that scored the data. Before the check these were transformers' traceback and a TypeError from
    deep in the rollout."""
    args = ["train", "--algo", "ppo", "--model", tiny_policy, "--data", armo_groups, "--output", tmp_path / "out",
            "--report-to", "none", "--max-steps", 1]
    if how.startswith("--critic-model"):
        args += ["--critic-model", armo]
    if how.endswith("trusted"):
        args += ["--trust-remote-code"]
    capsys.readouterr()
    assert run(*args) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    flag = "--critic-model" if how.startswith("--critic-model") else "the critic (the reward model that scored the data)"
    assert len(errors) == 1 and errors[0].startswith(f"error: {flag} {armo}: "), err
    if how.endswith("trusted"):
        assert "TinyArmoForRewardModel is not a sequence classifier with a `score` head of one label" in errors[0]
    else:
        assert (f"ships its own code for its reward head (config.json's auto_map: AutoModelForSequenceClassification "
                f"-> {REMOTE_CLASS})") in errors[0] and errors[0].endswith("if its head is one")
    assert "pass --critic-model with a reward model rlhf train-rm wrote, or with the policy" in errors[0]
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_data_scored_by_a_model_with_its_own_head_code_start_the_ppo_critic_from_the_policy(
        armo, armo_groups, tiny_policy, tmp_path, caplog):
    """REBEL's recipe scores with ArmoRM. PPO on such data, with no --critic-model and without --trust-remote-code,
    cannot start its critic from that model (its code may not run, and without it the model's own head is not
    there): it starts from the policy with a new value head, as for data scored by a python function, and says
    why."""
    import logging

    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "ppo"
    with caplog.at_level(logging.WARNING, logger="rlhf_pipeline"):
        assert run("train", "--algo", "ppo", "--model", tiny_policy, "--data", armo_groups, "--output", out,
                   "--report-to", "none", "--max-steps", 1, "--batch-size", 2) == 0
    assert json.loads((out / "manifest.json").read_text())["training"]["critic_model"] == tiny_policy
    said = [r.getMessage() for r in caplog.records if "has a reward head of its own code" in r.getMessage()]
    assert len(said) == 1 and str(armo) in said[0] and REMOTE_CLASS in said[0], said
    assert AutoModelForSequenceClassification.from_pretrained(out / "critic").score.weight.shape[0] == 1


def test_lora_on_a_reward_model_with_its_own_head_code_is_one_line(armo, tmp_path, capsys):
    """peft adapts a causal LM or a standard classifier; ArmoRM's layout (a regression layer and a gating network of
    its own code) failed inside peft with a traceback. Now one line, before anything is written."""
    pytest.importorskip("peft")
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Review the park number {i}.", "chosen": "Lovely trees.",
                                        "rejected": "Awful."}) + "\n" for i in range(4)))
    capsys.readouterr()
    assert run("train-rm", "--model", armo, "--trust-remote-code", "--data", data, "--output", tmp_path / "rm",
               "--test-size", 0, "--max-steps", 1, "--report-to", "none", "--lora-rank", 4) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--lora-rank: TinyArmoForRewardModel is neither a causal LM nor a standard sequence classifier" in line
    assert not (tmp_path / "rm").exists()
