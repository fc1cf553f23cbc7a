"""The Hugging Face engine: output format, stop handling, seeding, and sampling settings that cannot leak in."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlhf_pipeline.chat import encode_prompts, load_tokenizer, stop_token_ids
from rlhf_pipeline.engines import SamplingSettings
from rlhf_pipeline.engines.hf import HFEngine, cut_at_stop, generate_calls


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 0, 0], {2}) == ([5, 6, 2], "stop")
    assert cut_at_stop([5, 6, 7], {2}) == ([5, 6, 7], "length")
    assert cut_at_stop([9, 3], {2, 3}) == ([9, 3], "stop")


def _setup(model, n=4, max_new_tokens=12, seed=0, top_k=0, temperature=1.0):
    tok = load_tokenizer(model)
    prompts = encode_prompts(tok, ["Write a short review of the movie Night Train.", "Hi", "Tell me about Oak Hollow park"])
    sampling = SamplingSettings(n=n, temperature=temperature, top_p=1.0, top_k=top_k, max_new_tokens=max_new_tokens,
                                seed=seed, stop_token_ids=tuple(stop_token_ids(tok, model)))
    return tok, prompts, sampling


def test_output_format_and_stop_tokens(tiny_policy):
    tok, prompts, sampling = _setup(tiny_policy, max_new_tokens=40)
    engine = HFEngine(tiny_policy, tok, batch_size=2)
    out = engine.generate(prompts, [0, 1, 2], sampling)
    assert len(out) == 3
    reasons = []
    for c in out:
        assert len(c.texts) == len(c.token_ids) == len(c.finish_reasons) == 4
        for ids, reason, text in zip(c.token_ids, c.finish_reasons, c.texts):
            reasons.append(reason)
            assert tok.pad_token_id not in ids
            if reason == "stop":
                assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
            else:
                assert len(ids) == 40 and tok.eos_token_id not in ids
            assert text == tok.decode(ids, skip_special_tokens=True)
    assert "length" in reasons


def test_sampling_stops_at_the_models_context(tiny_policy, tmp_path):
    """A prompt and its response fit in the context (the model's positions, or --max-model-len), as vLLM's do:
    transformers sampled past the positions the model knows."""
    config = json.loads((Path(tiny_policy) / "config.json").read_text())
    short = Path(shutil.copytree(tiny_policy, tmp_path / "short"))
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 24}))
    tok, prompts, sampling = _setup(str(short), n=2, max_new_tokens=40)
    longest = max(len(p) for p in prompts)
    assert longest < 24
    for engine, context in [(HFEngine(str(short), tok, batch_size=1), 24),
                            (HFEngine(tiny_policy, tok, batch_size=1, max_model_len=20), 20)]:
        for prompt, c in zip(prompts, engine.generate(prompts, [0, 1, 2], sampling)):
            for ids, reason in zip(c.token_ids, c.finish_reasons):
                assert len(prompt) + len(ids) <= context
                assert reason == "stop" or len(prompt) + len(ids) == context


def test_generate_calls_take_the_prompts_longest_first():
    assert generate_calls([4, 10, 9, 10, 2, 9, 9], 4) == [[1, 3, 2, 5], [6, 0, 4]]
    assert generate_calls([], 4) == []


@pytest.mark.parametrize("logprobs", [False, True])
def test_each_prompt_gets_its_own_room_to_the_context_whatever_shares_its_call(tiny_policy, logprobs):
    """A call samples as many tokens for every row as its longest prompt leaves room for: beside a long prompt, a
    short one ended with 'length' long before the context, where vLLM (and a call of its own) gives it all its room.
    Such samples are now continued from where the call stopped, up to their own room; the sampler's log-probs too."""
    import dataclasses

    tok, prompts, sampling = _setup(tiny_policy, n=2, max_new_tokens=40)
    sampling = dataclasses.replace(sampling, stop_token_ids=())  # no sample stops: each runs to its room
    context = max(len(p) for p in prompts) + 4
    assert min(len(p) for p in prompts) + 40 > context  # the short prompt's room is short of 40 too
    engine = HFEngine(tiny_policy, tok, batch_size=3, max_model_len=context)
    for prompt, c in zip(prompts, engine.generate(prompts, [0, 1, 2], sampling, logprobs=logprobs)):
        assert [len(prompt) + len(ids) for ids in c.token_ids] == [context] * 2
        assert c.finish_reasons == ["length"] * 2
        assert c.texts == [tok.decode(ids, skip_special_tokens=True) for ids in c.token_ids]
        if logprobs:  # at temperature 1, no top-k or top-p: the model's own log-probs of the whole sequence
            for ids, got in zip(c.token_ids, c.logprobs):
                with torch.no_grad():
                    logits = engine.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
                expected = logits.float().log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
                assert got == pytest.approx(expected.tolist(), abs=1e-4)
    # --max-new-tokens still bounds a continued sample (the short prompt's room is more than 6 beyond the call's)
    capped = dataclasses.replace(sampling, max_new_tokens=context - max(len(p) for p in prompts) + 6)
    for prompt, c in zip(prompts, engine.generate(prompts, [0, 1, 2], capped)):
        for ids in c.token_ids:
            assert len(ids) == min(capped.max_new_tokens, context - len(prompt))


def test_a_model_that_always_stops_gives_eos_only_samples(tiny_policy, tmp_path):
    """Rewire the tiny model so EOS wins every step: a constant residual dimension, read by the EOS row only."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0  # dominates dimension 0 of the residual stream
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0  # the final hidden state is (h0 > 0, 0, ..., 0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_token_id, 0] = 100.0
    path = tmp_path / "stopper"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    _, prompts, sampling = _setup(str(path), n=3, max_new_tokens=5)
    out = HFEngine(str(path), tok, batch_size=2).generate(prompts, [0, 1, 2], sampling)
    for c in out:
        assert c.token_ids == [[tok.eos_token_id]] * 3
        assert c.finish_reasons == ["stop"] * 3 and c.texts == [""] * 3


def test_same_seed_same_output_and_other_seed_differs(tiny_policy):
    """The request seeds decide the samples (the run's --seed reaches the engine through them, as with vLLM)."""
    tok, prompts, sampling = _setup(tiny_policy)
    engine = HFEngine(tiny_policy, tok, batch_size=2)
    a = engine.generate(prompts, [0, 1, 2], sampling)
    b = engine.generate(prompts, [0, 1, 2], sampling)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.token_ids for c in engine.generate(prompts, [3, 4, 5], sampling)] != [c.token_ids for c in a]
    with pytest.raises(ValueError, match="3 prompts but 2 seeds"):
        engine.generate(prompts, [0, 1], sampling)


def test_batches_of_other_chunks_and_shards_draw_other_random_numbers(tiny_policy):
    """Two chunks of a run (or two shards, or two Ray replicas) hold other rows, so other request seeds: with batches
    of several prompts they must not replay one random stream. The same prompt in both would then get the same
    samples, and a run's samples would be correlated across its chunks. A batch's samples depend on its own prompts
    and seeds only, not on the batches sampled before it."""
    tok, prompts, sampling = _setup(tiny_policy, n=3, max_new_tokens=8)
    engine = HFEngine(tiny_policy, tok, batch_size=3)
    same = [prompts[1]] * 3
    first = engine.generate(same, [101, 102, 103], sampling)  # a chunk of rows 0..2
    second = engine.generate(same, [201, 202, 203], sampling)  # the next chunk, the same prompts again
    assert [c.token_ids for c in first] != [c.token_ids for c in second]
    # Batches of 3 over 6 prompts: the second batch samples as it does alone.
    whole = HFEngine(tiny_policy, tok, batch_size=3).generate(same * 2, [1, 2, 3, 4, 5, 6], sampling)
    assert [c.token_ids for c in whole[3:]] == [c.token_ids for c in engine.generate(same, [4, 5, 6], sampling)]


def test_model_generation_config_does_not_leak_into_sampling(tiny_policy, tmp_path):
    """transformers fills unset options from generation_config.json (and top_k=50 by default). A model that ships
    top_k=1 must not make our samples greedy: with top-k off, n samples of one prompt differ."""
    path = tmp_path / "topk1"
    shutil.copytree(tiny_policy, path)
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(top_k=1, do_sample=False, repetition_penalty=2.0)
    (path / "generation_config.json").write_text(json.dumps(cfg))
    tok, prompts, sampling = _setup(str(path), n=4)
    out = HFEngine(str(path), tok).generate(prompts[:1], [0], sampling)
    assert len({tuple(ids) for ids in out[0].token_ids}) == 4


def test_no_option_of_the_models_generation_config_shapes_the_samples(tiny_policy, tmp_path):
    """Besides top-k and the repetition penalty, generate reads suppress_tokens, bad_words_ids, sequence_bias,
    min_length, epsilon/eta cutoffs, forced_eos_token_id, ... from generation_config.json. A model that ships them
    samples here (and records log-probs) exactly as the same weights without them, for the same seeds."""
    tok, prompts, sampling = _setup(tiny_policy, n=3, max_new_tokens=10)
    plain = HFEngine(tiny_policy, tok, batch_size=2).generate(prompts, [0, 1, 2], sampling, logprobs=True)
    sampled = sorted({t for c in plain for ids in c.token_ids for t in ids})
    path = tmp_path / "shaped"
    shutil.copytree(tiny_policy, path)
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(suppress_tokens=sampled[:3], begin_suppress_tokens=sampled[3:5], bad_words_ids=[[sampled[5]]],
               sequence_bias=[[[sampled[6]], 5.0]], min_length=64, epsilon_cutoff=0.2, eta_cutoff=0.2,
               forced_eos_token_id=sampled[7], exponential_decay_length_penalty=[2, 1.5], renormalize_logits=True)
    (path / "generation_config.json").write_text(json.dumps(cfg))
    shaped = HFEngine(str(path), tok, batch_size=2).generate(prompts, [0, 1, 2], sampling, logprobs=True)
    assert [c.token_ids for c in shaped] == [c.token_ids for c in plain]
    assert [c.logprobs for c in shaped] == [c.logprobs for c in plain]


def test_greedy_is_deterministic(tiny_policy):
    tok, prompts, sampling = _setup(tiny_policy, n=1, temperature=0.0)
    engine = HFEngine(tiny_policy, tok, batch_size=3)
    a = engine.generate(prompts, [0, 1, 2], sampling)
    b = HFEngine(tiny_policy, tok, batch_size=1).generate(prompts, [5, 6, 7], sampling)
    # Greedy output does not depend on seeds or batching (left padding is masked out).
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_alone_in_its_batch_a_prompt_is_sampled_from_its_own_seed(tiny_policy):
    """batch_size=1: a prompt's samples depend on its seed alone, not on the prompts sampled before it (a shard or a
    Ray replica samples it as the whole run does); with batches of 3 the first prompt's samples change with the
    others in its batch."""
    tok, prompts, sampling = _setup(tiny_policy, n=3, max_new_tokens=6)
    one = HFEngine(tiny_policy, tok, batch_size=1)
    whole = one.generate(prompts, [11, 12, 13], sampling)
    assert one.generate(prompts[2:], [13], sampling)[0].token_ids == whole[2].token_ids
    assert one.generate(prompts[1:], [12, 13], sampling)[0].token_ids == whole[1].token_ids
    assert one.generate(prompts[2:], [14], sampling)[0].token_ids != whole[2].token_ids  # the seed does matter
    batched = HFEngine(tiny_policy, tok, batch_size=3)
    assert batched.generate(prompts, [11, 12, 13], sampling)[0].token_ids != \
        batched.generate(prompts[:1], [11], sampling)[0].token_ids


def _sampling(tok, model, n=3, max_new_tokens=10, seed=3, temperature=0.8, top_p=0.9, top_k=0):
    return SamplingSettings(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                            seed=seed, stop_token_ids=tuple(stop_token_ids(tok, model)))


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (20, 0.9), (5, 1.0)])
def test_our_warpers_sample_the_same_tokens_as_generates_own(tiny_policy, monkeypatch, top_k, top_p):
    """Our temperature/top-k/top-p processors give generate's processed logits, so the same seed draws the same
    tokens as transformers' own warpers would."""
    from transformers import LogitsProcessorList

    from rlhf_pipeline.engines import hf

    tok, prompts, _ = _setup(tiny_policy)
    sampling = _sampling(tok, tiny_policy, top_k=top_k, top_p=top_p)
    ours = HFEngine(tiny_policy, tok, batch_size=2)
    ours.share_prefill = False
    a = ours.generate(prompts, [0, 1, 2], sampling)

    class TransformersWarpers(HFEngine):
        def _generation_config(self, sampling, num_return_sequences=None):
            config = super()._generation_config(sampling, num_return_sequences)
            config.temperature, config.top_k, config.top_p = sampling.temperature, sampling.top_k, sampling.top_p
            return config

    monkeypatch.setattr(hf, "sampling_processors", lambda sampling: LogitsProcessorList())
    theirs = TransformersWarpers(tiny_policy, tok, batch_size=2)
    theirs.share_prefill = False
    b = theirs.generate(prompts, [0, 1, 2], sampling)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_shared_prompt_prefill_gives_the_same_samples(tiny_policy, temperature):
    """n samples of a prompt from one prefill (a KV cache of the prompt repeated n times) equal generate's own
    n prefills: the same seed gives the same tokens, prompts of 1 to 9 tokens, left-padded together."""
    tok = load_tokenizer(tiny_policy)
    prompts = [[5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21], [30, 31, 32, 33]]
    sampling = _sampling(tok, tiny_policy, n=3 if temperature else 1, temperature=temperature, top_k=5)
    plain = HFEngine(tiny_policy, tok, batch_size=4)
    plain.share_prefill = False
    shared = HFEngine(tiny_policy, tok, batch_size=4)
    a = plain.generate(prompts, [0] * 5, sampling)
    b = shared.generate(prompts, [0] * 5, sampling)
    assert shared.share_prefill is (True if temperature else None)  # n=1 never needs the probe
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reasons for c in a] == [c.finish_reasons for c in b]


