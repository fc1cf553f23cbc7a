"""``--attn-implementation varlen``: the attention function against a dense causal reference, its mask function, and
the log-prob pass of a varlen model (one unpadded row, the sequences' bounds as FlashAttentionKwargs) against the same
model's padded sdpa pass, in values and gradients, on the tiny Llama and on two other architectures (Qwen2; Mistral
with a sliding window). The CPU runs the per-sequence reference; the CUDA kernel is checked against it where a GPU is.
"""

import copy
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from rlhf_pipeline import attention  # noqa: E402
from rlhf_pipeline.attention import register_varlen, varlen_attention, varlen_mask, varlen_reference  # noqa: E402
from rlhf_pipeline.logprobs import _varlen_layout, build_batch, sequence_logps, token_logps  # noqa: E402
from rlhf_pipeline.modeling import enable_activation_checkpointing  # noqa: E402
from conftest import naive_sequence_logps, parameter_grads  # noqa: E402

# Lengths that cover a one-token response, empty responses and a one-token prompt.
PROMPT_LENS = [3, 12, 7, 1, 9, 4, 2]
RESPONSE_LENS = [15, 1, 8, 0, 3, 6, 0]


def dense_causal(q, k, v, lengths, scale, window=None):
    """(B, H, T, D) attention over sequences of ``lengths`` one after another in one row, with an explicit
    block-diagonal causal mask (and sliding window) and a hand-written softmax, in float64."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(seq))
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v.double()).transpose(1, 2)  # (B, T, H, D)


def _flash_probs(q, k, v, cu_seq, is_causal, scale, window_size):
    """Flash attention's varlen convention over the whole row, in float32: q (T, H, D), k and v (T, Hk, D) with Hk
    dividing H (repeated to H), sequences bounded by ``cu_seq``, window_size (left, right) with -1 for unbounded.
    Returns q, k, v as (H, T, D), the attention probabilities (H, T, T), their log-sum-exp (H, T) and the scale."""
    left, right = window_size if window_size is not None else (-1, -1)
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    lengths = (cu_seq[1:] - cu_seq[:-1]).tolist()
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(seq))
    allowed = seq[:, None] == seq[None, :]
    if left >= 0:
        allowed &= pos[None, :] >= pos[:, None] - left
    if right >= 0:
        allowed &= pos[None, :] <= pos[:, None] + right
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qs, ks, vs = (x.float().transpose(0, 1) for x in (q, k, v))
    scores = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(-1)
    return qs, ks, vs, (scores - lse[..., None]).exp(), lse, scale


def flash_attention(q, k, v, cu_seq, is_causal, scale, window_size):
    """The output (T, H, D) in q's dtype and the log-sum-exp (H, T) in float32, as torch's varlen operator returns
    them (:func:`_flash_probs`'s convention)."""
    _, _, vs, probs, lse, _ = _flash_probs(q, k, v, cu_seq, is_causal, scale, window_size)
    return (probs @ vs).transpose(0, 1).contiguous().to(q.dtype), lse  # contiguous, as the operator's shape function


def flash_attention_grads(grad_out, q, k, v, cu_seq, is_causal, scale, window_size):
    """The gradients of :func:`flash_attention`'s output for q, k and v, by hand (a kernel runs below autograd):
    dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O)), dQ = dS K · scale, dK = dSᵀ Q · scale, K and V's summed over the
    query heads that share them."""
    qs, ks, vs, probs, _, scale = _flash_probs(q, k, v, cu_seq, is_causal, scale, window_size)
    go = grad_out.float().transpose(0, 1)  # (H, T, D)
    ds = probs * (go @ vs.transpose(-1, -2) - (go * (probs @ vs)).sum(-1, keepdim=True))
    dq, dk, dv = ((ds @ ks * scale), (ds.transpose(-1, -2) @ qs * scale), (probs.transpose(-1, -2) @ go))
    groups = q.shape[1] // k.shape[1]
    dk, dv = (x.transpose(0, 1).reshape(x.shape[1], k.shape[1], groups, x.shape[-1]).sum(2) for x in (dk, dv))
    return dq.transpose(0, 1).contiguous().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def bounds(lengths, device="cpu"):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}


