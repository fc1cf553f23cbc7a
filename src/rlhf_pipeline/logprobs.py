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
``chunk_size`` rows at a time. Peak logits memory is ``chunk_size × V`` instead of ``B × T × V``.

With gradients enabled each chunk runs under non-reentrant activation checkpointing: autograd keeps only the chunk's
hidden rows (already alive) and its ``(chunk,)`` log-probs, and recomputes the chunk's logits in backward. Without
that, autograd would save every chunk's fp32 logits for backward and the chunking would bound nothing while training.
The price is one extra LM-head matmul over the N response rows in backward.

Padding and positions
---------------------
Sequences are ``prompt + response``, right-padded to the longest sequence in the batch (no fixed maximum length).
With right padding every real token sits at the same position it would have alone, and the causal mask plus the
padding mask keep pads from influencing real tokens, so results do not depend on what else is in the batch (the tests
check this against an unpadded one-at-a-time reference).

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

Imports only torch; the model is duck-typed (a Hugging Face causal LM or anything with the same attributes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import Tensor


@dataclass
class Batch:
    """Prompt+response sequences, right-padded to the longest one in the batch.

    B is the number of sequences and T the length of the longest ``prompt + response``.

    Attributes:
        input_ids: (B, T) long. ``prompt + response`` then ``pad_id`` up to T.
        attention_mask: (B, T) long. 1 on real (prompt or response) tokens, 0 on pads.
        position_ids: (B, T) long. ``0..T-1`` in every row; pads continue counting past the real tokens (they are
            masked out, so their positions do not matter). With right padding these equal the positions a Hugging Face
            model computes on its own when given none; they are passed explicitly so the contract does not rest on
            that default.
        response_mask: (B, T) bool. True exactly on positions that hold response tokens.
        num_real_tokens: number of non-pad tokens, ``attention_mask.sum()``.
        num_padded_tokens: number of pad tokens, ``B * T - num_real_tokens``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor
    num_real_tokens: int
    num_padded_tokens: int

    @property
    def padding_efficiency(self) -> float:
        """Fraction of the (B, T) grid that holds real tokens (1.0 means no padding)."""
        total = self.num_real_tokens + self.num_padded_tokens
        return self.num_real_tokens / total if total else 1.0

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on ``device``."""
        return Batch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_mask=self.response_mask.to(device),
            num_real_tokens=self.num_real_tokens,
            num_padded_tokens=self.num_padded_tokens,
        )


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    """Concatenate ``prompts[i] + responses[i]`` and right-pad with ``pad_id`` to the longest sequence.

    ``pad_id`` must be an id the model can embed (REBEL swaps its out-of-vocabulary ``[PAD]`` for EOS for the same
    reason); its value never changes a result, because pads are masked and come after every real token.

    Every prompt needs at least one token (the first response token is predicted from the last prompt token). An empty
    response is allowed and scores 0.0.
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

    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    batch_size, seq_len = len(prompts), max(lengths)
    input_ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, seq_len), dtype=torch.long)
    response_mask = torch.zeros((batch_size, seq_len), dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        n_prompt, n_total = len(prompt), lengths[i]
        input_ids[i, :n_total] = torch.tensor(list(prompt) + list(response), dtype=torch.long)
        attention_mask[i, :n_total] = 1
        response_mask[i, n_prompt:n_total] = True
    position_ids = torch.arange(seq_len, dtype=torch.long).expand(batch_size, seq_len).clone()  # (B, T)

    num_real = sum(lengths)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        num_real_tokens=num_real,
        num_padded_tokens=batch_size * seq_len - num_real,
    )


def response_lengths(batch: Batch) -> Tensor:
    """(B,) long: the number of response tokens in each sequence."""
    return batch.response_mask.sum(dim=1)


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
    return getattr(model, "module", model)


def _decoder_body(model):
    """The transformer body that returns ``last_hidden_state`` (final norm included) without the LM head.

    ``get_decoder()`` on a transformers causal LM returns the inner base model (``LlamaForCausalLM`` →
    ``LlamaModel``; for multimodal wrappers, the ``language_model``); ``model.model`` is the fallback for models that
    lack it.
    """
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    return model.model


def _chunk_logps(head, hidden: Tensor, targets: Tensor, softcap: float | None, temperature: float) -> Tensor:
    """Log-probs of ``targets`` (n,) under ``softmax(softcap(head(hidden)) / temperature)``, hidden (n, H)."""
    logits = head(hidden)  # (n, V) in the model's dtype
    # Upcast half precision to float32 for the softmax (float64 models stay float64).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        # Gemma-2: logits = cap * tanh(logits / cap) right after the LM head (Gemma2ForCausalLM.forward), i.e. before
        # any sampling temperature. Transformers applies it in the model dtype; we apply it after the upcast.
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    # log_softmax(x)[y] = x[y] - logsumexp(x), without allocating a second (n, V) tensor for the full log_softmax.
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logps(model, batch: Batch, temperature: float = 1.0, chunk_size: int = 4096) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of every response token in ``batch``.

    Runs the decoder body once over (B, T), keeps the hidden states at positions t whose next token (t + 1) is a
    response token, and applies the LM head only to those N rows, ``chunk_size`` rows at a time.

    Args:
        model: a causal LM (``get_decoder()`` or ``.model``, ``get_output_embeddings()``, optional
            ``config.final_logit_softcapping``), possibly wrapped by a DeepSpeed engine (``.module``).
        batch: from :func:`build_batch`, on the model's device.
        temperature: log-probs are of ``softmax(logits / temperature)``; use the sampling temperature to match REBEL.
        chunk_size: rows of the LM head computed at once; bounds logits memory at ``chunk_size × V``.

    Returns:
        ``(logps, seq_index)``: logps (N,) in float32 (float64 for a float64 model), ordered by sequence then position;
        seq_index (N,) long, the row of ``batch`` each log-prob belongs to. Differentiable when grad is enabled.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; greedy decoding has no log-probs to match")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    inner = _unwrap(model)
    body = _decoder_body(inner)
    head = inner.get_output_embeddings()
    softcap = getattr(getattr(inner, "config", None), "final_logit_softcapping", None)

    # use_cache=False: a training/scoring pass has no use for a KV cache, and building one wastes memory.
    out = body(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state  # (B, T, H)

    # Position t predicts token t + 1, so the rows we need are those whose *next* position holds a response token.
    predicts_response = batch.response_mask[:, 1:]  # (B, T-1)
    seq_index, pos = predicts_response.nonzero(as_tuple=True)  # (N,), (N,) sorted by sequence, then position
    targets = batch.input_ids[seq_index, pos + 1]  # (N,)
    rows = hidden[seq_index, pos]  # (N, H)

    checkpoint = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in head.parameters()))
    pieces = []
    for start in range(0, rows.shape[0], chunk_size):
        args = (head, rows[start : start + chunk_size], targets[start : start + chunk_size], softcap, temperature)
        if checkpoint:
            pieces.append(torch.utils.checkpoint.checkpoint(_chunk_logps, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logps(*args))
    if pieces:
        logps = torch.cat(pieces)
    else:  # every response is empty
        logps = rows.new_zeros((0,), dtype=torch.promote_types(rows.dtype, torch.float32))
    return logps, seq_index


def sequence_logps(model, batch: Batch, temperature: float = 1.0, chunk_size: int = 4096) -> Tensor:
    """(B,) sum of the response tokens' log-probs per sequence, float32 (float64 for a float64 model).

    This is REBEL's sequence log-prob: the sum over the response tokens, the final EOS included when it is part of
    the response. An empty response sums to 0.0.
    """
    logps, seq_index = token_logps(model, batch, temperature=temperature, chunk_size=chunk_size)
    totals = torch.zeros(batch.input_ids.shape[0], dtype=logps.dtype, device=logps.device)
    return totals.index_add(0, seq_index, logps)
