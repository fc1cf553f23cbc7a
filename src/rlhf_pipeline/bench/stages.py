"""Stage benchmarks: our filter, score and generate against the way REBEL's scripts do the same work.

Each comparison runs both sides on the same data, in the same process, alternating round by round
(:func:`rlhf_pipeline.bench.common.alternate`), and checks that they produce the same result before it reports a ratio:

* ``filter_vs_per_row``: ``rlhf filter`` (one batched ``datasets.map`` over the token ids the engine sampled) against
  :func:`rebel_filter_tokenize`, a line-by-line re-creation of REBEL's ``filter_tokenize.py`` (one ``dataset.filter``
  per condition that re-applies the chat template to every prompt and every response, Python loops that pick best and
  worst and tokenize prompt, chosen and rejected again, padded to the length limits, ten ``add_column`` calls and a
  last filter pass). Both must keep the same prompts with the same chosen/rejected texts, rewards and token ids.
* ``score_batched_vs_one_by_one``: ``rlhf score --reward-model`` (length-sorted batches) against :func:`rebel_rank`,
  REBEL's ``rank.py`` (per response: apply the chat template, one forward of batch 1, ``.item()``). Same model, same
  data; the rewards must agree to 1e-4.
* ``generate_one_call_vs_n_passes``: the hf engine sampling n responses per prompt in one request
  (``num_return_sequences=n``) against n passes of n=1 over the same prompts (:func:`generate_in_passes`, the shape of
  REBEL's ``generate.py``), same engine, model, prompt batch size and sampling settings.

Plus a record without a target: each stage's time at three data sizes and its growth exponent.

Everything runs offline on tiny models built here (:mod:`rlhf_pipeline.tiny`). Torch runs on one thread while these
benchmarks run (both sides alike; restored afterwards): on a shared 2-core machine a second OpenMP thread that waits
for a core another process holds made single forward passes tens to hundreds of times slower at random, which no
number of rounds averages out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import random
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rlhf_pipeline.bench.common import Entry, alternate, growth_exponent

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

    from rlhf_pipeline.engines import Completion, SamplingSettings

BENCH_TORCH_THREADS = 1
FILTER_TARGET = 10.0
SCORE_TARGET = 5.0  # on GPUs, where the forwards are cheap; a CPU's ceiling is below it (see bench_score)
# The least fraction of the forward-only ceiling `rlhf score` must reach, set from measurement on 2-core CPUs: the
# stage must also render, encode and load, CPU-bound work the ceiling leaves out, so it reaches at most about
# F / (F + 60 ms) for forwards of F seconds. The runs it was set from, and the code before that it marks as missed,
# are in docs/benchmarks.md ("The score stage against its ceiling").
SCORE_CEILING_TARGET = 0.77
SCORE_MIN_ROUNDS = 9  # unless --rounds says otherwise: the entry is cheap, and the fraction steadier over more rounds
GENERATE_TARGET = 2.0

# Length limits of the filter comparison, scaled to the synthetic data as REBEL's 1024/2048 are to UltraFeedback:
# a few prompts are too long, no response is (see synthetic_generations), so both sides' rules keep the same rows.
MAX_PROMPT_TOKENS = 64
MAX_RESPONSE_TOKENS = 128
RESPONSE_TOKENS_CAP = MAX_RESPONSE_TOKENS - 2  # content tokens; + EOS stays under the limit on both sides

SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 0}  # REBEL's generate.py and our defaults


@dataclass(frozen=True)
class Sizes:
    n: int  # responses per prompt everywhere
    filter_prompts: int
    score_prompts: int
    generate_prompts: int
    generate_max_new_tokens: int
    generate_batch_size: int
    scaling_prompts: tuple[int, ...]
    scaling_max_new_tokens: int


def sizes_for(quick: bool) -> Sizes:
    if quick:
        return Sizes(n=5, filter_prompts=5000, score_prompts=200, generate_prompts=32, generate_max_new_tokens=32,
                     generate_batch_size=16, scaling_prompts=(100, 200, 400), scaling_max_new_tokens=16)
    return Sizes(n=5, filter_prompts=20000, score_prompts=1000, generate_prompts=128, generate_max_new_tokens=32,
                 generate_batch_size=16, scaling_prompts=(250, 1000, 4000), scaling_max_new_tokens=16)


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(f"[bench stages] {text}", flush=True)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Swallow the stages' progress bars and one-line summaries; show them if the call fails."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            yield
    except BaseException:
        sys.stderr.write(buffer.getvalue()[-4000:])
        raise


def _quietly(fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        with quiet():
            return fn()

    return call


def _seed(seed: int = 0) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _fresh_dirs(root: Path, prefix: str) -> Callable[[], Path]:
    """A new, not yet existing output directory per call, so a stage never finds a finished output to reuse."""
    counter = itertools.count()

    def next_dir() -> Path:
        path = root / f"{prefix}_{next(counter)}"
        if path.exists():
            shutil.rmtree(path)
        return path

    return next_dir


def _write_manifest(path: Path, stage: str, rows: int, sampling: dict[str, Any] | None) -> None:
    """A minimal stage manifest, so the data looks to the next stage like a real upstream output (lineage)."""
    from rlhf_pipeline import __version__

    manifest = {"stage": stage, "version": __version__, "output_id": uuid.uuid4().hex, "config": {}, "inputs": [],
                "rows_in": rows, "rows_out": rows, "dropped": {}, "sampling": sampling, "synthetic": True}
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------------------------
# Synthetic data in the exact formats of our generate / score stages and of REBEL's scripts
# --------------------------------------------------------------------------------------------------------------------


def synthetic_generations(tokenizer, num_prompts: int, n: int, seed: int = 0, scored: bool = True) -> dict[str, list]:
    """Columns of our generations (``scored``: + ``rewards``) contract, built without a model.

    Prompts are the bundled prompts (cycled), half with a sentence of the bundled corpus appended; every 17th prompt
    gets four more sentences, so it exceeds ``MAX_PROMPT_TOKENS``. Responses are one to four corpus sentences
    (at most ``RESPONSE_TOKENS_CAP`` tokens); their token ids are the tokenizer's own encoding of the text plus EOS,
    except every 10th response, which ends without EOS (``finish_reasons`` ``length``). Rewards are Gaussian; every 19th
    prompt has all-equal rewards and every 23rd has its best response's text also at its worst one, so both
    preference-less cases that both filters drop occur.
    """
    from rlhf_pipeline.chat import encode_prompts
    from rlhf_pipeline.tiny import bundled_path

    rng = random.Random(seed)
    bundled = [json.loads(line) for line in bundled_path("prompts.jsonl").read_text().splitlines()]
    corpus = [line for line in bundled_path("tiny_corpus.txt").read_text().splitlines() if line.strip()]

    ids, prompts, labels = [], [], []
    for i in range(num_prompts):
        base = bundled[i % len(bundled)]
        text = base["prompt"]
        if i % 17 == 5:
            text += " " + " ".join(rng.sample(corpus, 4))
        elif rng.random() < 0.5:
            text += " " + rng.choice(corpus)
        ids.append(f"{base['id']}-{i}")
        prompts.append(text)
        labels.append(base["label"])

    texts = [[" ".join(rng.sample(corpus, rng.randint(1, 4))) for _ in range(n)] for _ in range(num_prompts)]
    flat = [t for row in texts for t in row]
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"]
    for k, token_ids in enumerate(encoded):  # keep every response under the cap: one sentence is always short enough
        if len(token_ids) > RESPONSE_TOKENS_CAP:
            flat[k] = flat[k].split(". ")[0]
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"]
    if max(len(x) for x in encoded) > RESPONSE_TOKENS_CAP:
        raise RuntimeError("synthetic response longer than the cap; shorten the corpus sentences")

    eos = tokenizer.eos_token_id
    responses, response_ids, finish, rewards = [], [], [], []
    it = iter(zip(flat, encoded))
    for i in range(num_prompts):
        row_texts, row_ids, row_finish = [], [], []
        for j in range(n):
            text, token_ids = next(it)
            stopped = (i * n + j) % 10 != 9
            row_texts.append(text)
            row_ids.append(list(token_ids) + ([eos] if stopped else []))
            row_finish.append("stop" if stopped else "length")
        row_rewards = [0.25] * n if i % 19 == 11 else [rng.gauss(0.0, 1.0) for _ in range(n)]
        if i % 23 == 13:
            best = max(range(n), key=lambda j: (row_rewards[j], -j))
            worst = min(range(n), key=lambda j: (row_rewards[j], j))
            row_texts[worst], row_ids[worst], row_finish[worst] = row_texts[best], row_ids[best], row_finish[best]
        responses.append(row_texts)
        response_ids.append(row_ids)
        finish.append(row_finish)
        rewards.append(row_rewards)

    columns = {
        "prompt_id": ids,
        "id": ids,
        "prompt": prompts,
        "label": labels,
        "prompt_token_ids": encode_prompts(tokenizer, prompts),
        "responses": responses,
        "response_token_ids": response_ids,
        "finish_reasons": finish,
    }
    if scored:
        columns["rewards"] = rewards
    return columns


def save_ours(columns: dict[str, list], path: Path, stage: str, sampling: dict[str, Any]) -> Path:
    """Write ``columns`` as our generate (or score) stage writes them: same features, plus a manifest."""
    from datasets import Dataset, Features, List, Value

    features = {
        "prompt_id": Value("string"),
        "id": Value("string"),
        "prompt": Value("string"),
        "label": Value("string"),
        "prompt_token_ids": List(Value("int32")),
        "responses": List(Value("string")),
        "response_token_ids": List(List(Value("int32"))),
        "finish_reasons": List(Value("string")),
    }
    if "rewards" in columns:
        features["rewards"] = List(Value("float64"))
    Dataset.from_dict(columns, features=Features(features)).save_to_disk(str(path))
    _write_manifest(path, stage, len(columns["prompt_id"]), sampling)
    return path


def save_rebel(columns: dict[str, list], path: Path) -> Path:
    """The same data as REBEL's scripts store it: ``prompt_id``, ``prompt``, ``response_{i}`` (generate.py) and
    ``response_{i}_reward`` (rank.py); no token ids."""
    from datasets import Dataset

    n = len(columns["responses"][0])
    data: dict[str, list] = {"prompt_id": columns["prompt_id"], "prompt": columns["prompt"]}
    for i in range(n):
        data[f"response_{i}"] = [r[i] for r in columns["responses"]]
    if "rewards" in columns:
        for i in range(n):
            data[f"response_{i}_reward"] = [float(r[i]) for r in columns["rewards"]]
    Dataset.from_dict(data).save_to_disk(str(path))
    return path


def sampling_record(tokenizer, n: int, max_new_tokens: int) -> dict[str, Any]:
    return {"n": n, **SAMPLING, "max_new_tokens": max_new_tokens, "seed": 0,
            "stop_token_ids": [tokenizer.eos_token_id], "model": "tiny", "engine": "hf", "use_chat_template": True}


# --------------------------------------------------------------------------------------------------------------------
# The peers: REBEL's scripts, re-created on local data and the tiny models
# --------------------------------------------------------------------------------------------------------------------


def _rebel_message(instruction: str | None = None, response: str | None = None) -> list[dict[str, str]]:
    """``get_message`` of REBEL's scripts."""
    if response is None:
        return [{"role": "user", "content": instruction}]
    if instruction is None:
        return [{"role": "assistant", "content": response}]
    return [{"role": "user", "content": instruction}, {"role": "assistant", "content": response}]