def qkv(lengths, heads=4, kv_heads=2, dim=16, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return [torch.randn(1, h, total, dim, generator=gen).to(device=device, dtype=dtype)
            for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("window", [None, 3])
def test_varlen_attention_matches_a_dense_causal_reference_with_gqa(window):
    lengths = [1, 5, 3, 8, 2]
    q, k, v = qkv(lengths)
    module = SimpleNamespace(is_causal=True)
    out, weights = varlen_attention(module, q, k, v, None, scaling=0.3, sliding_window=window, **bounds(lengths))
    assert weights is None and out.shape == (1, sum(lengths), 4, 16)
    torch.testing.assert_close(out.double(), dense_causal(q, k, v, lengths, 0.3, window), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("takes_gqa", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_the_kernel_is_called_as_torch_2_11_and_2_13_take_it(monkeypatch, takes_gqa, window):
    """The GPU path's call, checked on a CPU against a stand-in with flash attention's conventions: tokens (N, H, D),
    int32 bounds, int lengths, window_size (left, right) counted as flash attention counts it; key/value heads
    repeated for torch 2.11's varlen_attn (no enable_gqa), passed as they are with enable_gqa for 2.13's."""
    lengths = [1, 5, 3, 8, 2]
    q, k, v = qkv(lengths)

    def stand_in(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **gqa):
        assert query.dim() == 3 and cu_q.dtype == cu_k.dtype == torch.int32 and type(max_q) is type(max_k) is int
        assert isinstance(window_size, tuple) and gqa == ({"enable_gqa": True} if takes_gqa else {})
        if not takes_gqa:
            assert key.shape[1] == query.shape[1]
        return flash_attention(query, key, value, cu_q, False, scale, window_size)[0]

    monkeypatch.setattr(attention, "_kernel_runs", lambda query: True)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: (stand_in, takes_gqa))
    out = varlen_attention(SimpleNamespace(is_causal=True), q, k, v, None, scaling=0.3, sliding_window=window,
                           **bounds(lengths))[0]
    torch.testing.assert_close(out.double(), dense_causal(q, k, v, lengths, 0.3, window), rtol=1e-5, atol=1e-6)


def test_the_kernel_path_traces_without_a_graph_break(monkeypatch):
    """Under --compile (each decoder layer compiled) the GPU path must be one graph: nothing of ours between the
    projections and the kernel may stop Dynamo (the kernel's lookup is a module variable, not a cached function),
    and new lengths must not compile it again. Checked on a CPU with a traceable stand-in for the kernel."""
    import torch._dynamo

    def stand_in(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **gqa):
        return query * scale

    monkeypatch.setattr(attention, "_kernel_runs", lambda query: True)
    monkeypatch.setattr(attention, "_KERNEL", (stand_in, True))
    lengths = [1, 5, 3]
    q, k, v = qkv(lengths)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(varlen_attention)(SimpleNamespace(is_causal=True), q, k, v, None, scaling=0.3,
                                                        **bounds(lengths))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    # and compiled with dynamic shapes, as --compile compiles a layer, new lengths (tokens, sequences, the longest)
    # reuse the one graph: no bound is specialised on (lengths chosen to match no head count or head size, which
    # Dynamo's duck sizing would tie together once)
    compiled = torch.compile(varlen_attention, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for lengths in ([1, 5, 3, 2, 6], [2, 7, 4, 1, 9, 3], [11, 3, 5, 7, 6, 2, 5]):
        q, k, v = qkv(lengths)
        compiled(SimpleNamespace(is_causal=True), q, k, v, None, scaling=0.3, **bounds(lengths))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_without_bounds_it_is_transformers_sdpa_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = qkv([6])
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    mask[..., 0] = False  # a left pad
    mask[..., 0, 0] = True
    for m in (None, mask):
        got = varlen_attention(module, q, k, v, m, scaling=0.25)[0]
        torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, m, scaling=0.25)[0])


def test_attention_dropout_is_refused():
    from rlhf_pipeline.errors import PipelineError

    q, k, v = qkv([4])
    with pytest.raises(PipelineError, match="dropout 0.1 is not supported"):
        varlen_attention(SimpleNamespace(is_causal=True), q, k, v, None, dropout=0.1, **bounds([4]))


def test_the_mask_function_builds_no_mask_without_padding():
    """Packed rows get no dense mask; a padding mask (batched generation) or a binding sliding window gets sdpa's."""
    from transformers.masking_utils import sdpa_mask

    common = dict(batch_size=1, q_length=6, kv_length=6, device="cpu")
    assert varlen_mask(**common, attention_mask=None, allow_is_causal_skip=False) is None
    assert varlen_mask(**common, attention_mask=None, local_size=8) is None
    padding = torch.tensor([[False, True, True, True, True, True]])
    torch.testing.assert_close(varlen_mask(**common, attention_mask=padding), sdpa_mask(**common, attention_mask=padding))
    windowed = varlen_mask(**common, attention_mask=None, local_size=3)
    torch.testing.assert_close(windowed, sdpa_mask(**common, attention_mask=None, local_size=3))


def test_the_one_row_layout_by_hand():
    """prompts [[1,2],[3],[8]], responses [[4,5,6],[7],[]] packed in rows of 5: [[1,2,4,5,6],[3,7,8,pad,pad]]."""
    batch = build_batch([[1, 2], [3], [8]], [[4, 5, 6], [7], []], pad_id=0, pack_ratio=1.0)
    assert batch.input_ids.tolist() == [[1, 2, 4, 5, 6], [3, 7, 8, 0, 0]]
    assert (batch.lengths, batch.prompt_lengths, batch.starts) == ((5, 2, 1), (2, 1, 1), (0, 5, 7))
    index, cu, longest, predict, seq_index = _varlen_layout(batch)
    assert batch.input_ids.reshape(-1)[index].tolist() == [1, 2, 4, 5, 6, 3, 7, 8]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 7, 8] and longest == 5
    assert predict.tolist() == [1, 2, 3, 5]  # predicting 4, 5, 6 and 7
    assert seq_index.tolist() == [0, 0, 0, 1]


# ----------------------------------------------------------------------------------------------------------------
# The log-prob pass of a varlen model


def tiny_model(arch: str, tiny_policy: str):
    """The tiny kit's Llama (2 query heads, 1 key/value head), or a random Qwen2 (biased q/k/v) or Mistral (a
    sliding window of 6, shorter than most sequences here) of the same vocabulary with 4 query and 2 key/value
    heads, in float64."""
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch == "llama":
        return AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float64).eval()
    vocab = AutoModelForCausalLM.from_pretrained(tiny_policy).config.vocab_size
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape)).double().eval()
    return MistralForCausalLM(MistralConfig(**shape, sliding_window=6)).double().eval()


