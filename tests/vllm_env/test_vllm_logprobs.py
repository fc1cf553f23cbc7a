"""Sampling vs training: vLLM's log-probs of the tokens it sampled (as ``rlhf generate`` stores them) against
``rlhf_pipeline.logprobs``, in float32 and in bf16, and the rollout correction on them.

REBEL's reference pass and the PPO family's importance ratios compute the sampling policy's log-probs with
``logprobs.token_logps`` at the sampling temperature, over the full tempered softmax. vLLM reports the sampled
tokens' log-probs in one of two modes (``LLM(logprobs_mode=...)``, ``vllm/v1/sample/sampler.py``):
``raw_logprobs`` (the default) is ``log_softmax(logits)`` before temperature, top-k and top-p; ``processed_logprobs``
is taken after them, so under top-p it is renormalised over the nucleus. The trainer's number for a sampled token is
therefore ``raw`` at temperature 1, ``processed`` when top-p is off, and ``processed + log(nucleus mass)`` under
top-p. ``rlhf generate`` asks for ``processed`` (what the sampler drew from) and keeps it; the tests check it against
the trainer to float precision at T = 1 and T = 0.8, and under top-p 0.9 that the whole gap is the nucleus
renormalisation, so the one real gap, the truncation the trainer does not model (as REBEL does not), is measured and
not mistaken for numerical noise; then both sides in bf16, and the rollout correction on these numbers.
"""

import json
import os
from pathlib import Path

import pytest

from conftest import run  # noqa: E402

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


def sample(llm, prompts, top_p, seed=0, temperature=TEMPERATURE):
    """(prompt ids, response ids, vLLM's log-prob of each sampled token) for n=2 samples per prompt."""
    from vllm import SamplingParams

    params = [SamplingParams(n=2, temperature=temperature, top_p=top_p, max_tokens=MAX_NEW, seed=seed + i, logprobs=0)
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


def stored(tmp_path, policy, prompts_file, temperature, top_p, name):
    """(prompt ids, response ids, the sampler's log-probs) as ``rlhf generate --engine vllm`` stored them."""
    from datasets import load_from_disk

    out = tmp_path / name
    assert run("generate", "--engine", "vllm", "--model", policy, "--prompts", prompts_file, "--output", out,
               "--n", 2, "--max-new-tokens", MAX_NEW, "--temperature", temperature, "--top-p", top_p) == 0
    ds = load_from_disk(str(out))
    return [(p, ids, lps) for p, rs, ls in zip(ds["prompt_token_ids"], ds["response_token_ids"],
                                               ds["response_logprobs"]) for ids, lps in zip(rs, ls)]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, bundled_prompts):
    d = tmp_path_factory.mktemp("logprob_prompts")
    lines = Path(bundled_prompts).read_text().splitlines()[:8]
    (d / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return str(d / "prompts.jsonl")


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 1.0), (1.0, 0.9)])
def test_the_stored_sampler_logprobs_against_the_trainers(setup, stop_prone_policy, prompts_file, tmp_path,
                                                          temperature, top_p):
    """What rlhf generate keeps (vLLM's processed log-probs, float32) against ``token_logps`` at the same temperature:
    equal to float precision without truncation; under top-p, above the trainer's by exactly −log(nucleus mass)."""
    import torch

    _, _, model = setup
    rows = stored(tmp_path, stop_prone_policy, prompts_file, temperature, top_p, "gen")
    theirs, (mine, dists) = flat(rows), ours(model, rows, temperature)
    gaps = [a - b for a, b in zip(theirs, mine)]
    assert len(theirs) == len(mine) and all(x == x for x in theirs)  # every token has its log-prob (no NaN)
    if top_p == 1.0:
        print(f"\n[logprobs] stored vs token_logps, T={temperature}, top-p 1: max |diff| "
              f"{max(abs(g) for g in gaps):.2e} over {len(gaps)} tokens")
        assert max(abs(g) for g in gaps) < TOLERANCE
    else:
        log_mass = torch.log(torch.cat([nucleus_mass(d, top_p) for d in dists])).tolist()
        explained = max(abs(g + m) for g, m in zip(gaps, log_mass))
        print(f"\n[logprobs] stored vs token_logps, T={temperature}, top-p {top_p}: mean gap "
              f"{sum(gaps) / len(gaps):.4f} (= -log nucleus mass), unexplained max {explained:.2e}")
        assert explained < TOLERANCE and sum(gaps) / len(gaps) > 10 * TOLERANCE