def assistant_header_length(tokenizer) -> int:
    """Tokens the chat template puts before an assistant turn's content. REBEL hard-codes Llama-3's 5
    (``<|begin_of_text|><|start_header_id|>assistant<|end_header_id|>\\n\\n``); the tiny template's is 2."""
    ids = tokenizer.apply_chat_template(_rebel_message(response="x"), tokenize=True)["input_ids"]
    content = tokenizer("x", add_special_tokens=False)["input_ids"]
    for start in range(len(ids)):
        if ids[start : start + len(content)] == content:
            return start
    raise ValueError("cannot find an assistant turn's content in the chat template's output")


def rebel_filter_tokenize(
    input_dir: str | Path,
    output_dir: str | Path,
    tokenizer_path: str | Path,
    *,
    maxlen: int,
    maxlen_prompt: int,
    pairs: int,
    test_size: int | float,
    seed: int = 0,
) -> DatasetDict:
    """REBEL's ``src/ultrafeedback_largebatch/filter_tokenize.py``, statement by statement, on a local dataset.

    Adaptations, none of which changes the amount of work: ``load_from_disk``/``save_to_disk`` instead of the Hub;
    the tiny tokenizer's own pad token instead of an added ``[PAD]``; its 2-token assistant header and its special-token
    ids in the asserts instead of Llama-3's 5 tokens and hard-coded ids; ``["input_ids"]`` because transformers 5's
    ``apply_chat_template`` returns a dict; a seed for the split (REBEL's has none).
    """
    import numpy as np
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    tokenizer_left = AutoTokenizer.from_pretrained(str(tokenizer_path), padding_side="left")
    header = assistant_header_length(tokenizer)
    prompt_end = tokenizer.apply_chat_template(  # the last token of every templated prompt (Llama-3: "\n\n", 271)
        _rebel_message("x"), add_generation_prompt=True, tokenize=True
    )["input_ids"][-1]
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id

    dataset = load_from_disk(str(input_dir))

    # filter dataset with long prompt or response: one pass per condition, each re-applying the template
    dataset = dataset.filter(
        lambda row: tokenizer.apply_chat_template(
            _rebel_message(row["prompt"]), tokenize=True, add_generation_prompt=True, return_tensors="pt"
        )["input_ids"].shape[-1]
        <= maxlen_prompt
    )
    for i in range(pairs):
        dataset = dataset.filter(
            lambda row: tokenizer.apply_chat_template(
                _rebel_message(response=row[f"response_{i}"]),
                tokenize=True,
                add_generation_prompt=False,
                return_tensors="pt",
            )["input_ids"][:, header:].shape[-1]
            <= maxlen
        )

    # add prompt tokens
    llama_prompts, llama_prompt_tokens = [], []
    for row in dataset:
        llama_prompt_token = tokenizer_left.apply_chat_template(
            _rebel_message(row["prompt"]),
            add_generation_prompt=True,
            tokenize=True,
            padding="max_length",
            max_length=maxlen_prompt,
        )["input_ids"]
        llama_prompt = tokenizer_left.decode(llama_prompt_token, skip_special_tokens=False)
        assert len(llama_prompt_token) == maxlen_prompt
        assert llama_prompt_token[0] in (bos, pad) and llama_prompt_token[-1] == prompt_end
        llama_prompts.append(llama_prompt)
        llama_prompt_tokens.append(llama_prompt_token)
    dataset = dataset.add_column("llama_prompt", llama_prompts)
    dataset = dataset.add_column("llama_prompt_tokens", llama_prompt_tokens)

    # select chosen and reject
    chosen, reject, llama_chosen, llama_reject = [], [], [], []
    llama_chosen_tokens, llama_reject_tokens, chosen_reward, reject_reward = [], [], [], []
    for row in dataset:
        all_rewards = [row[f"response_{i}_reward"] for i in range(pairs)]
        chosen_idx, reject_idx = np.argmax(all_rewards), np.argmin(all_rewards)

        chosen.append(row[f"response_{chosen_idx}"])
        reject.append(row[f"response_{reject_idx}"])

        llama_chosen_token = tokenizer.apply_chat_template(
            _rebel_message(response=row[f"response_{chosen_idx}"]),
            add_generation_prompt=False,
            tokenize=True,
            padding="max_length",
            max_length=maxlen + header,
        )["input_ids"][header:]
        llama_chosen_tokens.append(llama_chosen_token)
        llama_chosen.append(tokenizer.decode(llama_chosen_token, skip_special_tokens=False))
        chosen_reward.append(row[f"response_{chosen_idx}_reward"])
        assert len(llama_chosen_token) == maxlen
        assert llama_chosen_token[-1] in (eos, pad)

        llama_reject_token = tokenizer.apply_chat_template(
            _rebel_message(response=row[f"response_{reject_idx}"]),
            add_generation_prompt=False,
            tokenize=True,
            padding="max_length",
            max_length=maxlen + header,
        )["input_ids"][header:]
        llama_reject_tokens.append(llama_reject_token)
        llama_reject.append(tokenizer.decode(llama_reject_token, skip_special_tokens=False))
        reject_reward.append(row[f"response_{reject_idx}_reward"])
        assert len(llama_reject_token) == maxlen
        assert llama_reject_token[-1] in (eos, pad)

    dataset = dataset.add_column("chosen", chosen)
    dataset = dataset.add_column("chosen_reward", chosen_reward)
    dataset = dataset.add_column("llama_chosen", llama_chosen)
    dataset = dataset.add_column("llama_chosen_tokens", llama_chosen_tokens)
    dataset = dataset.add_column("reject", reject)
    dataset = dataset.add_column("reject_reward", reject_reward)
    dataset = dataset.add_column("llama_reject", llama_reject)
    dataset = dataset.add_column("llama_reject_tokens", llama_reject_tokens)

    # filter prompts with exactly same responses
    dataset = dataset.filter(lambda row: row["chosen"] != row["reject"])

    dataset = dataset.train_test_split(test_size=test_size, shuffle=True, seed=seed)
    dataset.save_to_disk(str(output_dir))
    return dataset


