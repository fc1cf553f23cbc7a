"""Integration: ref-logps and train on pairs the tiny kit's stages made, checked as a user would check them."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from rlhf_pipeline.training import loop as trainer
from conftest import (
    assert_same_gradient_norms,
    crash_after_checkpoint,
    launch_cpu_zero3,
    logged,
    make_pairs,
    max_weight_diff,
    micro_batch_sizes,
    run,
    spy_token_budget_plans,
)

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    """Pairs (with reference log-probs at the sampling temperature) from generate -> score -> filter -> ref-logps."""
    return make_pairs(tmp_path_factory.mktemp("train_data"), tiny_policy, bundled_prompts, limit=56, test_size=8)


def train_args(pairs: Path, policy: str, out: Path, *extra, data: str = "ref") -> list:
    return ["train", "--model", policy, "--data", pairs / data, "--output", out, "--report-to", "none", *extra]


def test_ref_logps_use_the_sampling_temperature(pairs, tiny_policy):
    from rlhf_pipeline.chat import load_tokenizer
    from rlhf_pipeline.logprobs import build_batch, sequence_logps
    from rlhf_pipeline.modeling import load_causal_lm

    manifest = json.loads((pairs / "ref" / "manifest.json").read_text())
    assert manifest["ref_logps"]["temperature"] == 0.8  # read from the generate manifest, not retyped
    assert manifest["ref_logps"]["dtype"] == "float32"  # auto, on a CPU
    dd = load_from_disk(str(pairs / "ref"))
    row = dd["test"][0]
    model, tok = load_causal_lm(tiny_policy), load_tokenizer(tiny_policy)
    batch = build_batch([row["prompt_token_ids"]], [row["chosen_token_ids"]], tok.pad_token_id)
    with torch.no_grad():
        expected = sequence_logps(model, batch, temperature=0.8).item()
    assert row["chosen_ref_logp"] == pytest.approx(expected, abs=1e-4)
    assert all(v < 0 for v in dd["train"]["rejected_ref_logp"])


def test_ref_logps_for_the_dpo_family_take_its_temperature(pairs, tiny_policy, tmp_path):
    """Pairs serve REBEL (log-probs at the sampling temperature) and the DPO family (1.0): --algo says which, so the
    columns are the ones rlhf train --algo dpo takes without a --temperature of its own."""
    assert run("ref-logps", "--model", tiny_policy, "--input", pairs / "pairs", "--output", tmp_path / "ref",
               "--algo", "dpo") == 0
    assert json.loads((tmp_path / "ref" / "manifest.json").read_text())["ref_logps"]["temperature"] == 1.0
    dd, sampled = load_from_disk(str(tmp_path / "ref")), load_from_disk(str(pairs / "ref"))
    assert dd["train"]["chosen_ref_logp"] != pytest.approx(sampled["train"]["chosen_ref_logp"], abs=1e-3)
    assert run(*train_args(tmp_path, tiny_policy, tmp_path / "dpo", "--algo", "dpo", "--max-steps", 1,
                           "--batch-size", 2)) == 0
    assert not (tmp_path / "dpo" / "ref_logps").exists()  # the columns were taken, not computed again


def test_reference_columns_of_another_precision_are_refused(pairs, tiny_policy, tmp_path, capsys):
    """At its first step the policy is the reference: columns computed in bfloat16 (rlhf ref-logps' default on a GPU)
    against float32 log-probs of the policy (rlhf train's default) differ by rounding alone, which the loss would
    train on. Either way round, one line saying both fixes."""
    common = ["--algo", "dpo", "--max-steps", 1, "--temperature", 0.8]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "bf16", *common, "--bf16")) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {pairs / 'ref'}: its reference log-probs were computed in float32, but this run computes the "
        "policy's in bfloat16: at the first step the two would differ by rounding alone, which the loss would train "
        "on; remove --bf16, or recompute them with rlhf ref-logps --dtype bfloat16")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # the run above set up bf16 mixed precision in this process
    assert run("ref-logps", "--model", tiny_policy, "--input", pairs / "pairs", "--output", tmp_path / "ref_bf16",
               "--dtype", "bfloat16") == 0
    assert run(*train_args(pairs, tiny_policy, tmp_path / "fp32", *common, data=str(tmp_path / "ref_bf16"))) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "computed in bfloat16, but this run computes the policy's in float32: at the first step the two would differ "
        "by rounding alone, which the loss would train on; add --bf16, or recompute them with rlhf ref-logps --dtype "
        "float32")
    # refused while the inputs are read: no run was started, so the fixed command starts afresh
    assert not (tmp_path / "bf16").exists() and not (tmp_path / "fp32").exists()


def test_reference_columns_at_another_temperature_are_refused_before_the_run_starts(pairs, tiny_policy, tmp_path,
                                                                                    capsys):
    """The columns of the sampling temperature (REBEL's, ref-logps' default on pairs) under DPO, which takes 1.0:
    one line naming the fix, ref-logps --algo dpo, and nothing written (the check ran after the run had started and
    the model was loaded, and the corrected command was then refused as another run)."""
    out = tmp_path / "dpo"
    assert run(*train_args(pairs, tiny_policy, out, "--algo", "dpo", "--max-steps", 1)) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {pairs / 'ref'}: its reference log-probs were computed at temperature 0.8, but --algo dpo takes "
        "log-probs at 1 here; recompute them with rlhf ref-logps --algo dpo, or pass --temperature 0.8 to train at "
        "theirs")
    assert not out.exists()
    assert run(*train_args(pairs, tiny_policy, out, "--algo", "dpo", "--max-steps", 1, data="pairs")) == 0


# REBEL on pairs with precomputed reference log-probs; DPO on pairs without, so train computes them itself.
@pytest.mark.parametrize("algo, lr, data", [("rebel", 1e-4, "ref"), ("dpo", 2e-3, "pairs")])
def test_training_lowers_the_loss_changes_every_parameter_and_saves_a_loadable_model(
    algo, lr, data, pairs, tiny_policy, tmp_path
):
    out = tmp_path / algo
    assert run(*train_args(pairs, tiny_policy, out, "--algo", algo, "--max-steps", 30, "--batch-size", 4,
                           "--learning-rate", lr, "--warmup-ratio", 0.0, data=data)) == 0
    curve = logged(out)
    assert len(curve) == 30
    assert sum(curve[-5:]) / 5 < 0.7 * sum(curve[:5]) / 5, curve

    before, after = load_file(Path(tiny_policy) / "model.safetensors"), load_file(out / "model.safetensors")
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, f"parameters that did not change: {unchanged}"

    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*records)
    assert {"loss/train", "loss/eval", "reward/accuracy", "throughput/tokens_per_s", "lr", "grad_norm"} <= keys
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["steps"] == 30 and manifest["training"]["algo"] == algo
    assert manifest["training"]["logp_temperature"] == (0.8 if algo == "rebel" else 1.0)
    assert manifest["training"]["sampler"] == {"model": manifest["sampling"]["model"], "is_trained_policy": True}
    assert (out / "ref_logps").exists() == (data == "pairs")  # computed once, kept for a resumed run

    from rlhf_pipeline.chat import encode_prompts, load_tokenizer, stop_token_ids
    from rlhf_pipeline.engines import SamplingSettings
    from rlhf_pipeline.engines.hf import HFEngine

    tok = load_tokenizer(str(out))
    sampling = SamplingSettings(2, 0.8, 0.9, 0, 8, 0, tuple(stop_token_ids(tok, str(out))))
    (completion,) = HFEngine(str(out), tok).generate(encode_prompts(tok, ["Review the park."]), [0], sampling)
    assert len(completion.token_ids) == 2 and all(1 <= len(ids) <= 8 for ids in completion.token_ids)


def test_varlen_attention_trains_and_scores_as_sdpa_and_is_recorded(pairs, tiny_policy, tmp_path):
    """--attn-implementation varlen (each micro-batch one unpadded row; on a CPU the per-sequence reference) gives
    the packed sdpa run's losses and weights, and ref-logps' values, to float rounding; the manifests record it."""
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 3, "--batch-size", 4, "--learning-rate", 1e-3]
    for attn in ("sdpa", "varlen"):
        assert run(*train_args(pairs, tiny_policy, tmp_path / attn, *common, "--attn-implementation", attn)) == 0
    curve = logged(tmp_path / "sdpa")
    assert len(set(curve)) == 3  # the updates changed the losses: the comparison covers the gradients
    assert logged(tmp_path / "varlen") == pytest.approx(curve, abs=1e-5)  # as test_batch_times_accumulation_...
    assert max_weight_diff(tmp_path / "sdpa", tmp_path / "varlen") < 1e-4
    manifest = json.loads((tmp_path / "varlen" / "manifest.json").read_text())
    assert manifest["config"]["attn_implementation"] == "varlen"
    assert "attn_implementation" not in json.loads((tmp_path / "varlen" / "config.json").read_text())

    assert run("ref-logps", "--model", tiny_policy, "--input", pairs / "pairs", "--output", tmp_path / "ref",
               "--attn-implementation", "varlen") == 0
    assert json.loads((tmp_path / "ref" / "manifest.json").read_text())["config"]["attn_implementation"] == "varlen"
    ours, sdpa = load_from_disk(str(tmp_path / "ref")), load_from_disk(str(pairs / "ref"))
    for split in sdpa:
        for column in ("chosen_ref_logp", "rejected_ref_logp"):
            assert ours[split][column] == pytest.approx(sdpa[split][column], abs=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_2_without_flash_attn_is_one_line(pairs, tiny_policy, tmp_path, capsys):
    out = tmp_path / "fa2"
    assert run(*train_args(pairs, tiny_policy, out, "--max-steps", 1, "--attn-implementation",
                           "flash_attention_2")) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: --attn-implementation flash_attention_2: the flash-attn package is not installed; pip "
                   "install flash-attn (a CUDA build), or use --attn-implementation varlen (PyTorch's own "
                   "variable-length attention) or sdpa")
    assert not out.exists()


def test_batch_times_accumulation_is_invariant(pairs, tiny_policy, tmp_path):
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 3, "--learning-rate", 1e-3]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "b4", *common, "--batch-size", 4)) == 0
    assert run(*train_args(pairs, tiny_policy, tmp_path / "b1", *common, "--batch-size", 1,
                           "--gradient-accumulation-steps", 4)) == 0
    assert logged(tmp_path / "b4") == pytest.approx(logged(tmp_path / "b1"), abs=1e-5)
    assert_same_gradient_norms(tmp_path / "b4", tmp_path / "b1")
    assert max_weight_diff(tmp_path / "b4", tmp_path / "b1") < 1e-4


def test_gradient_checkpointing_checkpoints_every_layer_and_trains_as_without(pairs, tiny_policy, tmp_path,
                                                                              monkeypatch):
    """--gradient-checkpointing: every decoder layer recomputed in backward, asked for under transformers' current name
    (its old one warns that it goes in v6), and the same steps as without it."""
    import warnings

    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.modeling import enable_activation_checkpointing

    checkpointed = []
    real = enable_activation_checkpointing

    def spy(model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            real(model)
        assert not [w for w in caught if "checkpointing_enable" in str(w.message)]
        checkpointed.append([layer.gradient_checkpointing for layer in model.model.layers])

    monkeypatch.setattr(trainer, "enable_activation_checkpointing", spy)
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 3, "--learning-rate", 1e-3, "--batch-size", 4]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "plain", *common)) == 0
    assert checkpointed == []
    assert run(*train_args(pairs, tiny_policy, tmp_path / "checkpointed", *common, "--gradient-checkpointing")) == 0
    layers = AutoModelForCausalLM.from_pretrained(tiny_policy).config.num_hidden_layers
    assert checkpointed == [[True] * layers]
    assert logged(tmp_path / "checkpointed") == pytest.approx(logged(tmp_path / "plain"), abs=1e-6)
    assert max_weight_diff(tmp_path / "checkpointed", tmp_path / "plain") < 1e-6


def test_a_token_budget_trains_as_batching_by_count(pairs, tiny_policy, tmp_path, monkeypatch):
    """--max-tokens-per-micro-batch 250 cuts each global batch of 8 pairs (60-90 tokens each) into micro-batches of
    1 to 3 pairs instead of 2 of 4; weighted by their pairs, they give the same losses and weights."""
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 3, "--learning-rate", 1e-3, "--batch-size", 4,
              "--gradient-accumulation-steps", 2]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "count", *common)) == 0
    plans = spy_token_budget_plans(monkeypatch)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "tokens", *common, "--max-tokens-per-micro-batch", 250)) == 0
    assert len(plans) == 3 and len(micro_batch_sizes(plans) - {4}) >= 2, plans
    assert logged(tmp_path / "tokens") == pytest.approx(logged(tmp_path / "count"), abs=1e-5)
    assert logged(tmp_path / "tokens", "reward/train_margin") == pytest.approx(
        logged(tmp_path / "count", "reward/train_margin"), abs=1e-5)
    assert logged(tmp_path / "tokens", "loss/eval") == pytest.approx(logged(tmp_path / "count", "loss/eval"), abs=1e-5)
    assert max_weight_diff(tmp_path / "tokens", tmp_path / "count") < 1e-4


@pytest.mark.parametrize("algo", ["orpo", "cpo"])
def test_reference_free_pair_losses_train_invariant_to_accumulation_and_resume(algo, pairs, tiny_policy, tmp_path,
                                                                              monkeypatch):
    """ORPO and CPO need no reference log-probs (plain pairs): batch 4 and batch 1 x accumulation 4 give the same
    run, and a run cut after its step-2 checkpoint resumes to the same end. (That they learn: the demo.)"""
    common = ["--algo", algo, "--max-steps", 4, "--learning-rate", 1e-3]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "b4", *common, "--batch-size", 4, data="pairs")) == 0
    assert run(*train_args(pairs, tiny_policy, tmp_path / "b1", *common, "--batch-size", 1,
                           "--gradient-accumulation-steps", 4, data="pairs")) == 0
    assert logged(tmp_path / "b1") == pytest.approx(logged(tmp_path / "b4"), abs=1e-5)
    assert max_weight_diff(tmp_path / "b1", tmp_path / "b4") < 1e-4
    assert not (tmp_path / "b4" / "ref_logps").exists()  # reference-free: no reference pass
    loss = logged(tmp_path / "b4")
    assert len(loss) == 4 and all(math.isfinite(x) for x in loss)

    cut = [*common, "--batch-size", 4, "--save-every", 2]
    crash_after_checkpoint(monkeypatch, 2)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *cut, data="pairs")) == 130
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *cut, "--resume", data="pairs")) == 0
    assert logged(tmp_path / "cut") == pytest.approx(loss, abs=1e-6)
    assert max_weight_diff(tmp_path / "cut", tmp_path / "b4") < 1e-6


def test_interrupted_run_resumed_equals_uninterrupted(pairs, tiny_policy, tmp_path, monkeypatch, capsys):
    common = ["--algo", "rebel", "--max-steps", 6, "--batch-size", 2, "--save-every", 2, "--learning-rate", 1e-3,
              "--keep-checkpoints"]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "full", *common)) == 0

    real_save = trainer.save_checkpoint

    def save_then_crash(accelerator, model, tokenizer, output, state, **kwargs):
        path = real_save(accelerator, model, tokenizer, output, state, **kwargs)
        if state["step"] == 4:
            raise KeyboardInterrupt  # as if Ctrl-C came right after the step-4 checkpoint
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_crash)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common)) == 130  # Ctrl-C's exit status
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    assert not (tmp_path / "cut" / "manifest.json").exists()
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common)) == 1  # unfinished: needs --resume
    other = [a if a != 1e-3 else 5e-4 for a in common]  # another learning rate cannot continue this run
    capsys.readouterr()
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *other, "--resume")) == 1
    assert "started with another config or inputs (learning_rate 0.001 -> 0.0005)" in capsys.readouterr().err
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common, "--resume")) == 0
    resumed, whole = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("cut", "full"))
    assert resumed["resumed"] is True and resumed["training"]["resumed_from_step"] == 4 and "resumed" not in whole

    assert logged(tmp_path / "cut") == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    assert logged(tmp_path / "cut", "lr") == pytest.approx(logged(tmp_path / "full", "lr"), rel=1e-9)
    assert max_weight_diff(tmp_path / "cut", tmp_path / "full") < 1e-6
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    # no custom object in a checkpoint: accelerate pickles them and loads them with weights_only=False (a file that
    # can run code); the scheduler is set from the step instead (its RNG states load with weights_only=True)
    assert not list((tmp_path / "full" / "checkpoints").rglob("custom_checkpoint_*"))


class _Planted:
    """Pickled, it makes its loader create a file: a pickle that runs code when loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_of_an_earlier_version_resumes_without_loading_its_pickled_scheduler(pairs, tiny_policy, tmp_path,
                                                                                          monkeypatch):
    """Checkpoints written before the scheduler left them hold accelerate's custom_checkpoint_0.pkl, which accelerate
    loads with weights_only=False (code runs) and which made load_state refuse the state once nothing is registered:
    the run resumes from the step as any other, and the pickle is never loaded."""
    import torch

    from conftest import crash_after_checkpoint

    common = ["--algo", "rebel", "--max-steps", 4, "--batch-size", 2, "--save-every", 2, "--learning-rate", 1e-3]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "full", *common)) == 0
    crash_after_checkpoint(monkeypatch, 2)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common)) == 130
    marker = tmp_path / "the pickle ran"
    torch.save({"scheduler": _Planted(str(marker))},
               tmp_path / "cut" / "checkpoints" / "step_000002" / "state" / "custom_checkpoint_0.pkl")
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common, "--resume")) == 0
    assert not marker.exists()
    for key in ("loss/train", "lr"):
        assert logged(tmp_path / "cut", key) == pytest.approx(logged(tmp_path / "full", key), rel=1e-6), key


