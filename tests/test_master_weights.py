"""--bf16-weights: bfloat16 weights with float32 master copies (rlhf_pipeline.training.master_weights), against a
plain float32 computation of the same gradients and updates, and through rlhf train (resume, the saved dtype)."""

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import crash_after_checkpoint, logged, make_pairs, max_weight_diff, run
from rlhf_pipeline.training.master_weights import MASTERS_FILE, MasterWeights

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_micro_batch_gradients_add_up_in_float32_on_the_masters():
    model = tiny_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = copy.deepcopy(model).to(torch.bfloat16)  # the same bf16 model, no masters: its gradients one by one
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
    assert all(not torch.equal(m, p0) for m, p0 in zip(masters.masters, [r.grad for r in reference]))


def test_an_update_below_bf16_resolution_is_kept_by_the_master():
    """At 1e-6 one AdamW step moves each weight by about 1e-6, far below bf16's spacing near 0.02 (about 1e-4): the
    bf16 weights do not change, the masters do, and the steps add up there."""
    model = tiny_llama()
    masters = MasterWeights(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = [m.clone() for m in masters.masters]
    optimizer = torch.optim.AdamW(masters.masters, lr=1e-6)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    loss_of(model, ids).backward()
    optimizer.step()
    masters.write_back()
    weight = "model.layers.0.mlp.down_proj.weight"
    m = masters.masters[masters.names.index(weight)]
    p = dict(model.named_parameters())[weight]
    assert (m - start[masters.names.index(weight)]).abs().max() == pytest.approx(1e-6, rel=0.1)
    assert (p.detach() != before[weight]).float().mean() < 0.05  # almost every bf16 weight is where it was


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


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    return make_pairs(tmp_path_factory.mktemp("bf16w_data"), tiny_policy, bundled_prompts, limit=24, test_size=4)


def train_args(pairs: Path, policy: str, out: Path, *extra) -> list:
    return ["train", "--algo", "dpo", "--model", policy, "--data", pairs / "ref", "--output", out, "--report-to",
            "none", "--temperature", 0.8, "--max-steps", 4, "--batch-size", 4, "--learning-rate", 1e-3, "--bf16",
            *extra]


def test_rlhf_train_with_bf16_weights_learns_as_autocast_saves_bf16_and_resumes_exactly(
        pairs, tiny_policy, tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # the data's runs set accelerate's singleton up without mixed precision
    assert run(*train_args(pairs, tiny_policy, tmp_path / "autocast")) == 0
    assert run(*train_args(pairs, tiny_policy, tmp_path / "full", "--bf16-weights")) == 0
    # the same steps in the other precision: the same losses to bf16's rounding
    assert logged(tmp_path / "full") == pytest.approx(logged(tmp_path / "autocast"), abs=0.02)
    saved = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}

    crash_after_checkpoint(monkeypatch, 2)
    cut = train_args(pairs, tiny_policy, tmp_path / "cut", "--bf16-weights", "--save-every", 2)
    assert run(*cut) == 130
    checkpoint = next((tmp_path / "cut" / "checkpoints").iterdir())
    assert (checkpoint / "state" / MASTERS_FILE).is_file()
    assert run(*cut, "--resume") == 0
    # the masters came back from the checkpoint: the resumed run ends where the uninterrupted one did
    assert logged(tmp_path / "cut") == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    assert max_weight_diff(tmp_path / "cut", tmp_path / "full") == 0


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