def rebel_rank(
    input_dir: str | Path, output_dir: str | Path, reward_model: str | Path, *, pairs: int, max_length: int = 4096
) -> Dataset:
    """REBEL's ``src/ultrafeedback_largebatch/rank.py`` (``ArmoRMPipeline``) on a local dataset: for each of the
    ``pairs`` responses, for each row, apply the reward model's chat template (``truncation=True``), one forward of
    batch 1 and ``.item()``; one ``add_column`` per response. Adaptations: local load/save; the reward is read from
    ``.logits`` (the tiny reward model has no ArmoRM ``.score``); the dtype our score stage uses on this device
    (float32 on a CPU; REBEL loads bfloat16 on a GPU)."""
    from datasets import load_from_disk
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_pipeline.modeling import SAFE_WEIGHTS, default_device, resolve_dtype

    device = default_device()
    model = AutoModelForSequenceClassification.from_pretrained(
        str(reward_model), dtype=resolve_dtype("auto", device), **SAFE_WEIGHTS
    ).to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(reward_model), use_fast=True)

    dataset = load_from_disk(str(input_dir))
    rewards: dict[str, list[float]] = {}
    for i in range(pairs):
        rewards[f"response_{i}_reward"] = [
            rebel_score_one(model, tokenizer, row["prompt"], row[f"response_{i}"], device, max_length)
            for row in dataset
        ]
    for k, v in rewards.items():
        dataset = dataset.add_column(k, v)
    dataset.save_to_disk(str(output_dir))
    return dataset


