"""The demo's second bundled task (``rlhf demo --task topics``): name three things that belong to a topic, rewarded
by a python function, with no reward model.

A prompt names a topic and asks for three things that belong to it ("Name three things a hotel has."). The topics
and their things are the review task's (:data:`rlhf_pipeline.demo.task.NOUNS`: a hotel has a room, staff,
breakfast, a bed, a view and a lobby), so the tiny tokenizer knows every word. The gold reward counts the things a
response names,

    gold = (min(#distinct things of the topic, 3) - #things of other topics only) / 3,   clipped to [-1, 1],

and -1/3 for an answer that names nothing at all (no better than one wrong thing),

a verifiable, content-and-count reward, unlike the review task's sentiment: what is right depends on the prompt's
topic, and naming a fourth thing earns nothing. Every iteration trains on this python reward directly (no reward
model is trained, as with any rule-based or verifiable reward); the evaluation uses the same function.

The SFT demonstrations list one to three things in a few sentence patterns, each thing from the prompt's topic with a
probability drawn from {0, 1/4, 1/2, 3/4, 1}, so the warm-started policy names a mix of right and wrong things
(gold reward near 0 on average). Prompts are split by phrasing: the training prompts are the first six phrasings of
every topic, the held-out prompts the last two, which no training stage sees (each prompt eight times, with ids of
their own: 480 and 160).

Everything here is deterministic given a seed, and pure Python (no torch).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from rlhf_pipeline.demo.task import NOUNS, write_task_files

PROMPT_TEMPLATES = [
    "Name three things a {topic} has.",
    "What are three parts of a {topic}?",
    "List three things you find in a {topic}.",
    "Tell me three things about a {topic}.",
    "Which three things make a good {topic}?",
    "Give three features of a {topic}.",
    # held out: only the evaluation sees these two
    "Name three things that belong to a {topic}.",
    "What three things would you notice in a {topic}?",
]
TRAIN_TEMPLATES = 6
REPEATS = 8  # each phrasing of each topic appears this many times (each its own id): 480 training, 160 held out
ANSWERS = [
    "A {topic} has {items}.",
    "It has {items}.",
    "You find {items}.",
    "The {topic} has {items}.",
    "{Items}.",
]
RIGHT_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
WANTED = 3

_WORD = re.compile(r"[a-z]+")
_THINGS = {topic: frozenset(things) for topic, things in NOUNS.items()}
_ALL_THINGS = frozenset(t for things in NOUNS.values() for t in things)


def named_things(text: str, topic: str) -> tuple[int, int]:
    """(distinct things of ``topic``, distinct things of other topics only) named in ``text``."""
    words = set(_WORD.findall(text.lower())) - set(_WORD.findall(topic))  # "coffee" of "coffee shop" is no answer
    right = words & _THINGS[topic]
    return len(right), len((words & _ALL_THINGS) - _THINGS[topic])


def gold_reward(prompts: list, responses: list[str], topic: list[str] | None = None, **columns: Any) -> list[float]:
    """The gold reward (``--reward-fn rlhf_pipeline.demo.topics:gold_reward``): up to three right things, minus
    wrong ones, over three (-1/3 when it names none); the topic comes from the prompts' ``topic`` column (rlhf
    generate carries it)."""
    if topic is None:
        raise ValueError("the topics task's reward reads each prompt's 'topic' column; the data has none")
    values = []
    for response, t in zip(responses, topic):
        right, wrong = named_things(response, t)
        values.append(-1 / WANTED if right + wrong == 0 else max(-1.0, min(1.0, (min(right, WANTED) - wrong) / WANTED)))
    return values


def list_format_reward(prompts: list, responses: list[str], **columns: Any) -> list[float]:
    """A second reward for the several-source runs (GDPO): one sentence that ends with a period scores 1, anything
    else 0. It says nothing about which things are named; the gold reward does not read it."""
    return [1.0 if r.strip().endswith(".") and r.strip().count(".") == 1 else 0.0 for r in responses]


def prompt_rows(held_out: bool) -> list[dict[str, str]]:
    """The training prompts (``held_out=False``: the first phrasings) or the held-out ones (the last phrasings),
    :data:`REPEATS` times each."""
    rows = []
    for topic in NOUNS:
        for k, template in enumerate(PROMPT_TEMPLATES):
            if (k >= TRAIN_TEMPLATES) != held_out:
                continue
            for r in range(REPEATS):
                rows.append({"id": f"{topic.replace(' ', '_')}-{k}-{r}", "prompt": template.format(topic=topic),
                             "topic": topic})
    return rows


def answer(rng: random.Random, topic: str, right_share: float) -> str:
    """One sentence naming one to three things, each of ``topic`` with probability ``right_share``."""
    others = sorted(_ALL_THINGS - _THINGS[topic])
    items = []
    while len(items) < rng.randint(1, WANTED):
        pool = NOUNS[topic] if rng.random() < right_share else others
        thing = rng.choice(pool)
        if thing not in items:
            items.append(thing)
    listed = items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
    template = rng.choice(ANSWERS)
    return template.format(topic=topic, items=listed, Items=listed[0].upper() + listed[1:])


def write_task_data(directory: Path, seed: int = 0, sft_per_prompt: int = 2) -> dict[str, Path]:
    """Write the task's files into ``directory`` (idempotent: the same seed writes the same bytes): ``prompts``
    (training, shuffled), ``eval_prompts`` (held out) and ``sft``."""
    train_prompts, eval_prompts = prompt_rows(held_out=False), prompt_rows(held_out=True)
    rng = random.Random(seed)
    sft = [{"prompt": p["prompt"], "answer": answer(rng, p["topic"], rng.choice(RIGHT_SHARES))}
           for p in train_prompts[::REPEATS] for _ in range(sft_per_prompt * REPEATS)]
    return write_task_files(directory, seed, train_prompts, eval_prompts, sft=sft)