def test_a_run_whose_policy_was_trained_again_since_does_not_resume(pairs, tiny_policy, tmp_path, monkeypatch,
                                                                     capsys):
    """--resume continues only from the --model it started from: a policy retrained into that directory since (a new
    output_id) would mix its weights or its adapters' base with the old run's checkpoints and reference log-probs."""
    import shutil

    policy = Path(shutil.copytree(tiny_policy, tmp_path / "policy"))
    (policy / "manifest.json").write_text(json.dumps({"stage": "sft", "output_id": "first"}))
    common = ["--algo", "dpo", "--max-steps", 4, "--batch-size", 2, "--save-every", 2]
    crash_after_checkpoint(monkeypatch, 2)
    assert run(*train_args(pairs, str(policy), tmp_path / "cut", *common, data="pairs")) == 130
    (policy / "manifest.json").write_text(json.dumps({"stage": "sft", "output_id": "second"}))
    capsys.readouterr()
    assert run(*train_args(pairs, str(policy), tmp_path / "cut", *common, "--resume", data="pairs")) == 1
    assert "model was made again since" in capsys.readouterr().err
    (policy / "manifest.json").write_text(json.dumps({"stage": "sft", "output_id": "first"}))
    assert run(*train_args(pairs, str(policy), tmp_path / "cut", *common, "--resume", data="pairs")) == 0