def rebel_score_one(model, tokenizer, prompt: str, response: str, device, max_length: int = 4096) -> float:
    """One response as ``rank.py`` scores it: apply the chat template (``truncation=True``), one forward of batch 1,
    ``.item()`` of the logits (ArmoRM's ``.score`` in REBEL; the tiny reward models have only ``.logits``)."""
    import torch

    input_ids = tokenizer.apply_chat_template(
        _rebel_message(prompt, response),
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=max_length,
    )["input_ids"].to(device)
    with torch.no_grad():
        return model(input_ids).logits.float().item()


def generate_in_passes(
    engine, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings
) -> list[Completion]:
    """``sampling.n`` responses per prompt as REBEL's ``generate.py`` gets them: ``n`` passes over all prompts with
    one sample each, pass ``p`` seeded ``p * 50`` (each prompt's seed in the pass derived from it and the prompt's own
    seed, as engines draw from request seeds); the passes' samples are then put side by side per prompt."""
    from rlhf_pipeline.engines import Completion
    from rlhf_pipeline.sharding import request_seed

    passes = [
        engine.generate(prompts, [request_seed(p * 50, s) for s in seeds],
                        dataclasses.replace(sampling, n=1, seed=p * 50))
        for p in range(sampling.n)
    ]
    return [
        Completion(
            texts=[c.texts[0] for c in per_prompt],
            token_ids=[c.token_ids[0] for c in per_prompt],
            finish_reasons=[c.finish_reasons[0] for c in per_prompt],
        )
        for per_prompt in zip(*passes)
    ]


# --------------------------------------------------------------------------------------------------------------------
# Same-result checks (they raise, so a benchmark whose sides diverge fails loudly instead of reporting a ratio)
# --------------------------------------------------------------------------------------------------------------------


def _fail(message: str) -> None:
    raise AssertionError(f"benchmark sides disagree: {message}")


def compare_pairs(ours: DatasetDict, peer: DatasetDict, eos_id: int, pad_id: int) -> int:
    """Check that our filter output and REBEL's hold the same pairs; returns how many pairs were compared.

    Same prompts kept, same split sizes, and per prompt the same chosen/rejected texts and rewards. Token ids too:
    REBEL's padded re-tokenization, with the padding stripped, must equal the ids we keep (a response that ended
    without EOS gets one from REBEL's chat template, so that one is compared with EOS appended)."""
    if sorted(ours) != ["test", "train"] or sorted(peer) != ["test", "train"]:
        _fail(f"splits {sorted(ours)} vs {sorted(peer)}")
    if ours["test"].num_rows != peer["test"].num_rows:
        _fail(f"test split {ours['test'].num_rows} rows (ours) vs {peer['test'].num_rows} (peer)")
    mine: dict[str, dict[str, Any]] = {}
    for split in ours.values():
        cols = split.select_columns(
            ["prompt_id", "prompt_token_ids", "chosen", "rejected", "chosen_reward", "rejected_reward",
             "chosen_token_ids", "rejected_token_ids"]
        ).to_dict()
        for k, pid in enumerate(cols["prompt_id"]):
            mine[pid] = {c: v[k] for c, v in cols.items()}
    theirs: dict[str, dict[str, Any]] = {}
    for split in peer.values():
        cols = split.select_columns(
            ["prompt_id", "llama_prompt_tokens", "chosen", "reject", "chosen_reward", "reject_reward",
             "llama_chosen_tokens", "llama_reject_tokens"]
        ).to_dict()
        for k, pid in enumerate(cols["prompt_id"]):
            theirs[pid] = {c: v[k] for c, v in cols.items()}
    if set(mine) != set(theirs):
        only_ours, only_peer = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        _fail(f"kept prompts differ: only ours {only_ours[:5]} ({len(only_ours)}), only peer {only_peer[:5]} "
              f"({len(only_peer)})")

    def with_eos(ids: list[int]) -> list[int]:
        return list(ids) if ids and ids[-1] == eos_id else list(ids) + [eos_id]

    def strip_right(ids: list[int]) -> list[int]:
        end = len(ids)
        while end and ids[end - 1] == pad_id:
            end -= 1
        return list(ids[:end])

    def strip_left(ids: list[int]) -> list[int]:
        start = 0
        while start < len(ids) and ids[start] == pad_id:
            start += 1
        return list(ids[start:])

    for pid, a in mine.items():
        b = theirs[pid]
        if (a["chosen"], a["rejected"]) != (b["chosen"], b["reject"]):
            _fail(f"prompt {pid}: chosen/rejected texts differ")
        if (a["chosen_reward"], a["rejected_reward"]) != (b["chosen_reward"], b["reject_reward"]):
            _fail(f"prompt {pid}: rewards ({a['chosen_reward']}, {a['rejected_reward']}) vs "
                  f"({b['chosen_reward']}, {b['reject_reward']})")
        if with_eos(a["chosen_token_ids"]) != strip_right(b["llama_chosen_tokens"]):
            _fail(f"prompt {pid}: chosen token ids differ")
        if with_eos(a["rejected_token_ids"]) != strip_right(b["llama_reject_tokens"]):
            _fail(f"prompt {pid}: rejected token ids differ")
        if list(a["prompt_token_ids"]) != strip_left(b["llama_prompt_tokens"]):
            _fail(f"prompt {pid}: prompt token ids differ")
    return len(mine)