def varlen_copy(model):
    register_varlen()
    copied = copy.deepcopy(model)
    copied.set_attn_implementation("varlen")
    return copied


@pytest.fixture(scope="module")
def seqs(tiny_policy):
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in RESPONSE_LENS]
    return prompts, responses


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of the per-sequence reference and of sdpa's dense mask, and the bounds the attention got."""
    from transformers import masking_utils

    seen = {"reference": 0, "dense_masks": 0}
    reference, dense = attention.varlen_reference, masking_utils.sdpa_mask

    def counting_reference(*args, **kwargs):
        seen["reference"] += 1
        seen["bounds"] = args[3].tolist()
        return reference(*args, **kwargs)

    def counting_mask(*args, **kwargs):
        seen["dense_masks"] += 1
        return dense(*args, **kwargs)

    monkeypatch.setattr(attention, "varlen_reference", counting_reference)
    monkeypatch.setattr(masking_utils, "sdpa_mask", counting_mask)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("ratio", [0.0, 1.5, 100.0])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_varlen_logps_equal_the_padded_sdpa_ones(arch, ratio, temperature, tiny_policy, seqs, spy):
    """Whatever the batch's layout, a varlen model sees one unpadded row and gives each sequence the log-probs
    the sdpa model gives it padded, and those of the sequence alone; empty responses score 0."""
    prompts, responses = seqs
    model = tiny_model(arch, tiny_policy)
    varlen = varlen_copy(model)
    batch = build_batch(prompts, responses, pad_id=0, pack_ratio=ratio)
    with torch.no_grad():
        padded = sequence_logps(model, build_batch(prompts, responses, pad_id=0), temperature=temperature)
        got = sequence_logps(varlen, batch, temperature=temperature)  # its first call probes it against padding
        spy.update(reference=0, dense_masks=0)
        logps, seq_index = token_logps(varlen, batch, temperature=temperature)
    lengths = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    assert spy["bounds"] == [0, *torch.tensor(lengths).cumsum(0).tolist()]  # every sequence in order, one row
    assert spy["reference"] >= model.config.num_hidden_layers
    if arch != "mistral":  # the sliding window is shorter than the row: sdpa's mask is built for it (and not used)
        assert spy["dense_masks"] == 0
    torch.testing.assert_close(got, padded, rtol=0, atol=1e-9)
    torch.testing.assert_close(got, naive_sequence_logps(model, prompts, responses, temperature), rtol=0, atol=1e-9)
    assert got[3].item() == got[6].item() == 0.0
    assert torch.bincount(seq_index, minlength=len(prompts)).tolist() == RESPONSE_LENS
    assert torch.equal(seq_index, torch.sort(seq_index).values)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_varlen_float32_close_to_padded_sdpa_with_gradients(arch, tiny_policy, seqs):
    """In float32 (what a CPU trains in) values and every parameter's gradient agree to float rounding."""
    prompts, responses = seqs
    model = tiny_model(arch, tiny_policy).float()
    varlen = varlen_copy(model)
    weights = torch.linspace(0.5, 1.5, len(prompts))
    grads = []
    for m, ratio in ((model, 0.0), (varlen, 2.0)):
        m.zero_grad()
        values = sequence_logps(m, build_batch(prompts, responses, pad_id=0, pack_ratio=ratio), temperature=0.8)
        (values * weights).sum().backward()
        grads.append((values.detach(), parameter_grads(m)))
    (padded, padded_grads), (got, got_grads) = grads
    torch.testing.assert_close(got, padded, rtol=1e-5, atol=1e-5)
    assert padded_grads.keys() == got_grads.keys() and "model.embed_tokens.weight" in got_grads
    for name in padded_grads:
        torch.testing.assert_close(got_grads[name], padded_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_critic_values_and_checkpointed_gradients_of_varlen_models(tiny_policy, tiny_rm, seqs):
    """PPO's critic reads its values through the same rows, and a policy trained with gradient checkpointing passes
    the bounds through its recomputed layers: both as with sdpa."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_pipeline.logprobs import token_values

    prompts, responses = seqs
    batch = build_batch(prompts, responses, pad_id=0, pack_ratio=2.0)
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_rm, dtype=torch.float64).eval()
    with torch.no_grad():
        (values, index), (expected, expected_index) = (token_values(m, batch) for m in (varlen_copy(critic), critic))
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-9)

    model = tiny_model("llama", tiny_policy)
    grads = []
    for m in (model, varlen_copy(model)):
        enable_activation_checkpointing(m)
        m.train()
        sequence_logps(m, batch).sum().backward()
        grads.append(parameter_grads(m))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-7, atol=1e-10, msg=name)


def test_a_model_that_drops_the_bounds_falls_back_to_padding(tiny_policy, seqs, caplog, monkeypatch):
    """A model whose attention code does not pass cu_seq_lens_q on would let the sequences of the row see each other;
    the probe notices and the batch is computed padded, with a warning."""
    prompts, responses = seqs
    model = tiny_model("llama", tiny_policy)
    varlen = varlen_copy(model)
    real = varlen_attention

    def dropping(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("cu_seq_lens_q", None)
        return real(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "varlen", dropping)
    with torch.no_grad(), caplog.at_level("WARNING", logger="rlhf_pipeline.logprobs"):
        got = sequence_logps(varlen, build_batch(prompts, responses, pad_id=0, pack_ratio=2.0))
    assert "sequences of a varlen row" in caplog.text and "falling back to padded batches" in caplog.text
    torch.testing.assert_close(got, naive_sequence_logps(model, prompts, responses), rtol=0, atol=1e-9)


def test_padded_generation_of_a_varlen_model_masks_the_pads(tiny_policy):
    """Batched, left-padded generation goes through sdpa with the padding mask: a prompt's greedy continuation does
    not depend on the longer prompt beside it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy, **attention.from_pretrained_kwargs("varlen")).eval()
    assert model.config._attn_implementation == "varlen"
    short, long = [5, 6, 7], [9, 10, 11, 12, 13, 14]
    ids = torch.tensor([[0, 0, 0] + short, long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batched = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[0, 6:]
        alone = model.generate(input_ids=torch.tensor([short]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                               **kwargs)[0, 3:]
    assert batched.tolist() == alone.tolist()


def test_a_varlen_reward_model_scores_as_sdpa(tiny_rm):
    """Reward scoring runs the body on right-padded rows without bounds: sdpa's attention, the fast path kept."""
    from rlhf_pipeline.rewards import RewardModelScorer

    sequences = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    scorers = [RewardModelScorer(tiny_rm, attn_implementation=name, batch_size=2)
               for name in ("sdpa", "varlen")]
    sdpa, varlen = (scorer.score_ids(sequences) for scorer in scorers)
    assert scorers[1].model.config._attn_implementation == "varlen" and scorers[1].mode == "last_token"
    assert varlen == pytest.approx(sdpa, abs=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen_attn kernel needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 5])
def test_the_cuda_kernel_matches_the_reference_in_bfloat16(window):
    """On a GPU in bf16 the attention runs torch's varlen_attn (the key/value heads repeated where this torch has no
    enable_gqa); it must give the per-sequence reference's output on the same inputs, to bf16's rounding."""
    lengths = [1, 37, 5, 128, 64, 2]
    q, k, v = qkv(lengths, heads=8, kv_heads=2, dim=64, dtype=torch.bfloat16, device="cuda")
    module = SimpleNamespace(is_causal=True)
    assert attention._kernel_runs(q)
    out = varlen_attention(module, q, k, v, None, scaling=0.125, sliding_window=window,
                           **bounds(lengths, device="cuda"))[0]
    flat = [x.float().transpose(1, 2).reshape(sum(lengths), x.shape[1], 64) for x in (q, k, v)]
    expected = varlen_reference(*flat, bounds(lengths, "cuda")["cu_seq_lens_q"], scale=0.125, sliding_window=window)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[0].float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen_attn kernel needs a CUDA GPU")
def test_a_bf16_varlen_model_on_the_gpu_gives_the_padded_sdpa_logps(tiny_policy, seqs, spy):
    """The whole pass on a GPU in bf16: the kernel runs (the reference does not), forward and backward, and the
    log-probs are padded sdpa's to bf16's rounding (the bound test_logprobs' bf16 test uses)."""
    from transformers import AutoModelForCausalLM

    prompts, responses = seqs
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.bfloat16).cuda()
    varlen = varlen_copy(model)
    with torch.no_grad():
        padded = sequence_logps(model, build_batch(prompts, responses, pad_id=0).to("cuda"))
    got = sequence_logps(varlen, build_batch(prompts, responses, pad_id=0, pack_ratio=2.0).to("cuda"))
    got.sum().backward()
    assert spy["reference"] == 0
    torch.testing.assert_close(got.detach(), padded, rtol=5e-2, atol=0.5)
    grad = varlen.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0


# varlen_op_on_the_cpu's kernels: registered once, on in that fixture; the calls of each
_CPU_OP = {"registered": False, "on": False, "forward": 0, "backward": 0}


def _check_op_bounds(cu_seq_q, cu_seq_k, max_q, max_k):
    """What flash attention takes on trust and the reference does not read: the keys' bounds are the queries' (one
    row of whole sequences), and max_q and max_k are the longest sequence, as plain ints once a compiled graph runs."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    longest = int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    assert type(max_q) is int and type(max_k) is int and max_q == max_k == longest, (max_q, max_k, longest)


def _cpu_op_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                    window_size=None, *_, **__):  # torch 2.13 adds enable_gqa and paged-KV arguments: the shapes say GQA
    if not _CPU_OP["on"]:
        raise RuntimeError("torch_attn::_varlen_attn has a CPU kernel only inside the varlen_op_on_the_cpu fixture")
    _CPU_OP["forward"] += 1
    _check_op_bounds(cu_seq_q, cu_seq_k, max_q, max_k)
    out, lse = flash_attention(query, key, value, cu_seq_q, is_causal, scale, window_size)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _cpu_op_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                     scale=None, window_size=None):
    if not _CPU_OP["on"]:
        raise RuntimeError("torch_attn::_varlen_attn_backward has a CPU kernel only inside varlen_op_on_the_cpu")
    _CPU_OP["backward"] += 1
    _check_op_bounds(cu_seq_q, cu_seq_k, max_q, max_k)
    return flash_attention_grads(grad_out, query, key, value, cu_seq_q, is_causal, scale, window_size)


@pytest.fixture
def varlen_op_on_the_cpu(monkeypatch):
    """PyTorch's own varlen_attn operator (``torch_attn::_varlen_attn`` and its backward, the custom ops the GPU path
    calls) given a CPU kernel, and the trainer's kernel path taken for CPU tensors in bf16: the GPU path's graph, the
    real operator with its fake (shape) functions, its autograd and its arguments as torch passes them, on a CPU.
    Outside this fixture the kernel refuses to run, as the operator does on a CPU without it."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if not _CPU_OP["registered"]:
        varlen._varlen_attn.register_kernel("cpu")(_cpu_op_forward)
        varlen._varlen_attn_backward.register_kernel("cpu")(_cpu_op_backward)
        _CPU_OP["registered"] = True
    monkeypatch.setattr(attention, "_kernel_runs",
                        lambda q: q.dtype in (torch.bfloat16, torch.float16) and attention._varlen_attn() is not None)
    _CPU_OP["on"] = True
    try:
        yield
    finally:
        _CPU_OP["on"] = False


