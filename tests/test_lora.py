"""LoRA in every training stage (rlhf_pipeline.training.lora): the merge against peft's own, and for REBEL, DPO, GRPO, PPO (its
critic too), SFT and the reward model a run that trains only adapters, resumes to the uninterrupted result and saves
a merged model that loads without peft and computes what the trained adapters computed."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (LENGTH_REWARD, assert_same_gradient_norms, launch_cpu_zero3, logged, max_weight_diff, run,
                      write_jsonl)
from rlhf_pipeline.training import lora
from rlhf_pipeline.training import loop as trainer

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

REPO = Path(__file__).resolve().parents[1]
RANK = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    """generate -> score -> filter as pairs and as groups, plus SFT demonstrations and preference pairs as JSONL."""
    d = tmp_path_factory.mktemp("lora_data")
    (d / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", tiny_policy, "--prompts", bundled_prompts, "--output", d / "gen", "--n", 4,
               "--max-new-tokens", 12, "--limit", 24) == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored", "--reward-fn", f"{d}/reward.py:reward") == 0
    for mode in ("pairs", "groups"):
        assert run("filter", "--input", d / "scored", "--output", d / mode, "--tokenizer", tiny_policy,
                   "--mode", mode, "--test-size", 4) == 0
    write_jsonl(d / "sft.jsonl", [{"prompt": f"Review the park number {i}.", "answer": "The trees were lovely."
                                   if i % 2 else "Loud, dirty and dull."} for i in range(24)])
    write_jsonl(d / "prefs.jsonl", [{"prompt": f"Review the hotel number {i}.", "chosen": "Lovely rooms, kind staff.",
                                     "rejected": "Dirty and loud."} for i in range(24)])
    return d


# stage, its arguments, the model directories it writes (the policy's; PPO's critic too), learning rate
CASES = {
    "rebel": (["train", "--algo", "rebel", "--data", "{d}/pairs"], [""], 1e-2),
    "dpo": (["train", "--algo", "dpo", "--data", "{d}/pairs"], [""], 1e-2),
    "grpo": (["train", "--algo", "grpo", "--data", "{d}/groups"], [""], 1e-2),
    "ppo": (["train", "--algo", "ppo", "--data", "{d}/groups", "--critic-model", "{rm}"], ["", "critic"], 1e-2),
    "sft": (["sft", "--data", "{d}/sft.jsonl", "--test-size", 4], [""], 1e-2),
    "rm": (["train-rm", "--data", "{d}/prefs.jsonl", "--test-size", 4], [""], 1e-2),
}


def args_for(case: str, data: Path, policy: str, rm: str, out: Path, *extra) -> list:
    stage_args, _, lr = CASES[case]
    filled = [str(a).format(d=data, rm=rm) for a in stage_args]
    return [*filled, "--model", policy, "--output", out, "--report-to", "none", "--learning-rate", lr,
            "--warmup-ratio", 0.0, "--batch-size", 2, "--lora-rank", RANK, *extra]


def starting_model(case: str, part: str, policy: str, rm: str) -> str:
    return rm if part == "critic" else policy


def load_plain(path: Path, classifier: bool):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if classifier:
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    return AutoModelForCausalLM.from_pretrained(path).eval()


def assert_cut_run_resumes_to(full: Path, args: list, monkeypatch) -> None:
    """``args`` (a run writing its checkpoints) cut by Ctrl-C right after its first checkpoint, then rerun with
    --resume, ends with the losses and weights of the uninterrupted run in ``full``."""
    real_save = trainer.save_checkpoint

    def save_then_crash(*a, **kwargs):
        real_save(*a, **kwargs)
        raise KeyboardInterrupt  # as if Ctrl-C came right after the checkpoint

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_crash)
    assert run(*args) == 130
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    assert run(*args, "--resume") == 0
    cut = Path(args[args.index("--output") + 1])
    assert logged(cut) == pytest.approx(logged(full), abs=1e-6)
    assert max_weight_diff(cut, full) < 1e-6


@pytest.mark.parametrize("case", list(CASES))
def test_lora_trains_adapters_only_resumes_and_saves_a_merged_model(case, data, tiny_policy, tiny_rm, tmp_path,
                                                                     monkeypatch):
    common = ["--max-steps", 4, "--save-every", 2, "--keep-checkpoints"]
    assert run(*args_for(case, data, tiny_policy, tiny_rm, tmp_path / "full", *common)) == 0

    # Cut after the step-2 checkpoint, resumed: the same losses and the same merged weights.
    assert_cut_run_resumes_to(tmp_path / "full", args_for(case, data, tiny_policy, tiny_rm, tmp_path / "cut", *common),
                              monkeypatch)

    out = tmp_path / "full"
    for part in CASES[case][1]:
        where = out / part
        classifier = case == "rm" or part == "critic"
        start = starting_model(case, part, tiny_policy, tiny_rm)
        before, after = load_file(Path(start) / "model.safetensors"), load_file(where / "model.safetensors")
        assert after.keys() <= before.keys() | {"score.weight"}, "the merged model has peft's names in it"
        changed = {k for k in after if k in before and not torch.equal(before[k], after[k])}
        # Only the adapted linear layers (and a classifier's head, trained whole) move; embeddings and norms do not.
        assert changed and all(k.endswith("proj.weight") or k == "score.weight" for k in changed), changed
        assert any("layers.0.self_attn.q_proj" in k for k in changed) and any("mlp.down_proj" in k for k in changed)
        for k in changed - {"score.weight"}:  # each update is B A: rank <= R (up to float32 rounding of W + BA)
            assert torch.linalg.matrix_rank((after[k] - before[k]).double(), rtol=1e-4).item() <= RANK, k

        # The merged model (no peft) computes what the starting model with the saved adapter computes.
        merged = load_plain(where, classifier)
        adapted = peft.PeftModel.from_pretrained(load_plain(Path(start), classifier), str(where / "adapter")).eval()
        ids = torch.tensor([[1, 5, 9, 23, 7, 2, 11]])
        with torch.no_grad():
            assert merged(ids).logits == pytest.approx(adapted(ids).logits, abs=1e-5)

    assert json.loads((out / "manifest.json").read_text())["training"]["steps"] == 4
    # A checkpoint's resumable state holds only what trains (the adapters, a score head trained whole), not the
    # frozen model, which a resumed run loads again from its starting point.
    state = load_file(out / "checkpoints" / "step_000002" / "state" / "model.safetensors")
    assert state and all(".lora_A." in k or ".lora_B." in k or ".modules_to_save." in k for k in state), list(state)


def test_merge_equals_peffts_merge_and_unload(tiny_policy, tiny_rm):
    """merge_state_dict (W + alpha/r B A on the gathered state dict) against peft's merge_and_unload, for a causal
    LM and for a classifier (whose score head peft trains whole), with non-zero B and a non-default alpha."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for path, cls in ((tiny_policy, AutoModelForCausalLM), (tiny_rm, AutoModelForSequenceClassification)):
        options = lora.LoraOptions(lora_rank=4, lora_alpha=3.0)
        torch.manual_seed(0)
        model = lora.add_adapters(cls.from_pretrained(path), options)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name or "modules_to_save" in name:
                    p.normal_(0, 0.05)
        merged = lora.merge_state_dict(model.state_dict(), options.lora_scale)
        expected = model.merge_and_unload().state_dict()
        assert merged.keys() == expected.keys()
        for k in expected:
            assert merged[k] == pytest.approx(expected[k], abs=1e-6), k


