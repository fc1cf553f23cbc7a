"""--bf16-weights: bfloat16 weights with float32 master copies (rlhf_pipeline.training.master_weights), against a
plain float32 computation of the same gradients and updates, and through rlhf train (resume, the saved dtype)."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import crash_after_checkpoint, logged, make_pairs, max_weight_diff, run
from rlhf_pipeline.training.master_weights import MASTERS_FILE, MasterWeights

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def tiny_llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def bf16_copy(model):
    """The model with its parameters (not its buffers) in bf16, no masters: what MasterWeights makes of it."""
    copied = copy.deepcopy(model)
    for p in copied.parameters():
        p.data = p.data.to(torch.bfloat16)
    return copied


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("tied", [False, True])
def test_micro_batch_gradients_add_up_in_float32_on_the_masters(tied):
    """Two micro-batches' bf16 gradients, summed in float32 on the masters, equal the same model's gradients taken
    one by one without masters; a weight shared by the embedding and the LM head has one master and its summed
    gradient."""
    model = tiny_llama(tied)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = bf16_copy(model)  # the same bf16 model, no masters: its gradients one by one
    masters = MasterWeights(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # the masters start from the float32 weights, not from their bf16 rounding
    assert all(torch.equal(m, start[n]) for n, m in masters.named_masters())

    batches = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    expected = {n: torch.zeros_like(start[n]) for n in start}
    for ids in batches:
        plain.zero_grad()
        loss_of(plain, ids).backward()
        for n, p in plain.named_parameters():
            expected[n] += p.grad.float()  # each micro-batch's bf16 gradient, summed in float32
        loss_of(model, ids).backward()

    assert all(p.grad is None for p in model.parameters())  # moved to the masters, the bf16 copies freed
    assert ("lm_head.weight" in masters.names) == (not tied) and len(masters.names) == len(expected)
    for n, m in masters.named_masters():
        assert m.grad.dtype == torch.float32
        torch.testing.assert_close(m.grad, expected[n], rtol=0, atol=0)


def test_the_optimizer_steps_the_masters_and_the_model_gets_them_rounded():
    """Three AdamW steps on the masters equal AdamW on float32 copies of the starting weights given the same
    gradients (the masters never go through bf16), and the model holds each step's masters rounded to bf16."""
    model = tiny_llama()
    masters = MasterWeights(model)
    reference = [m.clone() for m in masters.masters]  # float32, stepped by an optimizer of their own
    optimizer = torch.optim.AdamW(masters.masters, lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference, lr=1e-3)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        loss_of(model, ids).backward()
        for r, m in zip(reference, masters.masters):
            r.grad = m.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        masters.write_back()
        params = dict(model.named_parameters())
        for n, m in masters.named_masters():
            assert torch.equal(params[n].detach(), m.to(torch.bfloat16))
    assert all(torch.equal(m, r) for m, r in zip(masters.masters, reference))
    start = dict(tiny_llama().named_parameters())
    assert all(not torch.equal(m, start[n]) for n, m in masters.named_masters())  # every weight moved


def test_only_parameters_are_cast_buffers_keep_their_dtype():
    """The rotary embedding's inv_freq stays float32: rounded to bf16 it would turn the angles of far positions by
    radians, away from what a model loaded for inference computes; so the logits at position 60 are those of the
    same weights in bf16 with a float32 rotary table."""
    model = tiny_llama()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    assert any("inv_freq" in n for n in buffers)
    reference = bf16_copy(model)
    MasterWeights(model)
    for n, b in model.named_buffers():
        assert b.dtype == buffers[n].dtype and torch.equal(b, buffers[n]), n
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_updates_below_bf16_resolution_add_up_on_the_masters():
    """At 1e-6 an AdamW step on one repeated batch moves each weight by about 1e-6, below bf16's spacing for most
    weights (about 8e-5 near 0.01): after 5 steps the masters have moved by the 5 steps' sum, while AdamW stepping the
    bf16 weights themselves rounds most of each update away."""
    model = tiny_llama()
    bare = bf16_copy(model)  # no masters: AdamW on the bf16 weights
    masters = MasterWeights(model)
    start = [m.clone() for m in masters.masters]
    bare_start = {n: p.detach().float().clone() for n, p in bare.named_parameters()}
    optimizer = torch.optim.AdamW(masters.masters, lr=1e-6)
    bare_optimizer = torch.optim.AdamW(bare.parameters(), lr=1e-6)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    for _ in range(5):
        for m, opt in ((model, optimizer), (bare, bare_optimizer)):
            loss_of(m, ids).backward()
            opt.step()
            opt.zero_grad()
        masters.write_back()
    weight = "model.layers.0.mlp.down_proj.weight"
    i = masters.names.index(weight)
    moved = (masters.masters[i] - start[i]).abs()
    bare_moved = (dict(bare.named_parameters())[weight].detach().float() - bare_start[weight]).abs()
    assert moved.max() == pytest.approx(5e-6, rel=0.1) and moved.mean() > 4e-6
    assert bare_moved.mean() < 0.5 * moved.mean()