def test_a_run_is_resumed_on_as_many_processes_as_it_ran_on(pairs, tiny_policy, tmp_path, monkeypatch, capsys):
    """Another process count would change the global batch (and a ZeRO checkpoint's shards would not load, each then
    set aside as damaged): refused in one line before any checkpoint loads, the checkpoints left as they are."""
    common = ["--algo", "rebel", "--max-steps", 4, "--batch-size", 2, "--save-every", 2]
    crash_after_checkpoint(monkeypatch, 2)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common)) == 130
    state_file = tmp_path / "cut" / "checkpoints" / "step_000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["processes"] == 1
    state_file.write_text(json.dumps(dict(state, processes=2)))  # as a 2-process launch would have saved it
    capsys.readouterr()
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common, "--resume")) == 1
    err = capsys.readouterr().err
    assert "was saved by a run on 2 processes, and this launch has 1" in err and "Traceback" not in err
    assert [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()] == ["step_000002"]
    # under another ZeRO stage the optimizer's state is laid out otherwise: it failed to load, blamed on memory or
    # package versions
    assert state["zero_stage"] is None
    state_file.write_text(json.dumps(dict(state, zero_stage=3)))  # as a ZeRO-3 launch would have saved it
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common, "--resume")) == 1
    err = capsys.readouterr().err
    assert ("was saved by a run under DeepSpeed ZeRO stage 3, and this launch has no DeepSpeed: the optimizer's state "
            "would not load; resume it with the accelerate config it started with") in err
    assert [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()] == ["step_000002"]