@pytest.mark.parametrize("window", [None, 3])
def test_the_varlen_ops_cpu_kernel_is_the_dense_reference_forward_and_backward(varlen_op_on_the_cpu, window,
                                                                                 monkeypatch):
    """The stand-in kernel the CPU runs of the GPU path use, through torch's operator and its autograd: outputs and
    gradients (grouped key/value heads summed) are the dense block-diagonal float64 reference's, to the float32 the
    kernel computes in (as flash attention accumulates)."""
    monkeypatch.setattr(attention, "_kernel_runs", lambda q: True)
    calls = _CPU_OP["forward"], _CPU_OP["backward"]
    lengths = [1, 5, 3, 8, 2]
    q, k, v = (x.requires_grad_() for x in qkv(lengths, dtype=torch.float64))
    out = varlen_attention(SimpleNamespace(is_causal=True), q, k, v, None, scaling=0.3, sliding_window=window,
                           **bounds(lengths))[0]
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    expected = dense_causal(*leaves, lengths, 0.3, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, dtype=torch.float64)
    out.backward(grad)
    expected.backward(grad)
    for got, want in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
    assert (_CPU_OP["forward"], _CPU_OP["backward"]) == (calls[0] + 1, calls[1] + 1)  # through the operator


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="the varlen_attn kernel needs a CUDA GPU")),
    "cpu",
])
def test_compiled_layers_on_the_varlen_op_give_the_eager_logps_and_gradients(device, tiny_policy, seqs, request):
    """--compile on the GPU path: each decoder layer of a bf16 varlen model compiled by Inductor, with torch's
    varlen_attn operator inside the graph, gives the eager model's log-probs and gradients to bf16's rounding, over
    two micro-batches of other lengths (the second reuses the compiled graphs). On a GPU with the flash kernel; on a
    CPU with the same operator given a CPU kernel (``varlen_op_on_the_cpu``), which checks the graph, the dynamic
    shapes and the operator's autograd without a GPU."""
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.training.compilation import compile_decoder_layers

    if device == "cpu":
        request.getfixturevalue("varlen_op_on_the_cpu")
    calls = []
    real = attention._varlen_kernel
    monkey = pytest.MonkeyPatch()
    monkey.setattr(attention, "_varlen_kernel", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts, responses = seqs
    eager = varlen_copy(AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.bfloat16).to(device))
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_decoder_layers(compiled)
    try:
        for cut in (len(prompts), 4):  # all the sequences, then the first four: other lengths, other bounds
            batch = build_batch(prompts[:cut], responses[:cut], pad_id=0, pack_ratio=2.0).to(device)
            got = []
            for model in (eager, compiled):
                model.zero_grad()
                before = _CPU_OP["forward"], _CPU_OP["backward"]
                logps = sequence_logps(model, batch)
                logps.sum().backward()
                got.append((logps.detach().float(), model.model.layers[0].self_attn.q_proj.weight.grad.float()))
                if device == "cpu":  # every layer, compiled too, went through the operator both ways
                    layers = model.config.num_hidden_layers
                    assert _CPU_OP["forward"] - before[0] >= layers and _CPU_OP["backward"] - before[1] == layers
            (want, want_grad), (have, have_grad) = got
            torch.testing.assert_close(have, want, rtol=1e-2, atol=0.1)  # the same kernel: bf16 rounding alone
            cosine = torch.nn.functional.cosine_similarity(have_grad.flatten(), want_grad.flatten(), dim=0)
            assert cosine > 0.99, cosine
    finally:
        monkey.undo()
    assert calls  # the kernel path ran (eager; the compiled layers call the operator from their graphs)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= 1 and counters["frames"]["total"] == counters["frames"]["ok"]
    assert not counters["graph_break"], dict(counters["graph_break"])  # the operator inside the layers' graphs


