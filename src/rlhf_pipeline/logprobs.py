"""Log-probabilities of response tokens: the one place they are computed.

The trainer (π_θ), the reference pass (π_t, under ``torch.no_grad``) and PPO all call :func:`token_logps` /
:func:`sequence_logps` on a :class:`Batch` from :func:`build_batch`, so the three can never drift apart the way
REBEL's three copies of the same computation can (``gather_logprob``, ``evaluate`` and the training loop in
``src/ultrafeedback_largebatch/rebel.py``).

Why the LM head runs only where it is needed
--------------------------------------------
REBEL pads every pair to exactly 1024 prompt + 2048 response positions and calls the full model, so it
materialises ``(2, 3072, 128_256)`` logits and then a ``log_softmax`` of the same size: about 3 GB of fp32 per pair
(2 × 3072 × 128k × 4 bytes), most of it for prompt and pad positions whose log-probs are thrown away. Here the
decoder body runs once, the hidden states of the positions that predict a response token are gathered into an
``(N, H)`` matrix (N = number of response tokens in the batch), and the LM head plus the softmax run on that matrix
``chunk_size`` rows at a time. Peak logits memory is ``chunk_size × V`` instead of ``B × T × V``. By default a chunk
holds at most ``LOGITS_CHUNK_ELEMENTS`` logits (2^25: 128 MiB in fp32): 4,096 rows up to a 8,192-id vocabulary, 261 at
Llama-3's 128,256. A fixed row count would not bound anything at a real vocabulary size: 4,096 rows of 128k fp32
logits are 2 GiB, and the softmax and its backward hold two or three tensors that size (``rlhf bench``'s
``memory_peak_vs_trl_large_vocab`` measures it; docs/benchmarks.md).

With gradients enabled each chunk runs under non-reentrant activation checkpointing: autograd keeps only the chunk's
hidden rows (already alive) and its ``(chunk,)`` log-probs, and recomputes the chunk's logits in backward. Without
that, autograd would save every chunk's fp32 logits for backward and the chunking would bound nothing while training.
The price is one extra LM-head matmul over the N response rows in backward.

Layouts: padded, packed, or one row
-----------------------------------
:func:`build_batch` lays sequences (``prompt + response``) out in one of two ways; both give the same log-probs, and
so does the one-row layout a varlen model gets (below).

*Padded* (``pack_ratio=0``): one sequence per row, right-padded to the longest sequence in the batch (no fixed
maximum length). With right padding every real token sits at the position it would have alone, and the causal mask
plus the padding mask keep pads from influencing real tokens.

*Packed* (``pack_ratio > 0``, what the trainer uses): several sequences share a row, one after another, each with
its own position ids restarting at 0, and no attention mask. Transformers reads the restarts in ``position_ids`` as
sequence boundaries and builds a block-diagonal causal mask (sdpa, eager) or variable-length attention
(flash-attention), so a token attends only to earlier tokens of its own sequence. Rows hold up to
``pack_ratio × the longest sequence`` tokens (2 by default) and are balanced (longest sequence first, into the emptiest row), so a
pair whose chosen response is long and rejected short no longer pads the short one to the long one's length.

Why not one row for everything with sdpa and eager: they compute the whole ``T × T`` score grid of a row and mask
it, so a row of k sequences costs up to k times the attention of padding them; rows of about twice the longest
sequence keep that overhead small while removing most padding (``rlhf bench`` measures the real-token fraction and
the step time of both layouts; docs/benchmarks.md).

*One row* (a model loaded with ``--attn-implementation varlen`` or ``flash_attention_2``, whose attention takes the
sequences' bounds: ``rlhf_pipeline.attention``): whatever the batch's layout, the decoder gets all its sequences in
one row, one after another in order, with no padding at all and no attention mask, plus each sequence's bounds as
transformers' FlashAttentionKwargs (``cu_seq_lens_q``/``cu_seq_lens_k``, int32, and ``max_length_q``/
``max_length_k``). A variable-length kernel attends within each sequence only and skips the blocks between them, so
one row costs no more attention than the sequences alone, and no ``T × T`` mask is built (but for a model whose
sliding window is shorter than the row: transformers asks for its mask, which goes unused). The row is gathered
from the batch through an index worked out on the host from the sequence lengths :func:`build_batch` records
(``Batch.lengths``, ``prompt_lengths``, ``starts``), so nothing is read back from the device to build it. On a CUDA
GPU in bf16/fp16 ``varlen`` runs PyTorch's ``varlen_attn``; on a CPU it runs a per-sequence reference (one sdpa call
per sequence): the same log-probs as the padded sdpa pass, to float rounding (the tests check values and gradients),
but no faster, which is why the CPU default stays sdpa.

Packing relies on the model building its attention mask through transformers' masking utilities, as every model
ported to transformers 5 does, and the one-row layout on its attention code passing the bounds on to the attention
function, as transformers' own models do. A model that does not would let sequences see each other silently, so
the first packed (or one-row) call on a model checks that layout against padded hidden states on a probe and falls
back to padding, with a warning, when they differ. Results never depend on what else is in the batch (the tests
check this against an unpadded one-at-a-time reference, in every layout).

Temperature
-----------
Log-probs are of ``softmax(logits / temperature)``. REBEL samples at temperature 0.8 and computes both π_θ and π_t
at that same temperature (``logits / (temperature + 1e-7)``); pass the sampling temperature to match it (we divide by
the temperature exactly, without REBEL's 1e-7). Top-p (and top-k) truncation of the sampling distribution is NOT
modelled, exactly as in REBEL: the log-prob is under the full tempered softmax, not the renormalised nucleus.

Heads handled
-------------
A linear output embedding (``model.get_output_embeddings()``, tied or not), optionally followed by Gemma-2-style
final-logit soft-capping (``config.final_logit_softcapping``; see below). Anything else a model's own ``forward`` does
to its logits after the LM head (logit scaling as in Cohere's ``logit_scale``, Granite's ``logits_scaling``, MoE
auxiliary heads, value heads, multi-token-prediction heads) is NOT reproduced; such models need their own rule here.

Imports torch, ``modeling``'s unwrapping helpers and ``attention``'s :func:`~rlhf_pipeline.attention.takes_varlen`;
the model is duck-typed (a Hugging Face causal LM or anything with the same attributes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import Tensor

from rlhf_pipeline.attention import sdpa_backends, takes_varlen
from rlhf_pipeline.modeling import peel, supports_fast_path

log = logging.getLogger(__name__)


LOGITS_CHUNK_ELEMENTS = 2**25  # logits per LM-head chunk by default (see the module docstring)


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per LM-head chunk so that a chunk's logits stay within ``LOGITS_CHUNK_ELEMENTS`` (at most 4,096 rows,
    at least one)."""
    return max(1, min(4096, LOGITS_CHUNK_ELEMENTS // max(1, vocab_size)))


@dataclass
class Batch:
    """Prompt+response sequences laid out in R rows of length T, padded or packed (see the module docstring).

    S is the number of sequences; R = S in the padded layout, R <= S when packed.

    Attributes:
        input_ids: (R, T) long. Each row's sequences (``prompt + response``) one after another, then ``pad_id``.
        attention_mask: (R, T) long, 1 on real tokens and 0 on pads, in the padded layout; ``None`` when packed
            (transformers then derives the block-diagonal mask from ``position_ids``).
        position_ids: (R, T) long. Padded: ``0..T-1`` in every row (pads continue counting; they are masked out).
            Packed: ``0..len-1`` within each sequence, restarting at every sequence, and the row's trailing pads
            count from 0 again, so they form a block of their own that no real token sees.
        response_mask: (R, T) bool. True exactly on positions that hold response tokens.
        seq_ids: (R, T) long. Which sequence (0..S-1, in the order given to :func:`build_batch`) each position holds;
            -1 on pads.
        num_sequences: S.
        pad_id: the id written on pads.
        num_real_tokens: number of non-pad tokens.
        num_padded_tokens: number of pad tokens, ``R * T - num_real_tokens``.
        lengths: (S,) on the host: each sequence's tokens, prompt + response.
        prompt_lengths: (S,) on the host: each sequence's prompt tokens.
        starts: (S,) on the host: where each sequence's first token is in the flattened ``(R * T,)`` grid. With
            ``lengths`` they give the one-row layout of a varlen pass (see the module docstring) without reading the
            tensors back from the device.
    """

    input_ids: Tensor
    attention_mask: Tensor | None
    position_ids: Tensor
    response_mask: Tensor
    seq_ids: Tensor
    num_sequences: int
    pad_id: int
    num_real_tokens: int
    num_padded_tokens: int
    lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    starts: tuple[int, ...]

    @property
    def packed(self) -> bool:
        return self.attention_mask is None

    @property
    def response_counts(self) -> tuple[int, ...]:
        """(S,) on the host: each sequence's response tokens."""
        return tuple(n - p for n, p in zip(self.lengths, self.prompt_lengths))

    @property
    def padding_efficiency(self) -> float:
        """Fraction of the (R, T) grid that holds real tokens (1.0 means no padding)."""
        total = self.num_real_tokens + self.num_padded_tokens
        return self.num_real_tokens / total if total else 1.0

    def unpacked(self) -> Batch:
        """The same sequences in the padded layout (one per row)."""
        prompts, responses = [], []
        for i in range(self.num_sequences):
            where = self.seq_ids == i
            ids, is_response = self.input_ids[where].tolist(), self.response_mask[where]
            n_prompt = int((~is_response).sum())
            prompts.append(ids[:n_prompt])
            responses.append(ids[n_prompt:])
        return build_batch(prompts, responses, self.pad_id).to(self.input_ids.device)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on ``device`` (:func:`to_device`: the host does not wait for a GPU)."""
        return dataclasses.replace(
            self,
            input_ids=to_device(self.input_ids, device),
            attention_mask=None if self.attention_mask is None else to_device(self.attention_mask, device),
            position_ids=to_device(self.position_ids, device),
            response_mask=to_device(self.response_mask, device),
            seq_ids=to_device(self.seq_ids, device),
        )


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """``tensor``, made on the host, on ``device`` without making the host wait for that device. A copy from ordinary
    (pageable) host memory to a GPU first waits for all the work queued on the GPU before it, which then idles while
    the host prepares what comes next (the next micro-batch's layout, the loss); the trainer makes several such copies
    a micro-batch. On CUDA the copy goes through pinned memory and returns at once (PyTorch keeps the pinned block
    until the copy has run); anywhere else it is ``tensor.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pack_rows(lengths: list[int], pack_ratio: float) -> list[list[int]]:
    """Sequence indices per row: ``ceil(total / (pack_ratio × longest))`` rows, filled longest sequence first into
    the row with the fewest tokens so far (balanced rows waste the least padding at the row ends)."""
    import heapq

    capacity = max(1.0, pack_ratio) * max(lengths)
    num_rows = max(1, min(len(lengths), math.ceil(sum(lengths) / capacity)))
    heap = [(0, r) for r in range(num_rows)]  # (tokens so far, row)
    rows: list[list[int]] = [[] for _ in range(num_rows)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        rows[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(row) for row in rows if row]


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, pack_ratio: float = 0.0) -> Batch:
    """Lay ``prompts[i] + responses[i]`` out padded (``pack_ratio=0``) or packed into rows of up to ``pack_ratio ×``
    the longest sequence (``pack_ratio >= 1``; see the module docstring).

    ``pad_id`` must be an id the model can embed (REBEL swaps its out-of-vocabulary ``[PAD]`` for EOS for the same
    reason); its value never changes a result, because no real token attends to a pad.

    Every prompt needs at least one token (the first response token is predicted from the last prompt token, and in
    a packed row that token also marks where the sequence starts). An empty response is allowed and scores 0.0.
    """
    if len(prompts) != len(responses):
        raise ValueError(
            f"build_batch got {len(prompts)} prompts but {len(responses)} responses; pass one response per prompt"
        )
    if not prompts:
        raise ValueError("build_batch got an empty batch; pass at least one (prompt, response) pair")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(
                f"row {i} has an empty prompt: the first response token must be predicted from a preceding token; "
                "start prompts with BOS or the chat template's opening tokens"
            )
    if pack_ratio and pack_ratio < 1:
        raise ValueError(f"pack_ratio must be 0 (pad) or at least 1, got {pack_ratio}")

    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    rows = pack_rows(lengths, pack_ratio) if pack_ratio else [[i] for i in range(len(prompts))]
    num_rows, seq_len = len(rows), max(sum(lengths[i] for i in row) for row in rows)
    input_ids = torch.full((num_rows, seq_len), pad_id, dtype=torch.long)
    position_ids = torch.zeros((num_rows, seq_len), dtype=torch.long)
    response_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    seq_ids = torch.full((num_rows, seq_len), -1, dtype=torch.long)
    starts = [0] * len(prompts)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            starts[i] = r * seq_len + start
            end = start + lengths[i]
            input_ids[r, start:end] = torch.tensor(list(prompts[i]) + list(responses[i]), dtype=torch.long)
            position_ids[r, start:end] = torch.arange(lengths[i])
            response_mask[r, start + len(prompts[i]) : end] = True
            seq_ids[r, start:end] = i
            start = end
        position_ids[r, start:] = torch.arange(seq_len - start) + (0 if pack_ratio else start)
    attention_mask = None if pack_ratio else (seq_ids >= 0).long()

    num_real = sum(lengths)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        seq_ids=seq_ids,
        num_sequences=len(prompts),
        pad_id=pad_id,
        num_real_tokens=num_real,
        num_padded_tokens=num_rows * seq_len - num_real,
        lengths=tuple(lengths),
        prompt_lengths=tuple(len(p) for p in prompts),
        starts=tuple(starts),
    )


def positions_processed(model, batch: Batch) -> int:
    """Token positions a log-prob pass of ``model`` runs for ``batch``: its real tokens alone where the model's
    attention takes them as one unpadded row (``attention.takes_varlen``), else the batch's whole ``(R, T)`` grid,
    padding included (what ``throughput/real_token_fraction`` compares the real tokens with)."""
    if takes_varlen(_unwrap(model)):
        return batch.num_real_tokens
    return batch.num_real_tokens + batch.num_padded_tokens


def response_positions(batch: Batch) -> Tensor:
    """(N,) long, on the batch's device: each response token's position within its response, in the order a pass
    gives its tokens (:func:`token_logps`: by sequence, then position), from the lengths the host keeps."""
    return to_device(torch.cat([torch.arange(n) for n in batch.response_counts]), batch.seq_ids.device)


def response_lengths(batch: Batch) -> Tensor:
    """(S,) long, on the batch's device: the number of response tokens in each sequence, from the lengths the host
    keeps (counting ``response_mask`` on a GPU would make the host wait for the forward before the loss)."""
    return to_device(torch.tensor(batch.response_counts, dtype=torch.long), batch.seq_ids.device)


def _unwrap(model):
    """The Hugging Face model inside a DeepSpeed engine (``.module``) or returned as is."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and torch.is_grad_enabled():
        # Checked by running it (gloo, 2 processes): DDP all-reduces gradients only for a backward prepared by its own
        # forward(); calling the inner submodules directly, as token_logps does, leaves each rank with its local
        # gradient and no error. Under no_grad (the reference pass) nothing needs syncing, so that is allowed.
        raise TypeError(
            "token_logps cannot train through torch DistributedDataParallel: it calls the model's decoder and LM head "
            "directly, which bypasses DDP.forward, so gradients would silently not be all-reduced. Use DeepSpeed "
            "(accelerate's DeepSpeed plugin, any ZeRO stage), or call it under torch.no_grad for a reference pass."
        )
    # A DeepSpeed engine (and DDP) keeps the real model in ``.module``. Calling its submodules directly is fine under
    # ZeRO-3: ZeRO-3 gathers each submodule's partitioned parameters with per-module forward (and backward) hooks, so
    # the decoder body and the LM head gather their own weights when called; gradient reduction for ZeRO-1/2/3 is
    # driven by hooks on the parameters and by ``engine.backward``, not by ``engine.forward``. (Inferred from
    # DeepSpeed's design, not run here: skipping ``engine.forward`` also skips its autocast context and the prefetch
    # trace of the root module, which costs ZeRO-3 prefetch efficiency, not correctness.)
    # A peft model (LoRA) is peeled to the transformers model whose layers carry the adapters.
    return peel(getattr(model, "module", model))


def _decoder_body(model):
    """The transformer body that returns ``last_hidden_state`` (final norm included) without the LM head.

    ``get_decoder()`` on a transformers causal LM returns the inner base model (``LlamaForCausalLM`` →
    ``LlamaModel``; for multimodal wrappers, the ``language_model``); ``model.model`` is the fallback for models that
    lack it.
    """
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    return model.model


def _recomputable(head):
    """The LM head as the checkpointed chunks can call it again in backward. A frozen head (LoRA) partitioned by
    ZeRO-3 cannot be: ZeRO-3 gathers a frozen module's weight for its forward but not for a recomputation inside
    backward (checked: torch's checkpoint then finds a 0-element weight where the forward had the full one). So such a
    head's weight is gathered once here, on every process (the body's forward just before is collective too), and
    held, without gradient, until the step's backward is done: one head's worth of memory, not the logits'."""
    weight = getattr(head, "weight", None)
    if any(p.requires_grad for p in head.parameters()) or not hasattr(weight, "ds_id"):
        return head
    import deepspeed

    params = [p for p in (weight, getattr(head, "bias", None)) if p is not None]
    with deepspeed.zero.GatheredParameters(params):
        held = [p.detach().clone() for p in params]
    return lambda hidden: torch.nn.functional.linear(hidden, *held)


def _head_calls(head, chunks: int, device) -> int:
    """How many times this process calls the LM head: once a chunk, or under ZeRO-3 the most chunks of any process.
    There each call of a partitioned head gathers its weight from every process, a collective, in its forward and
    again in the recomputation of its backward: a process with fewer response tokens would take part in fewer
    gathers than the others and the step would hang (or read another collective's data). It calls the head on no
    rows for the difference (its hooks gather as any call's do; the rows' log-probs are unchanged). A head that
    :func:`_recomputable` holds gathered, or any head outside ZeRO-3, makes no collective: its chunks alone."""
    if not hasattr(getattr(head, "weight", None), "ds_id"):
        return chunks
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return chunks
    most = torch.tensor([chunks], dtype=torch.long, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _chunk_logps(head, hidden: Tensor, targets: Tensor, softcap: float | None, temperature: float) -> Tensor:
    """Log-probs of ``targets`` (n,) under ``softmax(softcap(head(hidden)) / temperature)``, hidden (n, H)."""
    logits = _chunk_logits(head, hidden, softcap, temperature)
    # log_softmax(x)[y] = x[y] - logsumexp(x), without allocating a second (n, V) tensor for the full log_softmax.
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_logps_entropy(head, hidden: Tensor, targets: Tensor, softcap: float | None,
                         temperature: float) -> tuple[Tensor, Tensor]:
    """:func:`_chunk_logps` and the entropy of each row's distribution, ``logsumexp(x) − Σ softmax(x)·x``."""
    logits = _chunk_logits(head, hidden, softcap, temperature)
    norm = torch.logsumexp(logits, dim=-1)
    entropy = norm - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm, entropy


def _chunk_logits(head, hidden: Tensor, softcap: float | None, temperature: float) -> Tensor:
    logits = head(hidden)  # (n, V) in the model's dtype
    # Upcast half precision to float32 for the softmax (float64 models stay float64).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        # Gemma-2: logits = cap * tanh(logits / cap) right after the LM head (Gemma2ForCausalLM.forward), i.e. before
        # any sampling temperature. Transformers applies it in the model dtype; we apply it after the upcast.
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def _response_rows(inner, body, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Run ``body`` over the batch and gather the hidden states of the positions that predict a response token.

    Returns ``(rows (N, H), targets (N,), seq_index (N,))``, ordered by sequence, then position. A model whose
    attention takes unpadded sequences with their bounds (``attention.takes_varlen``) gets the batch as one row
    without padding (:func:`_varlen_forward`), whichever layout it has; any other model gets it as laid out.
    """
    varlen = takes_varlen(inner)
    if (varlen or batch.packed) and not _layout_works(inner, body, batch, varlen):
        varlen = False
        if batch.packed:
            batch = batch.unpacked()
    if varlen:
        hidden, ids, predict, seq_index = _varlen_forward(body, batch)
        return hidden[predict], ids[predict + 1], seq_index
    # use_cache=False: a training/scoring pass has no use for a KV cache, and building one wastes memory.
    with sdpa_backends(inner, batch.input_ids.device):
        out = body(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
    hidden = out.last_hidden_state  # (R, T, H)

    # Position t predicts token t + 1, so the rows we need are those whose *next* position holds a response token,
    # in the flattened (R * T) grid, found on the host (a mask's nonzero on a GPU would wait for the forward).
    device = batch.input_ids.device
    predict, seq_index = (to_device(t, device) for t in _response_predictors(batch, torch.tensor(batch.starts)))
    return hidden.reshape(-1, hidden.shape[-1])[predict], batch.input_ids.reshape(-1)[predict + 1], seq_index


def _varlen_layout(batch: Batch) -> tuple[Tensor, Tensor, int, Tensor, Tensor]:
    """The one row of a varlen pass, worked out on the host from the batch's sequence lengths, so that nothing is
    read back from the device: the sequences 0..S-1 one after another, without padding.

    Returns ``(index (L,), cu_seq_lens (S + 1,) int32, longest, predict (N,), seq_index (N,))``: where each token of
    the row is in the flattened ``(R * T,)`` grid of the batch, the sequences' bounds in the row, the longest
    sequence, the row positions whose next token is a response token (sequence by sequence, then position) and the
    sequence of each.
    """
    lengths = torch.tensor(batch.lengths)
    ends = lengths.cumsum(0)
    offsets = ends - lengths  # where each sequence starts in the row
    index = torch.arange(sum(batch.lengths)) + torch.repeat_interleave(torch.tensor(batch.starts) - offsets, lengths)
    cu_seq_lens = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    predict, seq_index = _response_predictors(batch, offsets)
    return index, cu_seq_lens, max(batch.lengths), predict, seq_index


def _response_predictors(batch: Batch, starts: Tensor) -> tuple[Tensor, Tensor]:
    """The positions whose next token is a response token, sequence by sequence then position, for sequences that
    start at ``starts`` (in the batch's flattened ``(R * T,)`` grid, or in a varlen pass's one row), and the sequence
    of each: worked out on the host from the batch's lengths, so that nothing is read back from the device."""
    responses = torch.tensor(batch.response_counts, dtype=torch.long)
    first = starts + torch.tensor(batch.prompt_lengths) - 1  # a response's first token: predicted from the prompt's last
    predict = torch.arange(sum(batch.response_counts)) + torch.repeat_interleave(first - (responses.cumsum(0) - responses),
                                                                           responses)
    return predict, torch.repeat_interleave(torch.arange(batch.num_sequences), responses)


def _varlen_forward(body, batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``body`` over the batch as one unpadded row (:func:`_varlen_layout`), given the sequences' bounds as
    transformers' FlashAttentionKwargs, so that each token attends only to its own sequence and no attention mask is
    built. Returns ``(hidden (L, H), input_ids (L,), predict (N,), seq_index (N,))``, on the batch's device."""
    device = batch.input_ids.device
    index, cu_seq_lens, longest, predict, seq_index = _varlen_layout(batch)
    index, cu_seq_lens, predict, seq_index = (to_device(t, device) for t in (index, cu_seq_lens, predict, seq_index))
    input_ids = batch.input_ids.reshape(-1)[index]
    out = body(
        input_ids=input_ids[None],
        attention_mask=None,
        position_ids=batch.position_ids.reshape(-1)[index][None],  # 0..len-1 in each sequence, in both layouts
        use_cache=False,
        cu_seq_lens_q=cu_seq_lens,
        cu_seq_lens_k=cu_seq_lens,
        max_length_q=longest,
        max_length_k=longest,
    )
    return out.last_hidden_state[0], input_ids, predict, seq_index


def token_logps(model, batch: Batch, temperature: float = 1.0, chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of every response token in ``batch`` (``(logps, seq_index)``: see
    :func:`token_logps_and_entropy`, which also gives each position's entropy)."""
    logps, seq_index, _ = _token_pass(model, batch, temperature, chunk_size, entropy=False)
    return logps, seq_index


def token_logps_and_entropy(model, batch: Batch, temperature: float = 1.0,
                            chunk_size: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token log-probs of every response token in ``batch``, and the entropy of the policy's distribution (at
    ``temperature``) at each of those positions.

    Runs the decoder body once over (B, T), keeps the hidden states at positions t whose next token (t + 1) is a
    response token, and applies the LM head only to those N rows, ``chunk_size`` rows at a time.

    Args:
        model: a causal LM (``get_decoder()`` or ``.model``, ``get_output_embeddings()``, optional
            ``config.final_logit_softcapping``), possibly wrapped by a DeepSpeed engine (``.module``).
        batch: from :func:`build_batch`, on the model's device.
        temperature: log-probs are of ``softmax(logits / temperature)``; use the sampling temperature to match REBEL.
        chunk_size: rows of the LM head computed at once; bounds logits memory at ``chunk_size × V``. Default:
            :func:`default_chunk_rows` of the head's vocabulary.

    Returns:
        ``(logps, seq_index, entropy)``: logps (N,) in float32 (float64 for a float64 model), ordered by sequence then
        position; seq_index (N,) long, the sequence (0..S-1) each log-prob belongs to; entropy (N,) like logps, in
        nats. Differentiable when grad is enabled.
    """
    return _token_pass(model, batch, temperature, chunk_size, entropy=True)


def _token_pass(model, batch: Batch, temperature: float, chunk_size: int | None,
                entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; greedy decoding has no log-probs to match")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    inner = _unwrap(model)
    body = _decoder_body(inner)
    head = inner.get_output_embeddings()
    if chunk_size is None:
        # out_features, not weight.shape: under ZeRO-3 the weight outside a forward is an empty partition.
        vocab = getattr(head, "out_features", None) or getattr(getattr(inner, "config", None), "vocab_size", 0)
        chunk_size = default_chunk_rows(vocab)
    softcap = getattr(getattr(inner, "config", None), "final_logit_softcapping", None)

    rows, targets, seq_index = _response_rows(inner, body, batch)
    checkpoint = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in head.parameters()))
    if checkpoint:
        head = _recomputable(head)
    chunk = _chunk_logps_entropy if entropy else _chunk_logps
    pieces = []
    for k in range(_head_calls(head, -(-rows.shape[0] // chunk_size), rows.device)):
        start = k * chunk_size  # past the last row: a call on no rows (see _head_calls)
        args = (head, rows[start : start + chunk_size], targets[start : start + chunk_size], softcap, temperature)
        if checkpoint:
            piece = torch.utils.checkpoint.checkpoint(chunk, *args, use_reentrant=False)
        else:
            piece = chunk(*args)
        pieces.append(piece if entropy else (piece,))
    empty = rows.new_zeros((0,), dtype=torch.promote_types(rows.dtype, torch.float32))  # every response is empty
    logps = torch.cat([p[0] for p in pieces]) if pieces else empty
    entropies = (torch.cat([p[1] for p in pieces]) if pieces else empty) if entropy else None
    return logps, seq_index, entropies


def sequence_logps(model, batch: Batch, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """(S,) sum of the response tokens' log-probs per sequence, float32 (float64 for a float64 model).

    This is REBEL's sequence log-prob: the sum over the response tokens, the final EOS included when it is part of
    the response. An empty response sums to 0.0.
    """
    logps, seq_index = token_logps(model, batch, temperature=temperature, chunk_size=chunk_size)
    totals = torch.zeros(batch.num_sequences, dtype=logps.dtype, device=logps.device)
    return totals.index_add(0, seq_index, logps)


def token_values(critic, batch: Batch) -> tuple[Tensor, Tensor]:
    """Per-token values of a critic: for each response token t, ``V(prompt + response[:t])``, read at the same
    position whose hidden state predicts token t (so values line up one to one with :func:`token_logps`).

    ``critic`` is a sequence-classification model with one label (a reward model: the PPO critic starts as one),
    whose linear ``score`` head is applied here at every response position instead of only at the last token.
    Returns ``(values (N,) float32 or wider, seq_index (N,))``.
    """
    inner = _unwrap(critic)
    if not supports_fast_path(inner):
        raise TypeError(
            f"{type(inner).__name__} is not a one-label sequence classifier with a `score` head; the critic must be "
            "a reward model (AutoModelForSequenceClassification, num_labels=1), e.g. the one rlhf train-rm wrote"
        )
    body = getattr(inner, inner.base_model_prefix)
    rows, _, seq_index = _response_rows(inner, body, batch)
    values = inner.score(rows).squeeze(-1)
    return values.to(torch.promote_types(values.dtype, torch.float32)), seq_index


def split_by_sequence(values: Tensor, seq_index: Tensor, num_sequences: int) -> list[list[float]]:
    """Per-token values (N,) ordered by sequence (as :func:`token_logps` returns them) as one list per sequence."""
    counts = torch.bincount(seq_index, minlength=num_sequences).tolist()
    return [chunk.tolist() for chunk in torch.split(values.detach().cpu(), counts)]


_CHECKED = {False: "_rlhf_packing_works", True: "_rlhf_varlen_works"}  # the verdicts kept on a model, per layout


def _layout_works(model, body, batch: Batch, varlen: bool) -> bool:
    """Whether ``body`` keeps sequences apart in the layout it is about to get: packed rows (``varlen=False``), or
    the one unpadded row of a varlen pass with its bounds (a model whose own attention code dropped them would let
    the sequences mix). Checked once per model and layout on two short probe sequences against the padded layout.
    Every process makes the same first call, so ZeRO-3's collective forwards stay in step.

    The probe runs without autocast, in the weights' own precision: what it judges is whether sequences mix, which
    float32 shows to 1e-4, not how two attention kernels round in bf16. (Under the trainer's bf16 autocast over
    float32 weights, an H100 run compared varlen's flash kernel with padded sdpa at float32's tolerance, failed on
    rounding alone and sent every pass back to padded batches.) With float32 weights varlen's probe therefore runs
    its per-sequence reference, which takes the same bounds as the kernel: the bounds reaching the attention is what
    is checked; the kernel itself is checked against the reference by the GPU tests."""
    inner = _unwrap(model) if not isinstance(model, torch.nn.parallel.DistributedDataParallel) else model.module
    verdict = getattr(inner, _CHECKED[varlen], None)
    if verdict is None:
        device = batch.input_ids.device
        vocab = int(batch.input_ids.max()) + 1
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 7)]
        padded, packed = (build_batch([s[:2] for s in seqs], [s[2:] for s in seqs], 0, ratio).to(device)
                          for ratio in (0.0, 2.0))
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            hidden = body(input_ids=padded.input_ids, attention_mask=padded.attention_mask,
                          position_ids=padded.position_ids, use_cache=False).last_hidden_state
            reference = torch.cat([hidden[padded.seq_ids == i].float() for i in range(2)])
            if varlen:
                probed = _varlen_forward(body, packed)[0].float()
            else:
                out = body(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids,
                           use_cache=False).last_hidden_state
                probed = torch.cat([out[packed.seq_ids == i].float() for i in range(2)])
        scale = reference.abs().max().clamp(min=1e-6)
        tolerance = 1e-4 if hidden.dtype in (torch.float32, torch.float64) else 3e-2  # bf16/fp16 round more
        verdict = bool(((probed - reference).abs().max() / scale) <= tolerance)
        if not verdict:
            what, why = (("the sequences of a varlen row", "its attention code does not pass cu_seq_lens_q on")
                         if varlen else
                         ("packed sequences", "its attention mask does not come from transformers' masking utilities"))
            log.warning("%s does not keep %s apart (%s); falling back to padded batches", type(inner).__name__, what,
                        why)
        setattr(inner, _CHECKED[varlen], verdict)
    return verdict