def compare_scores(ours: Dataset, peer: Dataset, n: int, tolerance: float = 1e-4) -> float:
    """Check that our batched rewards and the one-by-one rewards agree; returns the largest difference."""
    import numpy as np

    if ours["prompt_id"] != peer["prompt_id"]:
        _fail("rows are not in the same order")
    a = np.asarray(ours["rewards"], dtype=np.float64)
    b = np.stack([np.asarray(peer[f"response_{i}_reward"], dtype=np.float64) for i in range(n)], axis=1)
    if a.shape != b.shape:
        _fail(f"reward shapes {a.shape} vs {b.shape}")
    if not np.allclose(a, b, rtol=tolerance, atol=tolerance):
        worst = np.unravel_index(np.argmax(np.abs(a - b)), a.shape)
        _fail(f"rewards differ by up to {np.abs(a - b).max():.2e} (row {worst[0]}, response {worst[1]})")
    return float(np.abs(a - b).max())


def check_completions(completions: list[Completion], num_prompts: int, sampling: SamplingSettings) -> int:
    """n samples per prompt, none longer than ``max_new_tokens``; returns the number of sampled tokens."""
    if len(completions) != num_prompts:
        _fail(f"{len(completions)} completions for {num_prompts} prompts")
    tokens = 0
    for c in completions:
        if not (len(c.texts) == len(c.token_ids) == len(c.finish_reasons) == sampling.n):
            _fail(f"a prompt got {len(c.token_ids)} samples instead of {sampling.n}")
        for ids in c.token_ids:
            if len(ids) > sampling.max_new_tokens:
                _fail(f"a sample of {len(ids)} tokens exceeds max_new_tokens {sampling.max_new_tokens}")
            tokens += len(ids)
    return tokens


# --------------------------------------------------------------------------------------------------------------------
# The benchmarks
# --------------------------------------------------------------------------------------------------------------------


def _round_list(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]