def test_log_prob_passes_leave_cudnn_sdpa_out_on_a_gpu():
    """On a CUDA device an sdpa (or varlen) model's log-prob pass runs with every sdpa backend but cuDNN's (which
    plans anew on the host for every new shape); elsewhere, and for other implementations, nothing is changed."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from rlhf_pipeline.attention import sdpa_backends

    sdpa = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    eager = SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager"))
    assert isinstance(sdpa_backends(sdpa, torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(sdpa_backends(eager, torch.device("cuda")), contextlib.nullcontext)
    # varlen's calls without bounds (generation, a padded fallback) are sdpa's: the same backends
    varlen = SimpleNamespace(config=SimpleNamespace(_attn_implementation="varlen"))
    assert not isinstance(sdpa_backends(varlen, torch.device("cuda")), contextlib.nullcontext)
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    with sdpa_backends(sdpa, torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before


def test_a_varlen_pass_counts_no_padding_in_its_positions(tiny_policy):
    """The trainer's real-token fraction compares real tokens with the positions a pass ran: the packed grid
    (padding included) for sdpa, the real tokens alone for varlen's one unpadded row."""
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.attention import from_pretrained_kwargs
    from rlhf_pipeline.logprobs import build_batch, positions_processed

    batch = build_batch([[1, 5, 6], [1, 7], [1, 8, 9, 10]], [[11, 12], [13], [14, 15, 16, 17, 18]], pad_id=0,
                        pack_ratio=1.0)
    assert batch.num_padded_tokens > 0
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_policy)
    varlen = AutoModelForCausalLM.from_pretrained(tiny_policy, **from_pretrained_kwargs("varlen"))
    assert positions_processed(sdpa, batch) == batch.num_real_tokens + batch.num_padded_tokens
    assert positions_processed(varlen, batch) == batch.num_real_tokens == 17