def test_merge_transposes_gpt2_conv1d_updates_as_peft_does():
    """GPT-2's Conv1D layers store W as (in, out) (peft's fan_in_fan_out): the merge adds (B A)^T there."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    options = lora.LoraOptions(lora_rank=2)
    model = lora.add_adapters(model, options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    transposed = frozenset(lora._plain_name(n) for n, m in model.named_modules()
                           if hasattr(m, "lora_A") and getattr(m, "fan_in_fan_out", False))
    assert "transformer.h.0.attn.c_attn" in transposed  # a non-square Conv1D: without the transpose the shapes clash
    merged = lora.merge_state_dict(model.state_dict(), options.lora_scale, transposed)
    expected = model.merge_and_unload().state_dict()
    for k in expected:
        assert merged[k] == pytest.approx(expected[k], abs=1e-6), k


def test_adapters_on_the_lm_head_are_refused(tiny_policy):
    from transformers import AutoModelForCausalLM

    with pytest.raises(lora.PipelineError, match="adapters on the LM head are not supported"):
        lora.add_adapters(AutoModelForCausalLM.from_pretrained(tiny_policy),
                          lora.LoraOptions(lora_rank=2, lora_target_modules=["q_proj", "lm_head"]))


def test_lora_options_are_checked(tiny_policy, tmp_path, capsys):
    base = ["sft", "--model", tiny_policy, "--data", tmp_path / "x.jsonl", "--output", tmp_path / "o"]
    for extra, message in (
        (["--lora-alpha", 8], "--lora-alpha configure LoRA adapters; pass --lora-rank R"),
        (["--load-in-4bit"], "--load-in-4bit configure LoRA adapters"),
        (["--lora-rank", -1], "--lora-rank must be >= 0"),
        (["--lora-rank", 4, "--lora-dropout", 1.0], "--lora-dropout must be in [0, 1)"),
    ):
        assert run(*base, *extra) != 0
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["dpo", "rm"])
def test_qlora_trains_on_4bit_weights_resumes_and_merges_into_the_full_precision_model(case, data, tiny_policy,
                                                                                      tiny_rm, tmp_path, monkeypatch):
    """--load-in-4bit (bitsandbytes NF4, which runs on a CPU too): the frozen weights are 4-bit while training; the
    run resumes to the uninterrupted result; the saved model is the starting model at its own precision with the
    trained adapter merged (peft's merge_and_unload of the saved adapter), and carries no quantization config."""
    pytest.importorskip("bitsandbytes")
    common = ["--max-steps", 4, "--save-every", 2, "--load-in-4bit"]
    assert run(*args_for(case, data, tiny_policy, tiny_rm, tmp_path / "full", *common)) == 0
    assert_cut_run_resumes_to(tmp_path / "full", args_for(case, data, tiny_policy, tiny_rm, tmp_path / "cut", *common),
                              monkeypatch)

    out, classifier = tmp_path / "full", case == "rm"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    curve = logged(out)
    assert sum(curve[-2:]) / 2 < curve[0], curve  # 4 steps of 2 pairs: the last alone is noisy
    before, after = load_file(Path(tiny_policy) / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(after[k].dtype == torch.float32 for k in after)
    changed = {k for k in after if k in before and not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed), changed
    expected = peft.PeftModel.from_pretrained(load_plain(Path(tiny_policy), classifier), str(out / "adapter"))
    expected = expected.merge_and_unload().state_dict()
    for k in changed:
        assert after[k] == pytest.approx(expected[k], abs=1e-6), k


def test_a_target_that_matches_nothing_names_the_linear_layers(data, tiny_policy, tmp_path, capsys):
    assert run(*args_for("sft", data, tiny_policy, "", tmp_path / "t", "--lora-target-modules", "qkv")) == 1
    err = capsys.readouterr().err
    assert "--lora-target-modules qkv:" in err and "q_proj" in err and "down_proj" in err
    assert not (tmp_path / "t").exists()


def test_lora_batch_times_accumulation_is_invariant(data, tiny_policy, tiny_rm, tmp_path):
    common = ["--max-steps", 3]
    assert run(*args_for("dpo", data, tiny_policy, tiny_rm, tmp_path / "b4", *common, "--batch-size", 4)) == 0
    assert run(*args_for("dpo", data, tiny_policy, tiny_rm, tmp_path / "b1", *common, "--batch-size", 1,
                         "--gradient-accumulation-steps", 4)) == 0
    assert logged(tmp_path / "b4") == pytest.approx(logged(tmp_path / "b1"), abs=1e-5)
    assert_same_gradient_norms(tmp_path / "b4", tmp_path / "b1")
    assert max_weight_diff(tmp_path / "b4", tmp_path / "b1") < 1e-5


@pytest.mark.parametrize("case, extra", [("dpo", ()), ("ppo", ()), ("rm", ("--load-in-4bit",))])
def test_lora_two_process_zero3_equals_one_process(case, extra, data, tiny_policy, tiny_rm, tmp_path):
    """2 processes x batch 1 under DeepSpeed ZeRO-3 (CPU, gloo) against 1 process x batch 1 x accumulation 2: the
    adapters' (and PPO's critic's) updates, and the merged models gathered from the shards, agree. QLoRA too, whose
    4-bit codes DeepSpeed keeps in float storage (some read as NaN: the finite check is on trained weights) and
    whose merge reloads the starting model on the main process alone."""
    if extra:
        pytest.importorskip("bitsandbytes")
    common = ["--max-steps", 3, "--batch-size", 1, *extra]
    assert run(*args_for(case, data, tiny_policy, tiny_rm, tmp_path / "single", *common,
                         "--gradient-accumulation-steps", 2)) == 0
    launch_cpu_zero3(args_for(case, data, tiny_policy, tiny_rm, tmp_path / "zero3", *common))
    assert logged(tmp_path / "zero3") == pytest.approx(logged(tmp_path / "single"), abs=1e-5)
    for part in CASES[case][1]:
        assert max_weight_diff(tmp_path / "zero3" / part, tmp_path / "single" / part) < 1e-5
        adapter = "adapter/adapter_model.safetensors"
        a, b = load_file(tmp_path / "zero3" / part / adapter), load_file(tmp_path / "single" / part / adapter)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_a_qlora_reward_model_keeps_the_pad_id_it_read_its_rewards_at(data, tiny_policy, tmp_path):
    """From a base whose config has no pad id (Llama-3's), train-rm sets one on the model it trains; QLoRA's merge
    loads the base again and saved that config, without it, and transformers' classifier then refuses batches of
    more than one."""
    pytest.importorskip("bitsandbytes")
    import shutil

    from transformers import AutoModelForSequenceClassification

    base = Path(shutil.copytree(tiny_policy, tmp_path / "base"))
    config = json.loads((base / "config.json").read_text())
    config["pad_token_id"] = None
    (base / "config.json").write_text(json.dumps(config))
    out = tmp_path / "rm"
    assert run(*args_for("rm", data, str(base), "", out, "--max-steps", 1, "--load-in-4bit")) == 0
    assert json.loads((out / "config.json").read_text())["pad_token_id"] is not None
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        assert model(torch.tensor([[5, 6, 7], [8, 9, 10]])).logits.shape == (2, 1)
