"""The hf engine's top-p / top-k warpers give exactly transformers' processed logits (hence the same samples)."""

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper as HFTemperature
from transformers.generation.logits_process import TopKLogitsWarper as HFTopK
from transformers.generation.logits_process import TopPLogitsWarper as HFTopP

from rlhf_pipeline.engines import SamplingSettings
from rlhf_pipeline.engines.hf import TopKLogitsWarper, TopPLogitsWarper, sampling_processors, sorted_values


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _logits(kind: str, rows: int = 16, vocab: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if kind == "flat":  # a random-initialised model: almost uniform, the nucleus is most of the vocabulary
        return x * 0.05
    if kind == "peaked":  # a trained model: a few tokens hold the mass
        return x * 8
    if kind == "ties":  # many equal logits, some on both sides of the cut
        return (x * 2).round() / 2
    if kind == "masked":  # after top-k or a bad-words filter
        x[:, : vocab // 2] = -float("inf")
        return x
    if kind == "one_finite":
        x[:, 1:] = -float("inf")
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties", "masked", "one_finite"])
@pytest.mark.parametrize("top_p", [0.0, 1e-9, 0.1, 0.5, 0.9, 0.95, 0.999999])
@pytest.mark.parametrize("min_tokens_to_keep", [1, 3])
def test_top_p_equals_transformers(kind, top_p, min_tokens_to_keep):
    x = _logits(kind)
    expected = HFTopP(top_p, min_tokens_to_keep=min_tokens_to_keep)(None, x)
    _same(TopPLogitsWarper(top_p, min_tokens_to_keep=min_tokens_to_keep)(None, x), expected)


def test_top_p_exact_boundaries_and_small_vocabularies():
    # probabilities exactly 0.5 / 0.25 / 0.125 / 0.125: cumulative sums land exactly on 1 - top_p for these top_p
    x = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.125, 0.5, 0.125, 0.25]]))
    for top_p in (0.5, 0.75, 0.875, 1 - 0.125, 0.25, 0.3):
        _same(TopPLogitsWarper(top_p)(None, x), HFTopP(top_p)(None, x))
    for vocab in (1, 2, 3):
        y = torch.randn(5, vocab)
        _same(TopPLogitsWarper(0.7)(None, y), HFTopP(0.7)(None, y))


def test_ties_across_the_cut_go_through_transformers():
    """Equal logits on both sides of the cut: which of them transformers keeps depends on the order torch.sort gives
    them, so such rows are handed to transformers' own warper, and the result is still identical."""
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    warper = TopPLogitsWarper(0.7)
    _same(warper(None, x), HFTopP(0.7)(None, x))
    assert warper.fallback_rows == 2
    untied = TopPLogitsWarper(0.7)
    distinct = torch.arange(100.0).repeat(8, 1) / 10  # no two logits of a row are equal
    _same(untied(None, distinct), HFTopP(0.7)(None, distinct))
    assert untied.fallback_rows == 0


def test_nan_rows_go_through_transformers():
    x = torch.randn(3, 50)
    x[1, 7] = float("nan")
    warper = TopPLogitsWarper(0.9)
    _same(warper(None, x), HFTopP(0.9)(None, x))
    assert warper.fallback_rows == 1
    _same(TopKLogitsWarper(5)(None, x), HFTopK(5)(None, x))


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties", "masked", "one_finite"])
@pytest.mark.parametrize("top_k", [1, 2, 50, 1023, 1024, 5000])
def test_top_k_equals_transformers(kind, top_k):
    x = _logits(kind)
    _same(TopKLogitsWarper(top_k)(None, x), HFTopK(top_k)(None, x))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 0.9), (1.0, 0, 0.9), (0.7, 40, 0.95), (1.3, 5, 1.0),
                                                     (1.0, 0, 1.0)])
def test_sampling_processors_equal_generates_chain(temperature, top_k, top_p):
    """Temperature, then top-k, then top-p: the order and the values generate applies for the same settings."""
    settings = SamplingSettings(n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=1, seed=0,
                                stop_token_ids=(0,))
    reference = LogitsProcessorList()
    if temperature != 1.0:
        reference.append(HFTemperature(temperature))
    if top_k:
        reference.append(HFTopK(top_k))
    if top_p < 1.0:
        reference.append(HFTopP(top_p))
    for kind in ("flat", "peaked", "ties"):
        x = _logits(kind, rows=40)
        _same(sampling_processors(settings)(None, x), reference(None, x))
    greedy = SamplingSettings(**{**settings.__dict__, "temperature": 0.0})
    assert len(sampling_processors(greedy)) == 0


def test_sorted_values_match_torch_sort():
    for kind in ("flat", "ties", "masked"):
        x = _logits(kind)
        _same(sorted_values(x), torch.sort(x, dim=-1).values)
