"""The demo's third bundled task (``rlhf demo --task first_word``): start the answer with the word the prompt names,
rewarded by a python function, with no reward model.

A prompt names a word and asks for an answer that begins with it ("Start your answer with the word great."). The
words (:data:`WORDS`) and the answers' other words are the review task's adjectives and nouns, so the tiny
tokenizer knows every one. The gold reward reads only where the word is,

    gold = 1 if the answer's first word is the prompt's word, 0 if the word comes later, -1 if it is missing,

a verifiable format constraint, unlike the review task's sentiment (a learned reward model) and the topics task's
count of right things: what is right is a position, and it depends on the prompt (the word must be copied from it).
Every iteration trains on this python reward directly (no reward model); the evaluation uses the same function.

The SFT demonstrations are two to four words and a period; the prompt's word comes first with a probability drawn
from {0, 1/4, 1/2, 3/4, 1}, else later or not at all (even odds), so the warm-started policy follows the constraint
some of the time. Prompts are split by phrasing, as the topics task's: the training prompts are the first six
phrasings of every word, the held-out prompts the last two, which no training stage sees (each prompt sixteen times,
with ids of their own: 480 and 160). There are five words: with twenty, the tiny SFT policy wrote the prompt's word
in 5% of its answers (gold -0.894), too rarely for three iterations to learn from.

Everything here is deterministic given a seed, and pure Python (no torch).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from rlhf_pipeline.demo.task import NEGATIVE, NOUNS, POSITIVE, write_task_files
from rlhf_pipeline.demo.topics import RIGHT_SHARES

WORDS = POSITIVE[:3] + NEGATIVE[:2]  # the words a prompt asks for: few, so the tiny SFT policy ties each to its prompt
FILLERS = sorted({noun for nouns in NOUNS.values() for noun in nouns})  # the answers' other words
PROMPT_TEMPLATES = [
    "Start your answer with the word {word}.",
    "Begin your reply with {word}.",
    "Your first word must be {word}.",
    "Answer in a few words, and say {word} first.",
    "Open with the word {word}, then anything.",
    "Use {word} as the first word.",
    # held out: only the evaluation sees these two
    "The first word of your answer should be {word}.",
    "Make {word} the first word you write.",
]
TRAIN_TEMPLATES = 6
REPEATS = 16  # each phrasing of each word appears this many times (each its own id): 480 training, 160 held out

_WORD = re.compile(r"[a-z]+")


def placement(text: str, word: str) -> int:
    """1 if ``text``'s first word is ``word``, 0 if ``word`` comes later, -1 if it is missing (case ignored)."""
    words = _WORD.findall(text.lower())
    return 1 if words[:1] == [word] else 0 if word in words else -1


def gold_reward(prompts: list, responses: list[str], word: list[str] | None = None, **columns: Any) -> list[float]:
    """The gold reward (``--reward-fn rlhf_pipeline.demo.first_word:gold_reward``): 1 for the prompt's word first,
    0 for it later, -1 for it missing; the word comes from the prompts' ``word`` column (rlhf generate carries it)."""
    if word is None:
        raise ValueError("the first_word task's reward reads each prompt's 'word' column; the data has none")
    return [float(placement(response, w)) for response, w in zip(responses, word)]


def prompt_rows(held_out: bool) -> list[dict[str, str]]:
    """The training prompts (``held_out=False``: the first phrasings) or the held-out ones (the last phrasings),
    :data:`REPEATS` times each."""
    return [{"id": f"{word}-{k}-{r}", "prompt": template.format(word=word), "word": word}
            for word in WORDS for k, template in enumerate(PROMPT_TEMPLATES) if (k >= TRAIN_TEMPLATES) == held_out
            for r in range(REPEATS)]


def answer(rng: random.Random, word: str, right_share: float) -> str:
    """Two to four words and a period: ``word`` first with probability ``right_share``, else later or missing."""
    words = rng.sample(FILLERS, rng.randint(1, 3))
    if rng.random() < right_share:
        words.insert(0, word)
    elif rng.random() < 0.5:
        words.insert(rng.randint(1, len(words)), word)
    else:
        words.append(rng.choice([f for f in FILLERS if f not in words]))
    return " ".join(words) + "."


def write_task_data(directory: Path, seed: int = 0, sft_per_prompt: int = 2) -> dict[str, Path]:
    """Write the task's files into ``directory`` (idempotent: the same seed writes the same bytes): ``prompts``
    (training, shuffled), ``eval_prompts`` (held out) and ``sft``."""
    train_prompts, eval_prompts = prompt_rows(held_out=False), prompt_rows(held_out=True)
    rng = random.Random(seed)
    sft = [{"prompt": p["prompt"], "answer": answer(rng, p["word"], rng.choice(RIGHT_SHARES))}
           for p in train_prompts for _ in range(sft_per_prompt)]
    return write_task_files(directory, seed, train_prompts, eval_prompts, sft=sft)