def test_a_checkpoint_from_before_the_launch_was_recorded_is_held_to_the_launch_its_files_show(
        pairs, tiny_policy, tmp_path, monkeypatch, capsys):
    """Checkpoints of earlier versions have no 'processes' or 'zero_stage' in their trainer state: resumed under
    another launch they failed to load with an error that blamed memory or package versions. Their files show the
    launch (one random_states_N.pkl a process; DeepSpeed's model states, one a process under ZeRO-3): the same
    one-line refusals, and one that matches still resumes."""
    import shutil

    from rlhf_pipeline.files import seal

    common = ["--algo", "rebel", "--max-steps", 4, "--batch-size", 2, "--save-every", 2]
    crash_after_checkpoint(monkeypatch, 2)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common)) == 130
    checkpoint = tmp_path / "cut" / "checkpoints" / "step_000002"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    older = {k: v for k, v in state.items() if k not in ("processes", "zero_stage")}
    (checkpoint / "trainer_state.json").write_text(json.dumps(older))
    shutil.copy(checkpoint / "state" / "random_states_0.pkl", checkpoint / "state" / "random_states_1.pkl")
    seal(checkpoint)  # its record of its files' sizes, as the run would have written it
    capsys.readouterr()
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common, "--resume")) == 1
    err = capsys.readouterr().err
    assert "was saved by a run on 2 processes, and this launch has 1" in err and "did not load" not in err
    (checkpoint / "state" / "random_states_1.pkl").unlink()
    zero = checkpoint / "state" / "pytorch_model"
    zero.mkdir()
    for rank in (0, 1):
        (zero / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"")
    seal(checkpoint)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common, "--resume")) == 1
    err = capsys.readouterr().err
    assert "was saved by a run under DeepSpeed ZeRO stage 3, and this launch has no DeepSpeed" in err
    shutil.rmtree(zero)
    seal(checkpoint)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "cut", *common, "--resume")) == 0
    assert "resuming from" in capsys.readouterr().out


