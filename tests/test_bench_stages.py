"""The stage benchmarks compare like with like: on tiny data each peer (REBEL's scripts re-created) gives the same
result as our stage, and the checks that guard the timed runs catch a difference. No timings are asserted."""

import dataclasses
import math

import pytest
from datasets import load_from_disk

from rlhf_pipeline.bench import stages
from rlhf_pipeline.chat import encode_prompts, load_tokenizer, stop_token_ids
from rlhf_pipeline.engines import SamplingSettings
from rlhf_pipeline.engines.hf import HFEngine


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """As the benchmarks run: on a shared 2-core machine a second OpenMP thread can stall every forward."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(stages.BENCH_TORCH_THREADS)
    yield
    torch.set_num_threads(threads)


def test_synthetic_scored_data_follows_the_contract(tiny_policy):
    tok = load_tokenizer(tiny_policy)
    cols = stages.synthetic_generations(tok, 40, 3)
    assert len(cols["prompt_id"]) == len(set(cols["prompt_id"])) == 40
    assert cols["prompt_token_ids"] == encode_prompts(tok, cols["prompt"])
    for texts, ids, finish, rewards in zip(cols["responses"], cols["response_token_ids"], cols["finish_reasons"],
                                           cols["rewards"]):
        assert len(texts) == len(ids) == len(finish) == len(rewards) == 3
        for text, token_ids, reason in zip(texts, ids, finish):
            assert (token_ids[-1] == tok.eos_token_id) == (reason == "stop")
            body = token_ids[:-1] if reason == "stop" else token_ids
            assert body == tok(text, add_special_tokens=False)["input_ids"]
            assert len(token_ids) < stages.MAX_RESPONSE_TOKENS
        assert all(math.isfinite(r) for r in rewards)
    assert any(len(p) > stages.MAX_PROMPT_TOKENS for p in cols["prompt_token_ids"])  # some prompts are dropped
    assert "rewards" not in stages.synthetic_generations(tok, 3, 2, scored=False)


def test_assistant_header_length_of_the_tiny_template(tiny_policy):
    assert stages.assistant_header_length(load_tokenizer(tiny_policy)) == 2  # <|bos|><|assistant|>


@pytest.fixture(scope="module")
def filtered(tmp_path_factory, tiny_policy):
    """Our filter stage and the REBEL re-creation on the same 40 prompts x 3 responses."""
    from rlhf_pipeline.stages.filter import FilterConfig
    from rlhf_pipeline.stages.filter import main as filter_main

    d = tmp_path_factory.mktemp("bench_filter")
    tok = load_tokenizer(tiny_policy)
    cols = stages.synthetic_generations(tok, 40, 3)
    ours_in = stages.save_ours(cols, d / "ours_in", "score", stages.sampling_record(tok, 3, 128))
    peer_in = stages.save_rebel(cols, d / "peer_in")
    ours = filter_main(FilterConfig(input=str(ours_in), output=str(d / "ours"), tokenizer=tiny_policy,
                                    max_prompt_tokens=stages.MAX_PROMPT_TOKENS,
                                    max_response_tokens=stages.MAX_RESPONSE_TOKENS, test_size=4))
    peer = stages.rebel_filter_tokenize(peer_in, d / "peer", tiny_policy, maxlen=stages.MAX_RESPONSE_TOKENS,
                                        maxlen_prompt=stages.MAX_PROMPT_TOKENS, pairs=3, test_size=4)
    return tok, ours, load_from_disk(str(ours)), peer


def test_rebel_filter_keeps_the_same_pairs_as_ours(filtered, tiny_policy):
    import json

    tok, ours_path, ours, peer = filtered
    pairs = stages.compare_pairs(ours, peer, tok.eos_token_id, tok.pad_token_id)
    kept = ours["train"].num_rows + ours["test"].num_rows
    assert pairs == kept == peer["train"].num_rows + peer["test"].num_rows
    manifest = json.loads((ours_path / "manifest.json").read_text())
    # Every way a prompt can be dropped on both sides occurs in the data, and nothing else drops rows.
    assert set(manifest["dropped"]) == {"prompt_too_long", "equal_rewards", "identical_chosen_rejected"}
    assert kept + sum(manifest["dropped"].values()) == 40
    assert manifest["responses_left_out"] == {"response_too_long": 0, "response_truncated": 0}
    # REBEL's padded columns are exactly the limits wide.
    row = peer["train"][0]
    assert len(row["llama_prompt_tokens"]) == stages.MAX_PROMPT_TOKENS
    assert len(row["llama_chosen_tokens"]) == len(row["llama_reject_tokens"]) == stages.MAX_RESPONSE_TOKENS


def test_compare_pairs_catches_a_difference(filtered):
    tok, _, ours, peer = filtered
    changed = dict(peer)
    first = peer["train"][0]["prompt_id"]
    changed["train"] = peer["train"].map(
        lambda r: {"reject_reward": r["reject_reward"] - 1.0 if r["prompt_id"] == first else r["reject_reward"]})
    with pytest.raises(AssertionError, match="rewards"):
        stages.compare_pairs(ours, type(peer)(changed), tok.eos_token_id, tok.pad_token_id)
    fewer = dict(peer)
    fewer["train"] = peer["train"].select(range(1, peer["train"].num_rows))
    with pytest.raises(AssertionError, match="kept prompts differ"):
        stages.compare_pairs(ours, type(peer)(fewer), tok.eos_token_id, tok.pad_token_id)


def test_one_by_one_scoring_gives_our_rewards(tmp_path, tiny_rm):
    from rlhf_pipeline.stages.score import ScoreConfig
    from rlhf_pipeline.stages.score import main as score_main

    tok = load_tokenizer(tiny_rm)
    cols = stages.synthetic_generations(tok, 20, 3, seed=1, scored=False)
    ours_in = stages.save_ours(cols, tmp_path / "ours_in", "generate", stages.sampling_record(tok, 3, 128))
    peer_in = stages.save_rebel(cols, tmp_path / "peer_in")
    ours = load_from_disk(str(score_main(ScoreConfig(input=str(ours_in), output=str(tmp_path / "ours"),
                                                     reward_model=tiny_rm, batch_size=8))))
    peer = stages.rebel_rank(peer_in, tmp_path / "peer", tiny_rm, pairs=3)
    assert stages.compare_scores(ours, peer, 3) < 1e-4
    assert len({round(r, 6) for rs in ours["rewards"] for r in rs}) > 30  # real, distinct rewards
    shifted = peer.map(lambda r, i: {"response_2_reward": r["response_2_reward"] + (1e-3 if i == 7 else 0.0)},
                       with_indices=True)
    with pytest.raises(AssertionError, match="row 7, response 2"):
        stages.compare_scores(ours, shifted, 3)


def test_n_passes_match_one_request_when_sampling_is_deterministic(tiny_policy):
    """With top-k 1 every sample is the most likely continuation, so one request with n=3 and three passes with
    n=1 must return the same tokens: both sides run the same engine on the same prompts, batching aside."""
    tok = load_tokenizer(tiny_policy)
    prompts = encode_prompts(tok, ["Write a short review of the movie Night Train.", "Hi", "Tell me about Oak Hollow",
                                   "Give a one-sentence review of Blue Canyon, a movie.", "What about the hotel?"])
    sampling = SamplingSettings(n=3, temperature=1.0, top_p=1.0, top_k=1, max_new_tokens=10, seed=0,
                                stop_token_ids=tuple(stop_token_ids(tok, tiny_policy)))
    engine = HFEngine(tiny_policy, tok, batch_size=2)
    seeds = list(range(len(prompts)))
    ours = engine.generate(prompts, seeds, sampling)
    peer = stages.generate_in_passes(engine, prompts, seeds, sampling)
    assert stages.check_completions(ours, 5, sampling) == stages.check_completions(peer, 5, sampling) > 0
    for a, b in zip(ours, peer):
        assert a.token_ids == b.token_ids and a.texts == b.texts and a.finish_reasons == b.finish_reasons
        assert a.token_ids[0] == a.token_ids[1] == a.token_ids[2]
    # With sampling the passes differ from each other: they are independent samples, as REBEL's are.
    sampled = stages.generate_in_passes(engine, prompts, seeds, dataclasses.replace(sampling, top_k=0))
    assert any(len({tuple(ids) for ids in c.token_ids}) > 1 for c in sampled)


def test_check_completions_catches_a_short_request(tiny_policy):
    from rlhf_pipeline.engines import Completion

    sampling = SamplingSettings(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=0,
                                stop_token_ids=(2,))
    good = Completion(texts=["a", "b"], token_ids=[[7], [8, 2]], finish_reasons=["length", "stop"])
    assert stages.check_completions([good], 1, sampling) == 3
    with pytest.raises(AssertionError, match="samples"):
        stages.check_completions([Completion(["a"], [[7]], ["length"])], 1, sampling)
    with pytest.raises(AssertionError, match="completions"):
        stages.check_completions([good], 2, sampling)


def test_run_produces_the_entries_and_the_record(tmp_path, monkeypatch):
    """The whole group at toy sizes: three entries with the fields the harness writes, and the scaling table."""
    import torch

    from rlhf_pipeline.bench.run import BenchConfig

    tiny = stages.Sizes(n=3, filter_prompts=40, score_prompts=8, generate_prompts=4, generate_max_new_tokens=4,
                        generate_batch_size=2, scaling_prompts=(6, 12, 24), scaling_max_new_tokens=4)
    monkeypatch.setattr(stages, "sizes_for", lambda quick: tiny)
    threads = torch.get_num_threads()
    entries, records = stages.run(BenchConfig(output=str(tmp_path), quick=True, rounds=1), tmp_path / "scratch")
    assert torch.get_num_threads() == threads  # restored
    assert [e.name for e in entries] == ["filter_vs_per_row", "score_batched_vs_one_by_one",
                                         "generate_one_call_vs_n_passes"]
    for e in entries:
        assert e.unit == "s" and e.ours > 0 and e.peer > 0 and e.target is not None
        assert e.ratio == pytest.approx(e.peer / e.ours)
        assert len(e.details["ours_seconds"]) == len(e.details["peer_seconds"]) == 1
        assert "Peer:" in e.notes and "Ours:" in e.notes
    ceiling = entries[1].details["forward_only"]
    assert ceiling["batched_seconds"] > 0 and ceiling["one_by_one_seconds"] > 0
    assert len(ceiling["fraction_per_round"]) == len(ceiling["batched_seconds_per_round"]) == 1  # the same rounds
    assert ceiling["ceiling_ratio"] == pytest.approx(entries[1].peer / ceiling["batched_seconds"], rel=1e-2)
    assert "Ceiling on this machine" in entries[1].notes and "{" not in entries[2].notes  # every field filled in
    (record,) = records
    assert record["title"] == "Stage time against data size"
    for stage in stages.SCALING_STAGES:
        assert f"| `{stage}` |" in record["markdown"]
