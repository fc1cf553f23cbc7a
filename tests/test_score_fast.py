"""The reward model's fast scoring path (no attention mask, hand pooling) against the model's own forward, one sequence at a time and in padded batches, on several architectures."""

import logging

import pytest
import torch

from rlhf_pipeline import rewards
from rlhf_pipeline.rewards import (
    RewardModelScorer,
    last_token_rewards,
    model_pad_id,
    pooled_index,
)

PAD = 0


def _classifier(kind: str, **overrides):
    """A random two-layer one-label classifier of ``kind``, weights large enough that errors would show."""
    import transformers

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, num_labels=1)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(**{"sliding_window": None, **common}),
        "qwen2": lambda: transformers.Qwen2Config(**common),  # q/k/v biases
        "qwen3": lambda: transformers.Qwen3Config(**{"head_dim": 32, **common}),  # per-head q/k norms, wide heads
        "gemma": lambda: transformers.GemmaConfig(**{"head_dim": 16, **common}),  # not prunable: whole body
    }
    config = configs[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _sequences(n: int = 7, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 5, 9, 17, 30, 31][:n]
    return [torch.randint(1, 97, (length,), generator=g).tolist() for length in lengths]


def _one_at_a_time(model, sequences):
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]


def _fast(model, sequences):
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    pooled = torch.tensor([pooled_index(s, model_pad_id(model.config)) for s in sequences])
    with torch.no_grad():
        return last_token_rewards(model, ids, pooled).tolist()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_fast_path_equals_one_at_a_time(kind):
    model = _classifier(kind)
    seqs = _sequences()
    reference = _one_at_a_time(model, seqs)
    assert len({round(x, 4) for x in reference}) == len(seqs)  # distinct rewards: the check is not empty
    assert _fast(model, seqs) == pytest.approx(reference, abs=1e-5, rel=1e-5)