def test_the_launch_a_checkpoints_files_show_and_the_launches_it_loads_under(tmp_path):
    """DeepSpeed's files name the stage only as 3 or below 3 (ZeRO-0 in bf16 and ZeRO-1/2 name their optimizer files
    alike): a checkpoint below 3 is held to a DeepSpeed launch below 3, and recorded stages 1 and 2 load alike."""
    from rlhf_pipeline.training.checkpoints import BELOW_ZERO3, _launch_by_files, _same_layout

    state = tmp_path / "state"
    state.mkdir()
    assert _launch_by_files(tmp_path) == {"zero_stage": None}
    (state / "random_states_0.pkl").write_bytes(b"")
    (state / "random_states_1.pkl").write_bytes(b"")
    (state / "pytorch_model").mkdir()
    (state / "pytorch_model" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (state / "pytorch_model" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert _launch_by_files(tmp_path) == {"processes": 2, "zero_stage": BELOW_ZERO3}
    (state / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    assert _launch_by_files(tmp_path)["zero_stage"] == 3
    assert [_same_layout(BELOW_ZERO3, now) for now in (None, 0, 1, 2, 3)] == [False, True, True, True, False]
    assert [_same_layout(1, now) for now in (None, 0, 1, 2, 3)] == [False, False, True, True, False]
    assert [_same_layout(None, now) for now in (None, 2, 3)] == [True, False, False]


def test_save_total_limit_keeps_the_newest_and_resumes_from_them(pairs, tiny_policy, tmp_path, monkeypatch):
    common = ["--algo", "rebel", "--max-steps", 5, "--batch-size", 2, "--save-every", 1, "--learning-rate", 1e-3,
              "--keep-checkpoints"]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "all", *common, "--save-total-limit", 0)) == 0
    assert run(*train_args(pairs, tiny_policy, tmp_path / "two", *common)) == 0  # the default: 2
    names = ["checkpoints/step_000003", "checkpoints/step_000004"]  # step 5 is the final model, not a checkpoint
    assert sorted(f"checkpoints/{p.name}" for p in (tmp_path / "two" / "checkpoints").iterdir()) == names
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["checkpoints"] == names
    assert len(json.loads((tmp_path / "all" / "manifest.json").read_text())["checkpoints"]) == 4

    real_save = trainer.save_checkpoint
    seen = []

    def save_then_crash(accelerator, model, tokenizer, output, state, **kwargs):
        path = real_save(accelerator, model, tokenizer, output, state, **kwargs)
        seen.append(sorted(p.name for p in (output / "checkpoints").iterdir()))
        if state["step"] == 3:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_crash)
    cut = [*common, "--save-total-limit", 1]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "one", *cut)) == 130
    assert seen[-1] == ["step_000003"]  # only the newest, and the older ones went once it was complete
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "one", *cut, "--resume")) == 0
    assert max_weight_diff(tmp_path / "one", tmp_path / "all") < 1e-6
    assert sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir()) == ["step_000004"]


def test_a_policy_pushed_to_a_branch_of_a_private_repo_is_pulled_back_with_its_manifest(tmp_path, monkeypatch):
    """--hub-config on a training stage names a branch of the model repo (rlhf iterate: iter<t>-train); --private
    creates the repo private; what iterate --resume reads back is the model and the manifest, without checkpoints."""
    import fake_hub
    from rlhf_pipeline.datasets_io import HubTarget, hub_manifest, pull_output
    from rlhf_pipeline.training.stage import push_model_to_hub

    hub = tmp_path / "hub"
    fake_hub.install(monkeypatch.setattr, hub)
    model = tmp_path / "train"
    (model / "checkpoints" / "step_000002").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    manifest = {"stage": "train", "output_id": "abc", "push": {"repo_id": "org/run", "config": "iter1-train",
                                                                "pushed": True}}
    target = HubTarget("org/run", "iter1-train", private=True)
    push_model_to_hub(model, target, json.dumps(manifest).encode())
    assert fake_hub.is_private(hub, "model", "org/run")
    assert hub_manifest(target, model=True) == manifest
    assert hub_manifest(HubTarget("org/run", "iter2-train"), model=True) is None  # another iteration's branch
    assert hub_manifest(HubTarget("org/run"), model=True) is None  # nothing on main
    pull_output(target, tmp_path / "pulled", manifest, model=True)
    assert sorted(p.name for p in (tmp_path / "pulled").iterdir()) == ["config.json", "manifest.json",
                                                                         "model.safetensors"]
    assert json.loads((tmp_path / "pulled" / "manifest.json").read_text()) == manifest


def test_a_finished_run_deletes_its_checkpoints_unless_kept(pairs, tiny_policy, tmp_path, capsys):
    """By default a run keeps 2 checkpoints while it trains and deletes them once its final model and manifest are
    written; the model is the one a run that kept them wrote. A negative limit is one line naming the option."""
    common = ["--algo", "rebel", "--max-steps", 4, "--batch-size", 2, "--save-every", 1, "--learning-rate", 1e-3]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "kept", *common, "--keep-checkpoints")) == 0
    assert sorted(p.name for p in (tmp_path / "kept" / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "gone", *common)) == 0
    assert not (tmp_path / "gone" / "checkpoints").exists()
    assert json.loads((tmp_path / "gone" / "manifest.json").read_text())["checkpoints"] == []
    assert max_weight_diff(tmp_path / "gone", tmp_path / "kept") == 0.0
    capsys.readouterr()
    assert run(*train_args(pairs, tiny_policy, tmp_path / "bad", *common, "--save-total-limit", -1)) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "--save-total-limit -1: must be >= 0 (0 = keep every checkpoint)" in line, line


def test_finished_run_is_not_redone_and_pushes_only_the_model(pairs, tiny_policy, tmp_path, capsys, monkeypatch):
    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            uploads.append(("create", repo_id))

        def list_repo_files(self, repo_id, **kw):
            return []  # a new repo

        def upload_folder(self, **kw):
            uploads.append(("upload", kw["repo_id"], kw["folder_path"], kw["ignore_patterns"]))

        def upload_file(self, **kw):
            uploads.append(("file", kw["repo_id"], kw["path_in_repo"], json.loads(kw["path_or_fileobj"])["push"]))

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    args = train_args(pairs, tiny_policy, tmp_path / "once", "--algo", "rebel", "--max-steps", 2,
                      "--push-to-hub", "org/tiny-rebel")
    assert run(*args) == 0
    assert uploads == [("create", "org/tiny-rebel"),
                       ("upload", "org/tiny-rebel", str(tmp_path / "once"),
                        ["checkpoints/*", "runs/*", "ref_logps/*", "rollout/*", "manifest.json"]),
                       ("file", "org/tiny-rebel", "manifest.json", {"repo_id": "org/tiny-rebel", "pushed": True})]
    assert json.loads((tmp_path / "once" / "manifest.json").read_text())["push"]["pushed"] is True
    stamp = (tmp_path / "once" / "manifest.json").read_text()
    capsys.readouterr()
    assert run(*args) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (tmp_path / "once" / "manifest.json").read_text() == stamp