def bench_filter(workdir: Path, policy: Path, sizes: Sizes, rounds: int) -> Entry:
    from datasets import load_from_disk

    from rlhf_pipeline.chat import load_tokenizer
    from rlhf_pipeline.stages.filter import FilterConfig
    from rlhf_pipeline.stages.filter import main as filter_main

    _seed(0)
    workdir.mkdir(parents=True, exist_ok=True)
    n, num_prompts = sizes.n, sizes.filter_prompts
    test_size = max(1, num_prompts // 10)
    tokenizer = load_tokenizer(str(policy))
    columns = synthetic_generations(tokenizer, num_prompts, n, seed=0)
    with quiet():
        ours_input = save_ours(columns, workdir / "filter_input", "score", sampling_record(tokenizer, n, 128))
        peer_input = save_rebel(columns, workdir / "filter_input_rebel")
    ours_out, peer_out = _fresh_dirs(workdir, "filter_ours"), _fresh_dirs(workdir, "filter_peer")

    def ours() -> Path:
        out = ours_out()
        return filter_main(FilterConfig(input=str(ours_input), output=str(out), tokenizer=str(policy),
                                        max_prompt_tokens=MAX_PROMPT_TOKENS, max_response_tokens=MAX_RESPONSE_TOKENS,
                                        test_size=test_size, seed=0))

    def peer() -> DatasetDict:
        return rebel_filter_tokenize(peer_input, peer_out(), policy, maxlen=MAX_RESPONSE_TOKENS,
                                     maxlen_prompt=MAX_PROMPT_TOKENS, pairs=n, test_size=test_size, seed=0)

    _say(f"filter_vs_per_row: {num_prompts} prompts x {n} responses, {rounds} rounds")
    result = alternate(_quietly(ours), _quietly(peer), rounds)
    ours_path = result["ours_value"]
    manifest = json.loads((ours_path / "manifest.json").read_text())
    pairs = compare_pairs(load_from_disk(str(ours_path)), result["peer_value"], tokenizer.eos_token_id,
                          tokenizer.pad_token_id)
    return Entry(
        name="filter_vs_per_row",
        ours=result["ours_median"],
        peer=result["peer_median"],
        unit="s",
        ratio=result["ratio"],
        target=FILTER_TARGET,
        notes=(
            f"{num_prompts:,} scored prompts x {n} responses (synthetic, tiny tokenizer, {MAX_PROMPT_TOKENS}/"
            f"{MAX_RESPONSE_TOKENS}-token prompt/response limits, test split {test_size}); median of {rounds} "
            "alternating rounds after a warm-up, each side loading its input from disk and saving train/test to a "
            "new directory. Ours: `rlhf filter` (one batched `datasets.map` that reads lengths off the stored token "
            "ids, best/worst per prompt, a seeded split). Peer: REBEL's `filter_tokenize.py` re-created statement "
            "by statement on the same data in REBEL's column layout (texts and rewards, no token ids): "
            f"{1 + n} single-process `dataset.filter` passes "
            "that apply the chat template to every prompt and then to every response, one per pass; a Python loop "
            "over the rows that templates and left-pads each prompt again; a second loop that picks best/worst with "
            "argmax/argmin and templates, pads and decodes chosen and rejected again; ten `add_column` calls; a "
            "last filter pass for chosen == rejected. Both keep the same "
            f"{pairs:,} pairs (texts, rewards and token ids checked). Torch on {BENCH_TORCH_THREADS} thread."
        ),
        details={
            "prompts": num_prompts, "responses_per_prompt": n, "pairs_kept": pairs,
            "dropped_by_ours": manifest.get("dropped"), "rounds": rounds,
            "ours_seconds": _round_list(result["ours_seconds"]), "peer_seconds": _round_list(result["peer_seconds"]),
            "torch_threads": BENCH_TORCH_THREADS,
        },
    )


def bench_score(workdir: Path, reward_model: Path, sizes: Sizes, rounds: int) -> Entry:
    from datasets import load_from_disk

    from rlhf_pipeline.chat import load_tokenizer
    from rlhf_pipeline.stages.score import ScoreConfig
    from rlhf_pipeline.stages.score import main as score_main

    _seed(0)
    workdir.mkdir(parents=True, exist_ok=True)
    n, num_prompts = sizes.n, sizes.score_prompts
    tokenizer = load_tokenizer(str(reward_model))  # same tiny tokenizer as the policy's
    columns = synthetic_generations(tokenizer, num_prompts, n, seed=1, scored=False)
    with quiet():
        ours_input = save_ours(columns, workdir / "score_input", "generate", sampling_record(tokenizer, n, 128))
        peer_input = save_rebel(columns, workdir / "score_input_rebel")
    ours_out, peer_out = _fresh_dirs(workdir, "score_ours"), _fresh_dirs(workdir, "score_peer")
    batch_size = ScoreConfig.__dataclass_fields__["batch_size"].default

    def ours() -> Path:
        return score_main(ScoreConfig(input=str(ours_input), output=str(ours_out()), reward_model=str(reward_model)))

    def peer() -> Dataset:
        return rebel_rank(peer_input, peer_out(), reward_model, pairs=n)

    batched, one_by_one = forward_only(reward_model, columns, n)
    _say(f"score_batched_vs_one_by_one: {num_prompts} prompts x {n} responses, {rounds} rounds")
    # The ceiling's forwards are timed in the same rounds as both sides, so that the fraction of it we reach
    # compares times taken within seconds of each other, not a stage run and a ceiling measured a minute apart.
    result = alternate(_quietly(ours), _quietly(peer), rounds, also={"forwards": _quietly(batched)})
    max_diff = compare_scores(load_from_disk(str(result["ours_value"])), result["peer_value"], n)
    sequences = num_prompts * n
    # Context only (how much batching saves the forwards alone), so fewer rounds
    context = alternate(_quietly(batched), _quietly(one_by_one), min(rounds, 3))
    ceiling = {
        "batched_seconds": round(result["forwards_median"], 4),
        "batched_seconds_per_round": _round_list(result["forwards_seconds"]),
        "one_by_one_seconds": round(context["peer_median"], 4),
        "forward_ratio": round(context["ratio"], 3),
        "ceiling_ratio": round(result["peer_median"] / result["forwards_median"], 3),
        "fraction_per_round": [round(f / o, 3) for f, o in zip(result["forwards_seconds"], result["ours_seconds"])],
    }
    return Entry(
        name="score_batched_vs_one_by_one",
        ours=result["ours_median"],
        peer=result["peer_median"],
        unit="s",
        ratio=result["ratio"],
        target=SCORE_TARGET,
        ceiling=ceiling["ceiling_ratio"],
        ceiling_target=SCORE_CEILING_TARGET,
        notes=(
            f"{num_prompts:,} prompts x {n} responses = {sequences:,} sequences, the tiny reward model "
            f"(random-initialised Llama classifier, float32, CPU); median of {rounds} alternating rounds after a "
            "warm-up, each side loading the model and the data and saving the scored data. Ours: `rlhf score "
            f"--reward-model` (whole conversations rendered and encoded in chunks over threads while the model loads, sorted by length, batches of {batch_size}). "
            "Peer: REBEL's `rank.py` re-created: for each response index, for each row, `apply_chat_template` with "
            "`truncation=True`, one forward of batch 1, `.item()`; one `add_column` per response index. Rewards agree "
            f"to {max_diff:.1e} (checked: 1e-4). Torch on {BENCH_TORCH_THREADS} thread. Ceiling on this machine: the "
            f"model's forward passes alone, on the same token ids, take {ceiling['batched_seconds']:.3f} s in our "
            "batches (timed in the same rounds as both sides) and "
            f"{ceiling['one_by_one_seconds']:.3f} s one by one ({ceiling['forward_ratio']:.2f}x); with every "
            "other cost of ours at zero (templating, data I/O, model loading), the peer's whole run over our "
            f"forwards would be {ceiling['ceiling_ratio']:.2f}. On a CPU the tiny model's arithmetic is most of the "
            "peer's time and batching removes only per-call overhead; the forwards are float32 matmuls at the "
            "same FLOPs on both sides."
        ),
        details={
            "prompts": num_prompts, "responses_per_prompt": n, "sequences": sequences, "batch_size": batch_size,
            "max_abs_reward_difference": max_diff, "rounds": rounds, "forward_only": ceiling,
            "ours_seconds": _round_list(result["ours_seconds"]), "peer_seconds": _round_list(result["peer_seconds"]),
            "ours_sequences_per_s": round(sequences / result["ours_median"], 1),
            "peer_sequences_per_s": round(sequences / result["peer_median"], 1),
            "torch_threads": BENCH_TORCH_THREADS,
        },
    )


def forward_only(reward_model: Path, columns: dict[str, list], n: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The two sides of the best ratio batching can give on this machine, on the same token ids as the benchmark's
    (templating, data I/O and model loading left out): our scorer's batched forwards, and the peer's ``n x rows``
    forwards of batch 1. Our score stage cannot beat the peer by more than peer total / our forwards."""
    import torch

    from rlhf_pipeline.rewards import RewardModelScorer

    with quiet():
        scorer = RewardModelScorer(str(reward_model))
        prompts = [p for p in columns["prompt"] for _ in range(n)]
        ids = scorer.encode(prompts, [r for rs in columns["responses"] for r in rs])
        model = scorer.model

    def one_by_one() -> None:
        with torch.no_grad():
            for seq in ids:
                model(input_ids=torch.tensor([seq])).logits.float().item()

    return (lambda: scorer.score_ids(ids)), one_by_one


def bench_generate(workdir: Path, policy: Path, sizes: Sizes, rounds: int) -> Entry:
    from rlhf_pipeline.chat import encode_prompts, load_tokenizer, stop_token_ids
    from rlhf_pipeline.engines import SamplingSettings
    from rlhf_pipeline.engines.hf import HFEngine
    from rlhf_pipeline.sharding import request_seed
    from rlhf_pipeline.tiny import bundled_path

    _seed(0)
    workdir.mkdir(parents=True, exist_ok=True)
    n, num_prompts, batch_size = sizes.n, sizes.generate_prompts, sizes.generate_batch_size
    tokenizer = load_tokenizer(str(policy))
    bundled = [json.loads(line)["prompt"] for line in bundled_path("prompts.jsonl").read_text().splitlines()]
    prompts = encode_prompts(tokenizer, [bundled[i % len(bundled)] for i in range(num_prompts)])
    seeds = [request_seed(0, row) for row in range(num_prompts)]
    with quiet():
        engine = HFEngine(str(policy), tokenizer, batch_size=batch_size)
    stops = tuple(stop_token_ids(tokenizer, str(policy)))
    sampling = SamplingSettings(n=n, max_new_tokens=sizes.generate_max_new_tokens, seed=0, stop_token_ids=stops,
                                **SAMPLING)

    _say(f"generate_one_call_vs_n_passes: {num_prompts} prompts x {n} samples x {sampling.max_new_tokens} tokens, "
         f"{rounds} rounds")
    result = alternate(_quietly(lambda: engine.generate(prompts, seeds, sampling)),
                       _quietly(lambda: generate_in_passes(engine, prompts, seeds, sampling)), rounds)
    ours_tokens = check_completions(result["ours_value"], num_prompts, sampling)
    peer_tokens = check_completions(result["peer_value"], num_prompts, sampling)

    # Context, not the target: the same comparison without top-p, whose full-vocabulary sort per sampled sequence
    # and step costs both sides the same and dominates a tiny model's decode step on a CPU.
    plain = dataclasses.replace(sampling, top_p=1.0)
    no_top_p = alternate(_quietly(lambda: engine.generate(prompts, seeds, plain)),
                         _quietly(lambda: generate_in_passes(engine, prompts, seeds, plain)), 1, warmup=False)
    return Entry(
        name="generate_one_call_vs_n_passes",
        ours=result["ours_median"],
        peer=result["peer_median"],
        unit="s",
        ratio=result["ratio"],
        target=GENERATE_TARGET,
        notes=(
            f"{num_prompts} prompts x {n} samples of at most {sampling.max_new_tokens} new tokens, temperature "
            f"{sampling.temperature}, top-p {sampling.top_p} (REBEL's settings), tiny random-initialised policy, hf "
            f"engine, {batch_size} prompts per `generate` call on both sides; median of {rounds} alternating rounds "
            f"after a warm-up, model loaded once outside the timing. Ours: one request per prompt batch with n={n} "
            f"(`num_return_sequences`, {batch_size * n} sequences per decode step). Peer: REBEL's `generate.py` "
            f"shape, {n} passes over all prompts with n=1, pass p seeded p*50 ({batch_size} sequences per step, "
            f"{n}x the decode steps). Our hf engine also prefills each prompt once for its n samples (vLLM shares the "
            "prefill the same way), so the gain is from fewer, fuller decode steps and one prefill per prompt. "
            f"Without top-p (context only, 1 round): ratio {no_top_p['ratio']:.2f}. Torch on "
            f"{BENCH_TORCH_THREADS} thread."
        ),
        details={
            "prompts": num_prompts, "samples_per_prompt": n, "max_new_tokens": sampling.max_new_tokens,
            "prompt_batch_size": batch_size, "rounds": rounds,
            "ours_seconds": _round_list(result["ours_seconds"]), "peer_seconds": _round_list(result["peer_seconds"]),
            "ours_tokens": ours_tokens, "peer_tokens": peer_tokens,
            "ours_tokens_per_s": round(ours_tokens / result["ours_median"], 1),
            "peer_tokens_per_s": round(peer_tokens / result["peer_median"], 1),
            "without_top_p": {"ours_seconds": _round_list(no_top_p["ours_seconds"]),
                              "peer_seconds": _round_list(no_top_p["peer_seconds"]),
                              "ratio": round(no_top_p["ratio"], 3)},
            "torch_threads": BENCH_TORCH_THREADS,
        },
    )


SCALING_STAGES = ("generate", "score", "filter", "ref-logps")


def scaling_record(workdir: Path, policy: Path, reward_model: Path, sizes: Sizes) -> tuple[dict[str, Any], dict]:
    """Each stage's wall time at each data size, run as a user runs them (in-process ``main``), one run each."""
    from rlhf_pipeline.stages.filter import FilterConfig
    from rlhf_pipeline.stages.filter import main as filter_main
    from rlhf_pipeline.stages.generate import GenerateConfig
    from rlhf_pipeline.stages.generate import main as generate_main
    from rlhf_pipeline.stages.ref_logps import RefLogpsConfig
    from rlhf_pipeline.stages.ref_logps import main as ref_logps_main
    from rlhf_pipeline.stages.score import ScoreConfig
    from rlhf_pipeline.stages.score import main as score_main
    from rlhf_pipeline.tiny import bundled_path

    _seed(0)
    workdir.mkdir(parents=True, exist_ok=True)
    bundled = [json.loads(line) for line in bundled_path("prompts.jsonl").read_text().splitlines()]
    largest = max(sizes.scaling_prompts)
    prompts_file = workdir / "scaling_prompts.jsonl"
    prompts_file.write_text("".join(
        json.dumps({**bundled[i % len(bundled)], "id": f"{bundled[i % len(bundled)]['id']}-{i}"}) + "\n"
        for i in range(largest)
    ))
    seconds: dict[str, list[float]] = {stage: [] for stage in SCALING_STAGES}
    rows: dict[str, list[int]] = {"pairs": []}
    for size in sizes.scaling_prompts:
        _say(f"stage time against data size: {size} prompts")
        d = workdir / f"scaling_{size}"
        configs: list[tuple[str, Callable[[Any], Path], Any]] = [
            ("generate", generate_main, GenerateConfig(
                model=str(policy), prompts=str(prompts_file), output=str(d / "generate"), n=sizes.n,
                max_new_tokens=sizes.scaling_max_new_tokens, engine="hf", limit=size, seed=0)),
            ("score", score_main, ScoreConfig(input=str(d / "generate"), output=str(d / "score"),
                                              reward_model=str(reward_model))),
            ("filter", filter_main, FilterConfig(input=str(d / "score"), output=str(d / "filter"),
                                                 tokenizer=str(policy), test_size=0.1)),
            ("ref-logps", ref_logps_main, RefLogpsConfig(model=str(policy), input=str(d / "filter"),
                                                         output=str(d / "ref_logps"))),
        ]
        for stage, main_fn, cfg in configs:
            t0 = time.perf_counter()
            with quiet():
                main_fn(cfg)
            seconds[stage].append(time.perf_counter() - t0)
        rows["pairs"].append(sum(json.loads((d / "filter" / "manifest.json").read_text())["rows_out"].values()))

    exponents = {stage: growth_exponent(list(sizes.scaling_prompts), seconds[stage]) for stage in SCALING_STAGES}
    header = "| stage | " + " | ".join(f"{s:,} prompts" for s in sizes.scaling_prompts) + " | growth exponent |"
    lines = [header, "|---" * (len(sizes.scaling_prompts) + 2) + "|"]
    for stage in SCALING_STAGES:
        cells = " | ".join(f"{t:.2f} s" for t in seconds[stage])
        lines.append(f"| `{stage}` | {cells} | {exponents[stage]:.2f} |")
    markdown = "\n".join(lines) + (
        f"\n\nOne run of each stage per size, in one process (`main(config)`, as `rlhf <stage>` runs it), model "
        f"loading and dataset I/O included: generate with the hf engine, n={sizes.n}, "
        f"{sizes.scaling_max_new_tokens} new tokens, tiny random-initialised policy; score with the tiny reward "
        f"model; filter to pairs (test split 10%: {', '.join(f'{p:,}' for p in rows['pairs'])} pairs); ref-logps "
        "with the policy. The growth exponent is the least-squares slope of log(seconds) against log(prompts): 1 is "
        "linear; below 1, fixed costs (imports, model loading) still matter at these sizes. Torch on "
        f"{BENCH_TORCH_THREADS} thread; the machine is shared, so single runs are noisy."
    )
    record = {"title": "Stage time against data size", "markdown": markdown}
    data = {"prompts": list(sizes.scaling_prompts), "seconds": seconds, "exponents": exponents, **rows}
    return record, data


def build_models(workdir: Path) -> tuple[Path, Path]:
    from rlhf_pipeline.tiny import save_tiny_model

    with quiet():
        policy = save_tiny_model(workdir / "models" / "policy", kind="policy", seed=0)
        reward_model = save_tiny_model(workdir / "models" / "reward", kind="reward", seed=1)
    return policy, reward_model


def run(config, workdir: Path) -> tuple[list[Entry], list[dict[str, Any]]]:
    """The stage benchmarks of ``rlhf bench``: three side-by-side entries and the data-size record."""
    import datasets
    import torch

    workdir = Path(workdir)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    sizes = sizes_for(config.quick)
    rounds = config.num_rounds
    datasets.disable_caching()  # as every stage does on load; the peers get the same in-memory transforms
    threads = torch.get_num_threads()
    torch.set_num_threads(BENCH_TORCH_THREADS)
    started = time.perf_counter()
    try:
        policy, reward_model = build_models(workdir)
        entries = [
            bench_filter(workdir / "filter", policy, sizes, rounds),
            # --rounds as given, else at least SCORE_MIN_ROUNDS: the ceiling fraction it is judged on needs them
            bench_score(workdir / "score", reward_model, sizes,
                        rounds if config.rounds is not None else max(rounds, SCORE_MIN_ROUNDS)),
            bench_generate(workdir / "generate", policy, sizes, rounds),
        ]
        record, _ = scaling_record(workdir / "scaling", policy, reward_model, sizes)
    finally:
        torch.set_num_threads(threads)
    _say(f"done in {time.perf_counter() - started:.0f} s")
    return entries, [record]