def test_pooling_skips_trailing_pad_ids_as_transformers_does():
    """A model whose pad id is also its EOS reads a conversation ending in EOS at the last token before it (the
    rightmost non-pad token), at batch size 1 as in a padded batch; the fast path does the same."""
    model = _classifier("llama")
    eos = 5
    model.config.pad_token_id = eos
    seqs = [[7, 8, 9, eos], [10, 11, eos, eos], [12, 13, 14, 15, 16, 17, eos], [eos, eos]]
    assert [pooled_index(s, eos) for s in seqs] == [2, 1, 5, 0]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [eos] * (width - len(s)) for s in seqs])  # padded with the pad id, as the scorer does
    pooled = torch.tensor([pooled_index(s, eos) for s in seqs])
    with torch.no_grad():
        fast = last_token_rewards(model, ids, pooled).tolist()
    assert fast == pytest.approx(_one_at_a_time(model, seqs), abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_scorer_fast_path_equals_model_forward_one_by_one(tiny_rm, batch_size):
    scorer = RewardModelScorer(tiny_rm, batch_size=batch_size)
    prompts = ["Write a short review of the hotel The Willow.", "Hi", "What did you think of the album Low Tide?"] * 3
    responses = ["Great staff.", "ok", "The songs were dull, but the vocals were warm and fun, and I liked it."] * 3
    responses = [r * (1 + k % 3) for k, r in enumerate(responses)]
    ids = scorer.encode(prompts, responses)
    fast = scorer.score_ids(ids)
    assert scorer.mode == "last_token"
    reference = _one_at_a_time(scorer.model, ids)
    assert fast == pytest.approx(reference, abs=1e-5)
    scorer.mode = "forward"
    assert scorer.score_ids(ids) == pytest.approx(reference, abs=1e-5)


def test_a_model_pad_id_other_than_the_tokenizers_gives_the_same_rewards_whatever_the_batch(tiny_rm, tmp_path):
    """A reward model whose config.json names a pad id of its own (Llama-3.1's <|finetune_right_pad_id|>) beside a
    tokenizer that pads with another: batches are padded with the model's, which its pooling skips. Padded with the
    tokenizer's, a shorter sequence was read at its last pad (0.22 apart between batch sizes 1 and 8), and the fast
    path's check, failing, sent every batch through that forward."""
    import json
    import shutil

    path = tmp_path / "rm"
    shutil.copytree(tiny_rm, path)
    config = json.loads((path / "config.json").read_text())
    tokenizer_pad = RewardModelScorer(tiny_rm).pad_id
    config["pad_token_id"] = next(i for i in (3, 4, 5) if i != tokenizer_pad)
    (path / "config.json").write_text(json.dumps(config))
    prompts = ["Write a short review of the hotel The Willow.", "Hi", "What did you think of the album Low Tide?"] * 3
    responses = [r * (1 + k % 3) for k, r in enumerate(["Great staff.", "ok", "Dull songs, but warm vocals."] * 3)]
    one = RewardModelScorer(str(path), batch_size=1)
    ids = one.encode(prompts, responses)
    reference = _one_at_a_time(one.model, ids)
    assert one.score_ids(ids) == pytest.approx(reference, abs=1e-5)
    eight = RewardModelScorer(str(path), batch_size=8)
    assert eight.score_ids(ids) == pytest.approx(reference, abs=1e-5)
    assert eight.mode == "last_token"


def test_scorer_falls_back_to_the_model_forward_when_the_fast_path_disagrees(tiny_rm, monkeypatch, caplog):
    """A model whose reward is not score(last hidden state) fails the first-batch check and is scored by its own
    forward, with a warning."""
    scorer = RewardModelScorer(tiny_rm, batch_size=4)
    ids = scorer.encode(["Hi", "Tell me about Oak Hollow park"], ["ok", "It is a quiet park with old trees."])
    reference = _one_at_a_time(scorer.model, ids)
    monkeypatch.setattr(rewards, "last_token_rewards", lambda model, input_ids, pooled: pooled * 0.0 + 7)
    with caplog.at_level(logging.WARNING, logger="rlhf_pipeline.rewards"):
        got = scorer.score_ids(ids)
    assert scorer.mode == "forward"
    assert "scoring with the model's own forward" in caplog.text
    assert got == pytest.approx(reference, abs=1e-5)


def test_scorer_falls_back_when_the_fast_path_fails(tiny_rm, monkeypatch):
    scorer = RewardModelScorer(tiny_rm, batch_size=4)
    ids = scorer.encode(["Hi", "Tell me about Oak Hollow park"], ["ok", "It is a quiet park with old trees."])

    def broken(*args, **kwargs):
        raise RuntimeError("no")

    monkeypatch.setattr(rewards, "last_token_rewards", broken)
    got = scorer.score_ids(ids)
    assert scorer.mode == "forward"
    assert got == pytest.approx(_one_at_a_time(scorer.model, ids), abs=1e-5)


def test_only_one_label_classifiers_with_a_score_head_take_the_fast_path():
    model = _classifier("llama")
    assert rewards.supports_fast_path(model)
    model.config.num_labels = 3
    assert not rewards.supports_fast_path(model)
    gated = torch.nn.Module()  # e.g. ArmoRM: no `score` head, its reward comes from its own gating layers
    gated.config, gated.base_model_prefix, gated.model = model.config, "model", model.model
    gated.config.num_labels = 1
    assert not rewards.supports_fast_path(gated)


def test_a_scorer_that_loads_its_model_while_it_encodes_gives_the_same_rewards(tiny_rm):
    """``rlhf score`` makes its scorer with ``load_model=False``: ``score`` then loads the model on this thread while
    another encodes the conversations. Same ids, same batches, same model: bitwise the same rewards as a scorer that
    loaded first, over more conversations than one encoding chunk."""
    from rlhf_pipeline.chat import ENCODE_CHUNK

    n = ENCODE_CHUNK + 50
    prompts = [f"Write a review of item {i}." for i in range(n)]
    responses = [("great " * (i % 7) + "fine " * (i % 3)).strip() or "ok" for i in range(n)]
    eager = RewardModelScorer(tiny_rm, batch_size=8)
    lazy = RewardModelScorer(tiny_rm, batch_size=8, load_model=False)
    assert lazy.model is None
    expected = eager.score(prompts, responses)
    assert lazy.score(prompts, responses) == expected
    assert lazy.model is not None and lazy.mode == eager.mode == "last_token"


def test_the_model_loads_once_every_chunk_is_rendered_and_a_failed_load_is_the_error_raised(tiny_rm, monkeypatch):
    """With ``load_model=False`` the model loads on this thread once every chunk of conversations is rendered (the
    template and the loading both need the GIL; the encoder, which does not, is fed first), while the encoder
    finishes. A failed load (or Ctrl-C) is the error raised, and no encoding thread outlives the call."""
    import threading

    from rlhf_pipeline import chat

    events = []
    real_render = chat._render

    def recording_render(tokenizer, add_generation_prompt):
        render = real_render(tokenizer, add_generation_prompt)

        def each(convs):
            events.append("render")
            return render(convs)

        return each

    monkeypatch.setattr(chat, "_render", recording_render)
    n = chat.ENCODE_CHUNK * 5
    prompts, responses = [f"prompt {i // 4}" for i in range(n)], [f"response {i}" for i in range(n)]

    scorer = RewardModelScorer(tiny_rm, load_model=False)
    real_load = scorer.load_model
    monkeypatch.setattr(scorer, "load_model", lambda: (events.append("load"), real_load()))
    assert scorer.score(prompts, responses) == RewardModelScorer(tiny_rm).score(prompts, responses)
    assert events[:6] == ["render"] * 5 + ["load"]  # then the fast path's check renders the first conversation

    failing = RewardModelScorer(tiny_rm, load_model=False)

    def fail():
        raise OSError("the reward model's weights are unreadable")

    monkeypatch.setattr(failing, "load_model", fail)
    threads = threading.active_count()
    with pytest.raises(OSError, match="unreadable"):
        failing.score(prompts, responses)
    assert threading.active_count() == threads