@pytest.mark.parametrize("stage", [2, 3])
def test_two_process_zero3_equals_one_process(pairs, tiny_policy, tmp_path, stage):
    """2 processes x batch 2 under DeepSpeed ZeRO-3 (CPU, gloo) against 1 process x batch 2 x accumulation 2; and
    under ZeRO-2 (accelerate_cfgs/zero2.yaml's stage), the optimizer state partitioned but the weights whole. With
    TensorBoard on, as the GPU scripts run: finishing the tracker must leave the process group to the stage's last
    steps (accelerate's end_training destroyed it, and every multi-process run with a tracker failed at its end)."""
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 4, "--learning-rate", 1e-3]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "single", *common, "--batch-size", 2,
                           "--gradient-accumulation-steps", 2)) == 0
    res = launch_cpu_zero3(train_args(pairs, tiny_policy, tmp_path / "zero3", *common, "--batch-size", 2,
                                      "--report-to", "tensorboard"), stage=stage)
    assert list((tmp_path / "zero3" / "runs").glob("events.out.tfevents.*"))
    assert logged(tmp_path / "zero3") == pytest.approx(logged(tmp_path / "single"), abs=1e-5)
    assert logged(tmp_path / "zero3", "loss/eval") == pytest.approx(logged(tmp_path / "single", "loss/eval"), abs=1e-5)
    assert max_weight_diff(tmp_path / "zero3", tmp_path / "single") < 1e-4
    # the learning rates are the single run's (logged equal above): torch's warning that the scheduler stepped
    # before the optimizer, which DeepSpeed's engine steps on its own, would only alarm a user
    assert "lr_scheduler.step()" not in res.stderr
    assert logged(tmp_path / "zero3", "lr") == pytest.approx(logged(tmp_path / "single", "lr"))


def test_two_process_zero3_with_a_separate_reference_equals_one_process(pairs, tiny_policy, tmp_path):
    """--ref-model under ZeRO-3: the reference is loaded whole on each process, outside deepspeed.zero.Init, which
    accelerate's stage-3 plugin turns on for every from_pretrained (each weight a 0-element share: the reference
    pass failed with "'weight' must be 2-D"). Its log-probs, and so the losses, are the single process's. Without
    clipping (--max-grad-norm 0, the GPU recipe's) the gradient norm is logged all the same, DeepSpeed's as ours."""
    from rlhf_pipeline.tiny import save_tiny_model

    reference = save_tiny_model(tmp_path / "reference", seed=3)
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 2, "--learning-rate", 1e-3, "--ref-model",
              reference, "--batch-size", 2, "--max-grad-norm", 0]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "single", *common, "--gradient-accumulation-steps", 2,
                           data="pairs")) == 0
    launch_cpu_zero3(train_args(pairs, tiny_policy, tmp_path / "zero3", *common, data="pairs"))
    losses = logged(tmp_path / "zero3")
    assert losses == pytest.approx(logged(tmp_path / "single"), abs=1e-5)
    assert abs(losses[0] - math.log(2)) > 1e-3  # the reference is not the policy: the first loss is not log 2
    norms = logged(tmp_path / "single", "grad_norm")
    assert len(norms) == 2 and logged(tmp_path / "zero3", "grad_norm") == pytest.approx(norms, rel=1e-4)


def test_two_process_zero3_with_every_weight_partitioned_calls_the_head_alike_on_both(pairs, tiny_policy, tmp_path):
    """ZeRO-3 gathers a partitioned LM head from every process at each call, a collective. The head runs once per
    chunk of response rows, so a process with fewer rows made fewer calls and the step hung: at 8B (vocabulary
    128,256: 261 rows a chunk) any two ranks' micro-batches. Here every weight is partitioned (conftest's
    cpu_zero_config) and a chunk is 4 rows: gloo failed with "Is there a distributed collective mismatch" before
    every process made as many calls."""
    from conftest import accelerate_launch, launch_failure

    (tmp_path / "train.py").write_text("import sys\nimport rlhf_pipeline.logprobs as logprobs\n"
                                       "logprobs.LOGITS_CHUNK_ELEMENTS = 4 * 1024  # 4 rows a chunk\n"
                                       "from rlhf_pipeline.stages.train import cli\nsys.exit(cli())\n")
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 3, "--learning-rate", 1e-3, "--batch-size", 1]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "single", *common, "--gradient-accumulation-steps", 2,
                           data="pairs")) == 0
    res = accelerate_launch([tmp_path / "train.py",
                             *train_args(pairs, tiny_policy, tmp_path / "zero3", *common, data="pairs")[1:]])
    assert res.returncode == 0, launch_failure(res)
    assert logged(tmp_path / "zero3") == pytest.approx(logged(tmp_path / "single"), abs=1e-5)


def test_two_process_zero3_with_a_token_budget_equals_one_process_by_count(pairs, tiny_policy, tmp_path):
    """2 processes x accumulation 2 x batch 2 under ZeRO-3 with --max-tokens-per-micro-batch 250, against 1 process
    x accumulation 4 x batch 2: each global batch of 8 pairs is cut into micro-batches of 3, 3 and 2 pairs, one for
    one process and two for the other, which runs a stand-in of weight 0 beside its other's second forward."""
    from rlhf_pipeline.algorithms.pairs import pair_lengths

    lengths = pair_lengths(load_from_disk(str(pairs / "ref"))["train"])
    steps = [trainer.token_budget_plan(ids, lengths, 250, 2) for ids in trainer.global_batches(len(lengths), 8, 0, 0)]
    assert any(len(a) != len(b) for a, b in steps[:3])  # a stand-in
    assert len(micro_batch_sizes(steps[:3]) - {2}) >= 1  # micro-batches of other sizes than by count
    common = ["--algo", "dpo", "--temperature", 0.8, "--max-steps", 3, "--learning-rate", 1e-3, "--batch-size", 2]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "single", *common, "--gradient-accumulation-steps", 4)) == 0
    launch_cpu_zero3(train_args(pairs, tiny_policy, tmp_path / "zero3", *common, "--gradient-accumulation-steps", 2,
                                "--max-tokens-per-micro-batch", 250))
    assert logged(tmp_path / "zero3") == pytest.approx(logged(tmp_path / "single"), abs=1e-5)
    assert logged(tmp_path / "zero3", "reward/train_margin") == pytest.approx(
        logged(tmp_path / "single", "reward/train_margin"), abs=1e-5)
    assert max_weight_diff(tmp_path / "zero3", tmp_path / "single") < 1e-4