def test_shared_prefill_is_dropped_when_it_fails(tiny_policy, caplog):
    tok, prompts, sampling = _setup(tiny_policy, n=2, max_new_tokens=6)
    engine = HFEngine(tiny_policy, tok, batch_size=2)

    def broken(*args, **kwargs):
        raise RuntimeError("this model cannot continue from a cache")

    engine._prefix_cache = broken
    out = engine.generate(prompts, [0, 1, 2], sampling)
    assert engine.share_prefill is False
    assert "prefilling per sample" in caplog.text
    assert all(len(c.token_ids) == 2 for c in out)


def test_models_with_their_own_cache_layers_do_not_share_the_prefill(tiny_policy, tmp_path):
    """A sliding-window model keeps its own cache layer type: the engine leaves its prefill to generate."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    tok = load_tokenizer(tiny_policy)
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path / "sliding"
    MistralForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    _, prompts, sampling = _setup(str(path), n=2, max_new_tokens=5)
    engine = HFEngine(str(path), tok, batch_size=3)
    out = engine.generate(prompts, [0, 1, 2], sampling)
    assert engine.share_prefill is False
    assert all(len(c.token_ids) == 2 for c in out)


def test_shared_prefill_generate_raises_no_future_warning(tiny_policy):
    """The shared prefill hands generate its KV cache under the name this transformers expects: transformers 5 warns
    (FutureWarning) on every generate given it as ``past_key_values``."""
    import warnings

    tok, prompts, sampling = _setup(tiny_policy, n=2, max_new_tokens=4)
    engine = HFEngine(tiny_policy, tok, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = engine.generate(prompts, [0, 1, 2], sampling)
    assert engine.share_prefill is True  # the path that passes a cache to generate was taken
    assert all(len(c.token_ids) == 2 for c in out)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 1.0), (1.0, 0.9)])
def test_sampler_logprobs_are_the_trainers_under_the_distribution_sampled_from(tiny_policy, temperature, top_p):
    """The log-probs the engine records are those of the distribution each token was drawn from. Without truncation
    that is the trainer's own recomputation at the same temperature (``logprobs.token_logps``), to float noise; with
    top-p < 1 the sampler's distribution is renormalised over the nucleus, so each token's sampler log-prob exceeds
    the trainer's by −log(nucleus mass) ≥ 0, and the samples are the same with or without recording."""
    import dataclasses

    import torch

    from rlhf_pipeline.logprobs import build_batch, token_logps

    tok, prompts, sampling = _setup(tiny_policy, n=3, max_new_tokens=10, temperature=temperature)
    sampling = dataclasses.replace(sampling, top_p=top_p)
    engine = HFEngine(tiny_policy, tok, batch_size=2)
    recorded = engine.generate(prompts, [0, 1, 2], sampling, logprobs=True)
    plain = engine.generate(prompts, [0, 1, 2], sampling)
    assert [c.token_ids for c in recorded] == [c.token_ids for c in plain] and plain[0].logprobs is None
    pairs = [(p, ids, lp) for p, c in zip(prompts, recorded) for ids, lp in zip(c.token_ids, c.logprobs)]
    assert all(len(ids) == len(lp) for _, ids, lp in pairs)
    batch = build_batch([p for p, _, _ in pairs], [ids for _, ids, _ in pairs], pad_id=tok.pad_token_id)
    with torch.no_grad():
        trainer, _ = token_logps(engine.model, batch, temperature=temperature)
    sampler = torch.tensor([x for _, _, lp in pairs for x in lp], dtype=trainer.dtype)
    gap = sampler - trainer
    if top_p == 1.0:
        assert gap.abs().max() < 1e-4, gap.abs().max()
    else:
        assert gap.min() > -1e-4 and gap.max() > 1e-3  # the nucleus's renormalisation, never below the trainer's
