"""--compile (rlhf_pipeline.training.compilation): each decoder layer compiled with torch.compile computes the eager
model's log-probs and gradients, over micro-batches of changing lengths without a compilation for each, and keeps
the model's parameter names; through rlhf train it learns as the eager trainer does, and under DeepSpeed it is
refused before anything is written. (The first compilation of a test process takes tens of seconds on a CPU.)"""

import json
import random

import pytest
import torch

from conftest import free_port, logged, make_pairs, run
from rlhf_pipeline.logprobs import build_batch, sequence_logps
from rlhf_pipeline.modeling import enable_activation_checkpointing
from rlhf_pipeline.training.compilation import compile_decoder_layers, decoder_layers

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def batches(n: int, pack_ratio: float):
    """``n`` micro-batches of 3 sequences, each of its own lengths."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        prompts = [[rng.randrange(1, 64) for _ in range(rng.randrange(2, 12))] for _ in range(3)]
        responses = [[rng.randrange(1, 64) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
        out.append(build_batch(prompts, responses, pad_id=0, pack_ratio=pack_ratio))
    return out


def assert_same_as_eager(eager, compiled, micro_batches) -> None:
    """Each micro-batch's log-probs and trained parameters' gradients, eager against compiled; then a no-grad pass."""
    for batch in micro_batches:
        got = []
        for model in (eager, compiled):
            model.zero_grad()
            logps = sequence_logps(model, batch)
            logps.sum().backward()
            got.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        (want, want_grads), (have, have_grads) = got
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        assert have_grads.keys() == want_grads.keys()
        for n in want_grads:
            torch.testing.assert_close(have_grads[n], want_grads[n], rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # the reference pass: a graph of its own, the same numbers
        torch.testing.assert_close(sequence_logps(compiled, batch), sequence_logps(eager, batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pack_ratio", [0.0, 2.0])
def test_compiled_layers_give_the_eager_log_probs_and_gradients(pack_ratio):
    import torch._dynamo

    eager = tiny_llama(4)
    compiled = tiny_llama(4)
    names = [n for n, _ in compiled.named_parameters()]
    assert [type(m).__name__ for m in decoder_layers(compiled)] == ["LlamaDecoderLayer"] * 4
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_decoder_layers(compiled) == 4
    assert [n for n, _ in compiled.named_parameters()] == names  # no _orig_mod: checkpoints and saves as before
    assert_same_as_eager(eager, compiled, batches(4, pack_ratio))
    # compiled, and once for the four alike layers: four micro-batches of other lengths through four layers, with
    # and without gradients, one row or several, make a few graphs, not one per layer or per length
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4


def test_compiled_layers_with_lora_adapters_give_the_eager_gradients():
    pytest.importorskip("peft")
    from rlhf_pipeline.training.lora import LoraOptions, add_adapters

    eager, compiled = (add_adapters(tiny_llama(), LoraOptions(lora_rank=4)) for _ in range(2))
    assert compile_decoder_layers(compiled) == 2  # found inside peft's wrappers
    assert_same_as_eager(eager, compiled, batches(2, 2.0))


@pytest.mark.slow
def test_every_way_the_layers_run_stays_compiled():
    """LoRA with gradient checkpointing, in train and eval mode, with and without gradients, one row and several:
    more graphs than Dynamo keeps for one function by default (8), all of them compiled, none left to run eager."""
    pytest.importorskip("peft")
    import torch._dynamo

    from rlhf_pipeline.training.lora import LoraOptions, add_adapters

    model = tiny_llama()
    enable_activation_checkpointing(model)
    model = add_adapters(model, LoraOptions(lora_rank=4))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_decoder_layers(model)
    one_row = build_batch([[3, 4, 5]], [[6, 7]], pad_id=0)
    for mode in (True, False):
        model.train(mode)
        for grad in (True, False):
            for batch in (one_row, batches(1, 0.0)[0]):
                with torch.set_grad_enabled(grad):
                    logps = sequence_logps(model, batch)
                if grad:
                    logps.sum().backward()
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] > 8  # past the default limit...
    # ...and no frame fell back to eager (one past the limit is not counted "ok": checked with the default limit)
    assert counters["frames"]["total"] == counters["frames"]["ok"]


def test_a_failed_compilation_is_one_error_line_naming_the_fix():
    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.training.compilation import compile_errors

    def broken(graph, example_inputs):
        raise RuntimeError("no C compiler found\nmore detail")

    with pytest.raises(PipelineError, match=r"^--compile: torch.compile failed \(RuntimeError: no C compiler found\); "
                                            r"drop --compile$"):
        with compile_errors(True):
            torch.compile(lambda x: x * 2 + 1, backend=broken)(torch.ones(2))


def test_an_old_torch_is_refused(monkeypatch):
    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.training.compilation import check_compile

    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    with pytest.raises(PipelineError, match=r"--compile needs torch >= 2.5 \(this is 2.4.1\+cu121\); upgrade torch"):
        check_compile(deepspeed=False)


def test_a_model_without_decoder_layers_is_refused():
    from rlhf_pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match="--compile: found no decoder layers to compile in m .*; drop --compile"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)), "m")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_policy, bundled_prompts):
    return make_pairs(tmp_path_factory.mktemp("compile"), tiny_policy, bundled_prompts, limit=24, test_size=4)


def train_args(pairs, policy, out, *extra) -> list:
    return ["train", "--algo", "dpo", "--model", policy, "--data", pairs / "ref", "--output", out, "--report-to",
            "none", "--temperature", 0.8, "--max-steps", 3, "--batch-size", 4, "--learning-rate", 1e-3,
            "--max-tokens-per-micro-batch", 96, *extra]


def test_rlhf_train_with_compile_learns_as_the_eager_trainer(pairs, tiny_policy, tmp_path):
    from accelerate.state import AcceleratorState

    import torch._dynamo

    AcceleratorState._reset_state(True)  # the data's runs set accelerate's singleton up
    assert run(*train_args(pairs, tiny_policy, tmp_path / "eager")) == 0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert run(*train_args(pairs, tiny_policy, tmp_path / "compiled", "--compile")) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert len(logged(tmp_path / "eager")) == 3
    assert logged(tmp_path / "compiled") == pytest.approx(logged(tmp_path / "eager"), abs=1e-4)
    assert logged(tmp_path / "compiled", "grad_norm") == pytest.approx(logged(tmp_path / "eager", "grad_norm"),
                                                                       rel=1e-3)
    manifest = json.loads((tmp_path / "compiled" / "manifest.json").read_text())
    assert manifest["config"]["compile"] is True


@pytest.mark.parametrize("stage, data", [("sft", "sft"), ("train-rm", "preferences")])
def test_sft_and_reward_model_training_with_compile_learn_as_the_eager_ones(stage, data, tiny_policy, tmp_path):
    """The other training stages compile their model's layers alike: a causal LM's (SFT) and a sequence classifier's
    (the reward model, whose score head stays outside)."""
    import torch._dynamo
    from accelerate.state import AcceleratorState

    from rlhf_pipeline.demo.task import write_task_data

    rows = write_task_data(tmp_path / "task")[data]
    args = [stage, "--model", tiny_policy, "--data", rows, "--test-size", 8, "--max-steps", 2, "--batch-size", 4,
            "--learning-rate", 1e-3, "--report-to", "none"]
    AcceleratorState._reset_state(True)
    assert run(*args, "--output", tmp_path / "eager") == 0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert run(*args, "--output", tmp_path / "compiled", "--compile") == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert len(logged(tmp_path / "eager")) == 2
    assert logged(tmp_path / "compiled") == pytest.approx(logged(tmp_path / "eager"), abs=1e-4)


def test_compile_under_deepspeed_is_refused_before_anything_is_written(pairs, tiny_policy, tmp_path, capsys,
                                                                      monkeypatch):
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch --config_file zero3.yaml sets
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert run(*train_args(pairs, tiny_policy, tmp_path / "x", "--compile")) != 0
    finally:
        if dist.is_initialized():  # the stage destroys it on its way out
            dist.destroy_process_group()
    assert "--compile is for the single-process trainer" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_compile_with_qlora_is_refused_by_the_options(pairs, tiny_policy, tmp_path, capsys):
    args = train_args(pairs, tiny_policy, tmp_path / "x", "--compile", "--lora-rank", 4, "--load-in-4bit")
    assert run(*args) != 0
    assert "--compile does not take --load-in-4bit" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
