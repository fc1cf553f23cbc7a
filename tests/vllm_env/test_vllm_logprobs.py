"""Sampling vs training: vLLM's log-probs of the tokens it sampled against ``rlhf_pipeline.logprobs``.

REBEL's reference pass and the PPO family's importance ratios compute the sampling policy's log-probs with
``logprobs.token_logps`` at the sampling temperature, over the full tempered softmax. vLLM reports the sampled
tokens' log-probs in one of two modes (``LLM(logprobs_mode=...)``, ``vllm/v1/sample/sampler.py``):
``raw_logprobs`` (the default) is ``log_softmax(logits)`` before temperature, top-k and top-p; ``processed_logprobs``
is taken after them, so under top-p it is renormalised over the nucleus. The trainer's number for a sampled token is
therefore ``raw`` at temperature 1, ``processed`` when top-p is off, and ``processed + log(nucleus mass)`` under
top-p. The tests check all three to float precision, so the one real gap, the top-p truncation that the trainer does
not model (as REBEL does not), is measured and not mistaken for numerical noise.
"""

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

pytestmark = pytest.mark.usefixtures("shared_vllm_engines")

TEMPERATURE, TOP_P, MAX_NEW = 0.8, 0.9, 16
TOLERANCE = 1e-3  # float32 on both sides, different kernels; log-probs here are around -1 to -9


@pytest.fixture(scope="module")
def setup(stop_prone_policy, bundled_prompts):
    import torch
    from transformers import AutoTokenizer

    from rlhf_pipeline.chat import encode_prompts
    from rlhf_pipeline.modeling import load_causal_lm

    tok = AutoTokenizer.from_pretrained(stop_prone_policy)
    texts = [json.loads(line)["prompt"] for line in Path(bundled_prompts).read_text().splitlines()[:8]]
    model = load_causal_lm(stop_prone_policy, dtype="float32", device=torch.device("cpu"))
    return tok, encode_prompts(tok, texts), model


def sample(llm, prompts, top_p, seed=0):
    """(prompt ids, response ids, vLLM's log-prob of each sampled token) for n=2 samples per prompt."""
    from vllm import SamplingParams

    params = [SamplingParams(n=2, temperature=TEMPERATURE, top_p=top_p, max_tokens=MAX_NEW, seed=seed + i, logprobs=0)
              for i in range(len(prompts))]
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for prompt, result in zip(prompts, results):
        for out in result.outputs:
            ids = list(out.token_ids)
            rows.append((prompt, ids, [out.logprobs[k][t].logprob for k, t in enumerate(ids)]))
    return rows


def ours(model, rows, temperature):
    """``logprobs.token_logps`` of every sampled token, and the full tempered distribution at each of them."""
    import torch

    from rlhf_pipeline.logprobs import build_batch, token_logps

    batch = build_batch([r[0] for r in rows], [r[1] for r in rows], pad_id=0)
    with torch.no_grad():
        values, _ = token_logps(model, batch, temperature=temperature)
        dists = []
        for prompt, response, _ in rows:
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
            dists.append(torch.softmax(logits / temperature, dim=-1))
    return values.tolist(), dists


def nucleus_mass(probs, top_p):
    """The probability mass vLLM keeps under top-p (``apply_top_k_top_p``: sort ascending, drop the tokens whose
    cumulative mass is at most 1 - top_p, always keep the most likely one)."""
    import torch

    ascending = torch.sort(probs, dim=-1).values
    dropped = torch.cumsum(ascending, dim=-1) <= 1 - top_p
    dropped[..., -1] = False
    return ascending.masked_fill(dropped, 0.0).sum(-1)


def flat(rows):
    return [lp for _, _, lps in rows for lp in lps]


def test_raw_logprobs_equal_ours_at_temperature_one(setup, stop_prone_policy, shared_vllm_engines):
    import rlhf_pipeline.engines as engines

    tok, prompts, model = setup
    engine = engines.load_engine("vllm", stop_prone_policy, tok)  # the suite's shared engine, default logprobs mode
    rows = sample(engine.llm, prompts, TOP_P)
    theirs, (mine, _) = flat(rows), ours(model, rows, 1.0)
    gap = max(abs(a - b) for a, b in zip(theirs, mine))
    print(f"\n[logprobs] raw_logprobs vs token_logps(T=1): max |diff| {gap:.2e} over {len(mine)} tokens")
    assert len(theirs) == len(mine) and gap < TOLERANCE


def test_processed_logprobs_equal_ours_at_the_sampling_temperature_up_to_the_nucleus(setup, stop_prone_policy):
    import torch
    from vllm import LLM

    tok, prompts, model = setup
    llm = LLM(model=stop_prone_policy, dtype="float32", logprobs_mode="processed_logprobs")
    try:
        # top-p off: vLLM samples from exactly the distribution the trainer assumes
        full = sample(llm, prompts, 1.0)
        theirs, (mine, _) = flat(full), ours(model, full, TEMPERATURE)
        gap_full = max(abs(a - b) for a, b in zip(theirs, mine))
        # top-p 0.9: vLLM's log-prob is renormalised over the nucleus; the trainer's is not
        nucleus = sample(llm, prompts, TOP_P)
        theirs, (mine, dists) = flat(nucleus), ours(model, nucleus, TEMPERATURE)
        log_mass = torch.log(torch.cat([nucleus_mass(d, TOP_P) for d in dists])).tolist()
        truncation = [a - b for a, b in zip(theirs, mine)]  # = -log(mass) >= 0
        explained = max(abs(t + m) for t, m in zip(truncation, log_mass))
    finally:
        llm.llm_engine.engine_core.shutdown()
    print(f"\n[logprobs] processed_logprobs vs token_logps(T={TEMPERATURE}), top-p 1: max |diff| {gap_full:.2e}; "
          f"top-p {TOP_P}: vLLM - ours = -log(nucleus mass), mean {sum(truncation) / len(truncation):.4f}, "
          f"max {max(truncation):.4f}, unexplained max {explained:.2e} over {len(truncation)} tokens")
    assert gap_full < TOLERANCE
    assert explained < TOLERANCE
    assert sum(truncation) / len(truncation) > 10 * TOLERANCE  # the gap is real, not noise