def test_without_progress_bars_a_status_line_says_how_the_run_goes(pairs, tiny_policy, tmp_path, capsys,
                                                                    monkeypatch):
    """With TQDM_DISABLE set (a batch job's log) the trainer prints a line at most every STATUS_EVERY_S seconds (0
    here: every step) with the step, the loss the step logged and the time left; with bars, none."""
    import re

    from rlhf_pipeline.training import loop

    monkeypatch.setattr(loop, "STATUS_EVERY_S", 0.0)
    capsys.readouterr()
    common = ["--algo", "dpo", "--temperature", 0.8]
    assert run(*train_args(pairs, tiny_policy, tmp_path / "quiet", *common, "--max-steps", 3)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train] step")]
    assert [line.split(":")[0] for line in lines] == ["[train] step 1/3", "[train] step 2/3", "[train] step 3/3"]
    assert [float(re.search(r"loss (\S+),", line).group(1)) for line in lines] == pytest.approx(
        logged(tmp_path / "quiet"), rel=1e-3)
    assert all("steps/min, about " in line and line.endswith(" left") for line in lines), lines
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert run(*train_args(pairs, tiny_policy, tmp_path / "bars", *common, "--max-steps", 2)) == 0
    assert "[train] step" not in capsys.readouterr().out


def test_dropout_is_disabled_for_training(tiny_policy):
    """Reference log-probs are taken without dropout, so the policy's must be too."""
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.training.loop import disable_dropout

    model = AutoModelForCausalLM.from_pretrained(tiny_policy, attention_dropout=0.3)
    assert any(getattr(m, "attention_dropout", 0) == 0.3 for m in model.modules())
    model.lm_head = torch.nn.Sequential(torch.nn.Dropout(0.2), model.lm_head)
    disable_dropout(model)
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in model.modules())
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_rebel_reward_gap_scale_is_eta_over_the_gap_rms(pairs, tiny_policy, tmp_path):
    """--reward-gap-scale rms divides the reward gaps by their RMS r over the train split. REBEL backpropagates
    (Δlogratio − eta·Δr)² (its code's form), so eta 1 on scaled gaps takes the very steps of eta 1/r on raw gaps, and
    logs the paper's loss (Δlogratio/eta − Δr)², r² times smaller."""
    import math

    # the sampled pairs' rewards, tripled: their gaps' RMS is then far from 1 whatever the samples were, so the two
    # runs below differ unless the scale is applied
    tripled = load_from_disk(str(pairs / "ref")).map(
        lambda row: {"chosen_reward": 3 * row["chosen_reward"], "rejected_reward": 3 * row["rejected_reward"]})
    tripled.save_to_disk(str(tmp_path / "tripled"))
    train = tripled["train"]
    gaps = [c - r for c, r in zip(train["chosen_reward"], train["rejected_reward"])]
    rms = math.sqrt(sum(g * g for g in gaps) / len(gaps))
    assert abs(rms - 1) > 0.1
    sampled_at = json.loads((pairs / "ref" / "manifest.json").read_text())["sampling"]["temperature"]
    common = ["--max-steps", 3, "--learning-rate", 1e-4, "--max-grad-norm", 0, "--batch-size", 4,
              "--temperature", sampled_at]  # the copy has no manifest that records it
    assert run(*train_args(tmp_path, tiny_policy, tmp_path / "scaled", *common, "--reward-gap-scale", "rms",
                           data="tripled")) == 0
    assert run(*train_args(tmp_path, tiny_policy, tmp_path / "raw", *common, "--eta", 1 / rms, data="tripled")) == 0
    assert max_weight_diff(tmp_path / "scaled", tmp_path / "raw") < 1e-6
    assert [x * rms**2 for x in logged(tmp_path / "scaled")] == pytest.approx(logged(tmp_path / "raw"), rel=1e-4)
    record = json.loads((tmp_path / "scaled" / "manifest.json").read_text())["training"]["reward_gap_scale"]
    assert record == {"mode": "rms", "rms": pytest.approx(rms)}
    assert json.loads((tmp_path / "raw" / "manifest.json").read_text())["training"]["reward_gap_scale"] is None


def test_divergence_is_said_once():
    watch = trainer.DivergenceWatch()
    assert watch.check(1, 0.7, 34.0) is None and watch.check(2, 0.9, 300.0) is None  # 9-fold: ordinary
    warning = watch.check(12, 0.8, 2800.0)
    assert "gradient norm went from 34 to 2800 (82-fold)" in warning and "--learning-rate" in warning
    assert watch.check(13, 0.8, 5000.0) is None  # once
    learning = trainer.DivergenceWatch()  # gradients that grow while the loss falls: a reward model finding margins
    assert learning.check(1, 0.69, 0.32) is None and learning.check(42, 0.45, 9.9) is None
    loss = trainer.DivergenceWatch()
    assert loss.check(1, 0.01, None) is None and loss.check(2, 2.9, None) is None  # under 30 x the 0.1 floor
    assert "loss went from 0.01 at the first step to 3.5" in loss.check(3, 3.5, None)
    assert "loss is nan" in trainer.DivergenceWatch(first_loss=0.7).check(5, float("nan"), None)