def test_masters_save_and_load_by_name(tmp_path):
    model = tiny_llama()
    masters = MasterWeights(model)
    saved = [m.clone() for m in masters.masters]
    masters.save(tmp_path)
    assert set(load_file(str(tmp_path / MASTERS_FILE))) == set(masters.names)
    for m in masters.masters:
        m.add_(1.0)
    masters.load(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(masters.masters, saved))
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(masters.params, masters.masters))
    with pytest.raises(FileNotFoundError, match="without --bf16-weights"):
        masters.load(tmp_path / "elsewhere")
    other = MasterWeights(tiny_llama(tied=True))  # one weight fewer: the file holds one it does not train
    with pytest.raises(KeyError, match="lm_head.weight is not trained"):
        other.load(tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_is_saved_from_its_masters(tied, tmp_path):
    """save_pretrained of the masters' state dict: float32 weights equal to the masters, tied embeddings still tied
    (one tensor saved, the LM head loads as the embedding)."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama(tied)
    masters = MasterWeights(model)
    for m in masters.masters:
        m.add_(1e-6)  # below bf16's resolution: only the masters hold it
    masters.write_back()
    model.save_pretrained(tmp_path, state_dict=masters.state_dict(model.state_dict()))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(masters.names) and {t.dtype for t in saved.values()} == {torch.float32}
    assert all(torch.equal(saved[n], m) for n, m in masters.named_masters())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


def test_a_bf16_checkpoint_loads_for_training_in_float32(tmp_path):
    """transformers 5 loads a checkpoint in its own dtype by default; the trainer asks for float32 weights, so a
    model saved in bf16 (by DeepSpeed's runs, say) trains with float32 weights (or masters) all the same."""
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.training.loop import TrainOptions, load_trainable

    tiny_llama().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    options = TrainOptions(model=str(tmp_path / "bf16"), data="unused", output=str(tmp_path / "out"))
    model = load_trainable(options, lambda path, **kw: AutoModelForCausalLM.from_pretrained(path, **kw))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    return make_pairs(tmp_path_factory.mktemp("bf16w_data"), tiny_policy, bundled_prompts, limit=24, test_size=4)


def train_args(pairs: Path, policy: str, out: Path, *extra) -> list:
    """bfloat16 runs on pairs without reference columns (made in float32 on a CPU, which a bfloat16 run refuses):
    each run computes its reference at its own precision."""
    return ["train", "--algo", "dpo", "--model", policy, "--data", pairs / "pairs", "--output", out, "--report-to",
            "none", "--temperature", 0.8, "--max-steps", 4, "--batch-size", 4, "--learning-rate", 1e-3, "--bf16",
            *extra]


def test_rlhf_train_with_bf16_weights_learns_as_autocast_saves_the_masters_and_resumes_exactly(
        pairs, tiny_policy, tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # the data's runs set accelerate's singleton up without mixed precision
    assert run(*train_args(pairs, tiny_policy, tmp_path / "autocast")) == 0
    assert run(*train_args(pairs, tiny_policy, tmp_path / "full", "--bf16-weights")) == 0
    # the same steps in the other precision: the same losses to bf16's rounding, and they fall as autocast's do
    losses = logged(tmp_path / "full")
    assert losses == pytest.approx(logged(tmp_path / "autocast"), abs=2e-3)
    assert losses[-1] < losses[0] - 5e-3
    # saved from the float32 masters, which moved off the start; within bf16's rounding of autocast's weights
    saved = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    # and config.json says so, as a loader that reads it (dtype "auto", transformers 5's default) needs: it said
    # bfloat16, the dtype of the model that wrote it, and such a loader rounded the masters back to bf16
    from transformers import AutoModelForCausalLM

    assert json.loads((tmp_path / "full" / "config.json").read_text())["dtype"] == "float32"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "full").dtype == torch.float32
    start = load_file(str(Path(tiny_policy) / "model.safetensors"))
    assert max((saved[k] - start[k]).abs().max().item() for k in saved) > 1e-3
    assert max_weight_diff(tmp_path / "full", tmp_path / "autocast") < 0.05

    crash_after_checkpoint(monkeypatch, 2)
    cut = train_args(pairs, tiny_policy, tmp_path / "cut", "--bf16-weights", "--save-every", 2)
    assert run(*cut) == 130
    checkpoint = next((tmp_path / "cut" / "checkpoints").iterdir())
    assert (checkpoint / "state" / MASTERS_FILE).is_file()
    assert run(*cut, "--resume") == 0
    # the masters came back from the checkpoint: the resumed run ends where the uninterrupted one did
    assert logged(tmp_path / "cut") == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    assert max_weight_diff(tmp_path / "cut", tmp_path / "full") == 0


def test_a_non_finite_step_under_bf16_weights_leaves_masters_and_weights_untouched(pairs, tiny_policy, tmp_path,
                                                                                   monkeypatch):
    """Step 2's loss is NaN: its checkpoint holds the same masters and weights as step 1's, and step 3 (no stale
    gradient left on the masters) updates them to finite values."""
    from accelerate.state import AcceleratorState

    from test_nonfinite import nan_on_calls

    AcceleratorState._reset_state(True)
    nan_on_calls(monkeypatch, {2})
    out = tmp_path / "out"
    assert run(*train_args(pairs, tiny_policy, out, "--bf16-weights", "--batch-size", 2, "--max-steps", 4,
                           "--save-every", 1, "--save-total-limit", 0, "--keep-checkpoints")) == 0
    one, two, three = (load_file(str(out / "checkpoints" / f"step_00000{i}" / "state" / MASTERS_FILE))
                       for i in (1, 2, 3))
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert any(not torch.equal(two[k], three[k]) for k in two)
    assert all(torch.isfinite(t).all() for t in three.values())
    step = out / "checkpoints"
    assert max_weight_diff(step / "step_000001", step / "step_000002") == 0


@pytest.mark.parametrize("extra, message", [
    ([], "--bf16-weights needs --bf16"),
    (["--bf16", "--lora-rank", "4"], "--bf16-weights is for full fine-tuning"),
])
def test_bf16_weights_refuses_what_it_cannot_do(extra, message, pairs, tiny_policy, tmp_path, capsys):
    args = ["train", "--algo", "dpo", "--model", tiny_policy, "--data", pairs / "ref", "--output", tmp_path / "x",
            "--bf16-weights", *extra]
    assert run(*args) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