def test_in_bfloat16_on_both_sides_the_gap_is_the_precisions(setup, stop_prone_policy):
    """vLLM's CPU build in bf16 against the trainer in bf16 (what GPU users run), at T = 1, T = 0.8 and top-p 0.9:
    without truncation the whole gap is the two sides' bf16 kernels, measured and bounded; under top-p it is that
    plus the nucleus renormalisation. Against a float32 trainer for comparison."""
    import torch
    from vllm import LLM

    from rlhf_pipeline.advantages import rollout_correction
    from rlhf_pipeline.logprobs import build_batch, token_logps
    from rlhf_pipeline.modeling import load_causal_lm

    tok, prompt_ids, model32 = setup
    model16 = load_causal_lm(stop_prone_policy, dtype="bfloat16", device=torch.device("cpu"))
    llm = LLM(model=stop_prone_policy, dtype="bfloat16", logprobs_mode="processed_logprobs")
    try:
        runs = {(t, p): sample(llm, prompt_ids, p, temperature=t) for t, p in ((1.0, 1.0), (0.8, 1.0), (1.0, 0.9))}
    finally:
        llm.llm_engine.engine_core.shutdown()
    for (temperature, top_p), rows in runs.items():
        batch = build_batch([r[0] for r in rows], [r[1] for r in rows], pad_id=0)
        with torch.no_grad():
            mine16, _ = token_logps(model16, batch, temperature=temperature)
        mine32, dists = ours(model32, rows, temperature)
        theirs = torch.tensor(flat(rows), dtype=torch.float64)
        log_mass = torch.zeros_like(theirs) if top_p == 1.0 else \
            torch.log(torch.cat([nucleus_mass(d, top_p) for d in dists])).double()
        gap16 = (theirs + log_mass - mine16.double()).abs()  # the nucleus's share taken out under top-p
        gap32 = (theirs + log_mass - torch.tensor(mine32, dtype=torch.float64)).abs()
        mask = torch.ones(1, len(theirs), dtype=torch.bool)
        _, metrics = rollout_correction(mine16.double().unsqueeze(0), theirs.unsqueeze(0), mask, "tis", 2.0)
        print(f"\n[logprobs] bf16 vLLM, T={temperature}, top-p {top_p}: vs the bf16 trainer mean |diff| "
              f"{gap16.mean():.2e}, max {gap16.max():.2e}; vs the float32 trainer mean {gap32.mean():.2e}, max "
              f"{gap32.max():.2e}; k3 KL sampler/bf16 trainer {metrics['kl_sampler']:.2e} over {len(theirs)} tokens")
        assert gap16.max() < 0.5 and gap16.mean() < 0.05  # bf16 noise, not a different distribution
        if top_p == 1.0:
            assert metrics["kl_sampler"] < 1e-2


def test_a_trainer_at_another_temperature_than_the_sampler_is_caught_by_the_correction(
        setup, stop_prone_policy, prompts_file, tmp_path):
    """The sampler at T = 0.8, the trainer at T = 1.0 (a mistake): the k3 KL between them rises far above the
    matching pair's, and the correction acts (masking at cap 1.2 drops tokens; tis truncates some)."""
    import torch

    from rlhf_pipeline.advantages import rollout_correction

    _, _, model = setup
    rows = stored(tmp_path, stop_prone_policy, prompts_file, 0.8, 1.0, "gen_t08")
    sampler = torch.tensor(flat(rows), dtype=torch.float64).unsqueeze(0)
    mask = torch.ones_like(sampler, dtype=torch.bool)
    matched = torch.tensor(ours(model, rows, 0.8)[0], dtype=torch.float64).unsqueeze(0)
    other = torch.tensor(ours(model, rows, 1.0)[0], dtype=torch.float64).unsqueeze(0)
    _, same = rollout_correction(matched, sampler, mask, "mask", 1.2)
    _, off = rollout_correction(other, sampler, mask, "mask", 1.2)
    print(f"\n[logprobs] sampler T=0.8 vs trainer T=0.8: k3 KL {same['kl_sampler']:.2e}; vs trainer T=1.0: "
          f"{off['kl_sampler']:.2e}, mask at 1.2 drops {off['corrected_fraction']:.2%} of the tokens")
    assert same["kl_sampler"] < 1e-6 and same["corrected_fraction"] == 0.0
    assert off["kl_sampler"] > 1e-3 and off["corrected_fraction"] > 0.01