def test_reward_gap_scale_is_rebels():
    from rlhf_pipeline.stages.train import TrainConfig

    with pytest.raises(ValueError, match="--reward-gap-scale is not read by --algo dpo"):
        TrainConfig(model="m", data="d", output="o", algo="dpo", reward_gap_scale="rms")


@pytest.fixture(scope="module")
def other_policy(tmp_path_factory) -> str:
    """A policy that did not sample ``pairs`` (other weights, the same tokenizer)."""
    from rlhf_pipeline.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("models") / "other", kind="policy", seed=1))


def test_rebel_trains_against_the_policy_that_sampled_its_pairs(pairs, tiny_policy, other_policy, tmp_path, capsys):
    """REBEL's reference is the sampler: --model another policy without --ref-model is one line naming both and
    the fix, and nothing is trained; with --ref-model the sampler, its reference pass is the sampler's log-probs
    (those rlhf ref-logps computed with it) and the manifest records it."""
    from rlhf_pipeline.layout import REF_LOGPS_CACHE

    common = ["--max-steps", 1, "--learning-rate", 1e-4]
    out = tmp_path / "wrong"
    assert run(*train_args(pairs, other_policy, out, *common, data="pairs")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {pairs / 'pairs'}: --algo rebel regresses onto the log-probs of the policy that sampled the "
                   f"data, {tiny_policy}, but its reference here is {other_policy}; pass --model {tiny_policy} (the "
                   f"next iteration trains the policy that sampled it), or --ref-model {tiny_policy} to train another "
                   "model against the sampler"]
    assert not (out / "manifest.json").exists()

    out = tmp_path / "against_sampler"
    assert run(*train_args(pairs, other_policy, out, *common, "--ref-model", tiny_policy, data="pairs")) == 0
    assert json.loads((out / "manifest.json").read_text())["training"]["ref_model"] == tiny_policy
    computed, made_by_ref_logps = load_from_disk(str(out / REF_LOGPS_CACHE)), load_from_disk(str(pairs / "ref"))
    for column in ("chosen_ref_logp", "rejected_ref_logp"):
        assert computed["train"][column] == pytest.approx(made_by_ref_logps["train"][column], abs=1e-4)


def test_dpo_keeps_another_reference_with_ref_model_and_checks_the_one_of_its_columns(
        pairs, tiny_policy, other_policy, tmp_path, capsys, caplog):
    """DPO (iterative DPO with the SFT model kept as the reference): --ref-model is the reference of its pass and
    the manifest's; without it, --model that did not sample the data is a warning line (its reference is the model
    it starts from, by convention); columns rlhf ref-logps made with another model than the reference are one line."""
    from rlhf_pipeline.chat import load_tokenizer
    from rlhf_pipeline.layout import REF_LOGPS_CACHE
    from rlhf_pipeline.logprobs import build_batch, sequence_logps
    from rlhf_pipeline.modeling import load_causal_lm

    common = ["--algo", "dpo", "--max-steps", 1, "--learning-rate", 1e-4]
    out = tmp_path / "sft_reference"
    assert run(*train_args(pairs, tiny_policy, out, *common, "--ref-model", other_policy, data="pairs")) == 0
    assert not [r for r in caplog.records if r.levelname == "WARNING" and r.name.endswith(".reference")]
    assert json.loads((out / "manifest.json").read_text())["training"]["ref_model"] == other_policy
    row = load_from_disk(str(out / REF_LOGPS_CACHE))["test"][0]
    batch = build_batch([row["prompt_token_ids"]], [row["chosen_token_ids"]], load_tokenizer(other_policy).pad_token_id)
    with torch.no_grad():
        expected = sequence_logps(load_causal_lm(other_policy), batch, temperature=1.0).item()
    assert row["chosen_ref_logp"] == pytest.approx(expected, abs=1e-4)

    out = tmp_path / "from_another"
    assert run(*train_args(pairs, other_policy, out, *common, data="pairs")) == 0
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.endswith(".reference")]
    assert len(warning) == 1 and f"sampled by {tiny_policy}" in warning[0] and other_policy in warning[0]
    assert json.loads((out / "manifest.json").read_text())["training"]["ref_model"] == other_policy

    out = tmp_path / "columns_of_another"
    assert run(*train_args(pairs, other_policy, out, *common, "--temperature", 0.8)) == 1  # data: ref, tiny_policy's
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {pairs / 'ref'}: its reference log-probs were computed by {tiny_policy} (rlhf ref-logps), but this "
        f"run's reference is {other_policy}; pass --ref-model {tiny_policy}, or recompute them with rlhf ref-logps "
        f"--model {other_policy}")
    assert run(*train_args(pairs, other_policy, out, *common, "--temperature", 0.8, "--ref-model", tiny_policy)) == 0


def test_examples_past_the_last_full_global_batch_are_warned_of_and_counted(pairs, tiny_policy, tmp_path, caplog):
    """global_batches drops the last partial global batch of each epoch (the normalisation stays exact); how many
    examples that leaves out was said nowhere: at 1,000 rows and a global batch of 512, 488 an epoch."""
    import logging

    from rlhf_pipeline.training.loop import global_batches

    batches = global_batches(10, 4, seed=0, epoch=0)
    assert [len(b) for b in batches] == [4, 4] and len({i for b in batches for i in b}) == 8
    assert global_batches(10, 4, seed=0, epoch=1) != batches  # others each epoch
    rows = load_from_disk(str(pairs / "ref"))["train"].num_rows
    size = next(b for b in range(3, rows) if rows % b)  # a batch size that does not divide the rows
    with caplog.at_level(logging.WARNING, logger="rlhf_pipeline.training.loop"):
        assert run(*train_args(pairs, tiny_policy, tmp_path / "out", "--batch-size", size, "--max-steps", 1)) == 0
    summary = json.loads((tmp_path / "out" / "manifest.json").read_text())["training"]
    assert summary["rows_left_out_per_epoch"] == rows % size > 0
    assert f"{rows % size} of the {rows} training examples do not fill a last global batch of {size}" in caplog.text