def test_the_layout_probe_holds_under_bf16_autocast(tiny_policy, monkeypatch):
    """The trainer runs its log-prob passes under bf16 autocast over float32 weights (--bf16). The probe that checks
    a layout keeps sequences apart must judge the layout, not bf16's rounding: in an H100 run it compared varlen's
    bf16 kernel with padded sdpa at float32's tolerance, failed, and sent every pass back to padded batches. Here a
    stand-in for the GPU kernel (the reference, with bf16-sized errors added) runs wherever the inputs are bf16: the
    probe still passes under autocast, the passes after it go through the kernel, and sdpa's packed rows pass too."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline import attention
    from rlhf_pipeline.attention import from_pretrained_kwargs
    from rlhf_pipeline.logprobs import _CHECKED, _decoder_body, _layout_works, build_batch, sequence_logps

    calls = []

    def noisy_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, sliding_window):
        calls.append(q.dtype)
        out = attention.varlen_reference(q.float(), k.float(), v.float(), cu_q, scale=scale, causal=causal,
                                         sliding_window=sliding_window)
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(len(calls)))
        return (out * (1 + 4e-3 * noise)).to(q.dtype)

    monkeypatch.setattr(attention, "_kernel_runs", lambda q: q.dtype in (torch.bfloat16, torch.float16))
    monkeypatch.setattr(attention, "_varlen_kernel", noisy_kernel)
    batch = build_batch([[1, 5, 6], [1, 7]], [[11, 12], [13, 14, 15]], pad_id=0, pack_ratio=2.0)
    for name, varlen in (("varlen", True), ("sdpa", False)):
        model = AutoModelForCausalLM.from_pretrained(tiny_policy, **from_pretrained_kwargs(name))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert _layout_works(model, _decoder_body(model), batch, varlen), name
        assert getattr(model, _CHECKED[varlen]) is True
    assert not calls  # the probe ran in float32: the reference, not the kernel
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logps = sequence_logps(model, batch)  # sdpa, packed
        model = AutoModelForCausalLM.from_pretrained(tiny_policy, **from_pretrained_kwargs("varlen"))
        varlen_logps = sequence_logps(model, batch)
    assert calls and set(calls) == {torch.bfloat16}  # the real pass took the kernel, in bf16
    assert torch.allclose(varlen_logps, logps, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies to and from a GPU")
@pytest.mark.parametrize("attn, pack_ratio", [("varlen", 2.0), ("sdpa", 0.0)])
def test_a_gpu_micro_batch_copies_from_pinned_memory_and_waits_only_for_transformers_mask_checks(tiny_policy, seqs,
                                                                                                   tmp_path, attn,
                                                                                                   pack_ratio):
    """A DPO micro-batch on a GPU (bf16; varlen's one row, and sdpa's padded layout) makes no copy from pageable host
    memory, each of which would make the host wait for all the work queued before it, and reads nothing back but
    transformers' own mask checks (``masking_utils``: one for packed sequences before a one-row forward, two to skip
    sdpa's mask before a padded one): the host can build the next micro-batch while the GPU runs this one's backward."""
    import json

    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.algorithms.pairs import PairTask
    from rlhf_pipeline.losses import PairLossParams

    prompts, responses = seqs
    rows = [{"prompt_token_ids": p, "chosen_token_ids": r, "rejected_token_ids": r[::-1] or [5],
             "chosen_ref_logp": -1.0, "rejected_ref_logp": -2.0} for p, r in zip(prompts, responses)]
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.bfloat16).to("cuda")
    model = varlen_copy(model) if attn == "varlen" else model
    assert model.config._attn_implementation == attn
    task = PairTask("dpo", PairLossParams(beta=0.1), temperature=1.0, pad_id=0, pack_ratio=pack_ratio)
    task.loss(model, rows[:4])[0].backward()  # a first call probes a packed or one-row layout, reading back by design
    if attn == "varlen":
        assert model._rlhf_varlen_works is True  # the probe kept the one-row layout (else this measures the fallback)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        task.loss(model, rows[2:])[0].backward()  # other pairs, other lengths
        torch.cuda.synchronize()  # (cudaDeviceSynchronize: not counted below)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    names = [e.get("name", "") for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]]
    assert any(n.startswith("Memcpy HtoD") for n in names)  # the batch was copied (the trace holds copies)
    assert [n for n in names if "Pageable -> Device" in n] == []
    checks = 1 if attn == "varlen" else 2  # transformers' own reads (the docstring)
    assert len([n for n in names if n.startswith("Memcpy DtoH")]) <= checks
    assert len([n for n in names if n in ("cudaStreamSynchronize", "cudaEventSynchronize")]) <= checks  # no other
