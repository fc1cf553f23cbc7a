"""The demo's bundled task: short product reviews, and a programmatic gold reward for their sentiment.

A prompt asks for a review of a named movie, restaurant, phone, ... ("Write a short review of the movie Night
Train."). A review is one to three template sentences whose adjectives come from two word lists, POSITIVE and
NEGATIVE. The gold reward of a response is its sentiment polarity,

    gold = (#positive words - #negative words) / (#positive + #negative words),   0 when it has neither,

a number in [-1, 1]. The SFT demonstrations are reviews of every shade (the share of positive adjectives is drawn
from {0, 1/4, 1/2, 3/4, 1}), so the warm-started policy writes reviews of mixed sentiment, with gold reward near 0
on average; RLHF with a reward model trained on gold-labelled pairs should push it towards positive reviews. A tiny
model can learn this in minutes on a CPU: the words it needs are in the tokenizer's training corpus (built from
the same lists by ``scripts/make_bundled_data.py``).

Prompts are split by product name: the first 16 names of each of the 10 topics give the 640 training prompts
(4 phrasings each), the last 4 names give 160 held-out evaluation prompts that no training stage sees.

Everything here is deterministic given a seed, and pure Python (no torch).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

TOPICS = {
    "movie": ["The Silent Harbor", "Night Train", "Paper Moons", "The Last Orchard", "Blue Canyon", "Iron Garden",
              "Winter Letters", "The Glass River", "Small Hours", "Red Lantern", "Northern Lights", "The Quiet Field",
              "City of Kites", "Summer Static", "The Long Table", "Salt and Stone", "Golden Hour", "The Far Shore",
              "Hidden Valley", "Midnight Circus"],
    "restaurant": ["Luna Bistro", "The Green Fork", "Casa Olivia", "Noodle House", "The Corner Grill", "Saffron Table",
                   "Harbor Fish Bar", "Pasta Nostra", "The Daily Bread", "Spice Route", "Maple Diner", "Sushi Wave",
                   "The Rustic Oven", "Taco Town", "Blue Door Cafe", "Garden Kitchen", "The Smokehouse",
                   "Little Lisbon", "Rice and Curry", "The Copper Pot"],
    "book": ["The River Keeper", "A House of Clocks", "Letters from Nowhere", "The Cartographer", "Quiet Storms",
             "The Orchard Year", "Echoes of Glass", "The Salt Road", "Under Paper Skies", "The Winter Guest",
             "A Field of Stars", "The Lighthouse Diary", "Stone and Feather", "The Borrowed Coat", "Maps of Rain",
             "The Ninth Bridge", "Silver Thread", "The Patient Sea", "Morning Lanterns", "The Open Gate"],
    "phone": ["Nova X2", "Pixel Lite", "Orbit 5", "Zen Phone Mini", "Aero 12", "Pulse S", "Vega Pro", "Nimbus 3",
              "Echo One", "Spark Max", "Lumen 8", "Terra Go", "Flux Neo", "Comet Z", "Atlas Plus", "Ember 4",
              "Halo Air", "Quartz 7", "Drift S", "Polar Pro"],
    "hotel": ["Seaside Inn", "The Grand Palace", "Mountain Lodge", "City Central Hotel", "The Old Mill",
              "Harbor View", "Garden Suites", "The Riverside", "Pine Hill Resort", "The Station Hotel",
              "Sunset Motel", "Lakeside Cabins", "The Royal Oak", "Desert Star", "The Lantern House",
              "Cliffside Retreat", "The Market Hotel", "Bayfront Suites", "The Willow", "Snowpeak Chalet"],
    "album": ["Neon Rivers", "Glass Hearts", "Slow Motion", "Paper Planes", "Wild Coast", "Echo Chamber",
              "Velvet Nights", "Open Roads", "Static Bloom", "Gold Dust", "Low Tide", "Bright Fever", "Ghost Notes",
              "Moon Songs", "Iron Lungs", "Sweet Thunder", "Blue Hour", "Crooked Lines", "Soft Machines",
              "Long Summer"],
    "game": ["Starfall", "Dungeon Drift", "Sky Pirates", "Tiny Kingdoms", "Cyber Run", "Frost Fort",
             "Puzzle Harbor", "Racing Hearts", "Shadow Keep", "Farm Valley", "Orbital", "Pixel Quest",
             "Mech Arena", "Ocean Deep", "Castle Builder", "Neon Strike", "Forest Spirits", "Block Party",
             "Time Rift", "Word Garden"],
    "laptop": ["Aero Book 14", "Titan 16", "Slim Pro", "Nova Note", "Craft Book", "Swift 13", "Zen Book Air",
               "Vector 15", "Edge Pad", "Glide X", "Core Book", "Summit 14", "Falcon 17", "Breeze 13",
               "Forge Pro", "Nimbus Book", "Pulse Pad", "Arc 15", "Ridge 14", "Halo Book"],
    "coffee shop": ["Bean There", "The Daily Grind", "Morning Ritual", "Steam and Sugar", "Copper Cup",
                    "The Roastery", "Second Shot", "Velvet Bean", "Little Crema", "The Kettle", "Brew Lab",
                    "Golden Mug", "Oak and Espresso", "The Filter Room", "Cloud Latte", "Bitter Sweet",
                    "The Pour House", "Sunrise Coffee", "Cup of Joy", "Slow Drip"],
    "park": ["Riverside Park", "Oak Hollow", "Central Green", "Lakeview Gardens", "Pine Ridge", "Willow Commons",
             "Harbor Point", "Meadow Run", "Stone Bridge Park", "Cedar Grove", "Sunset Fields", "Maple Square",
             "Fox Hill", "Bluebell Wood", "Heron Marsh", "Rose Garden", "Quarry Park", "North Beach",
             "Elm Terrace", "Canal Walk"],
}

PROMPT_TEMPLATES = [
    "Write a short review of the {topic} {name}.",
    "Give a one-sentence review of {name}, a {topic}.",
    "What did you think of the {topic} {name}? Answer in one sentence.",
    "Describe your experience with {name} ({topic}) in a short review.",
]

POSITIVE = ["great", "wonderful", "excellent", "lovely", "amazing", "delightful", "superb", "fantastic", "good",
            "charming", "brilliant", "beautiful", "friendly", "fresh", "enjoyable", "perfect", "warm", "fun"]
NEGATIVE = ["bad", "terrible", "awful", "boring", "poor", "dull", "disappointing", "rude", "stale", "noisy",
            "broken", "slow", "bland", "messy", "weak", "cold", "annoying", "ugly"]
NOUNS = {
    "movie": ["story", "acting", "ending", "music", "script", "cast"],
    "restaurant": ["food", "service", "menu", "staff", "dessert", "soup"],
    "book": ["plot", "writing", "characters", "ending", "pace", "prose"],
    "phone": ["screen", "battery", "camera", "speaker", "design", "price"],
    "hotel": ["room", "staff", "breakfast", "bed", "view", "lobby"],
    "album": ["songs", "vocals", "lyrics", "sound", "melodies", "production"],
    "game": ["levels", "controls", "graphics", "story", "music", "puzzles"],
    "laptop": ["keyboard", "screen", "battery", "speakers", "fan", "trackpad"],
    "coffee shop": ["coffee", "pastries", "staff", "music", "seats", "prices"],
    "park": ["paths", "trees", "benches", "lake", "playground", "views"],
}
SENTENCES = [
    "The {noun} was {adj}.",
    "I found the {noun} {adj} and the {noun2} {adj2}.",
    "Overall a {adj} {topic}, and the {noun} was {adj2}.",
    "{name} has {adj} {noun}.",
    "The {noun} felt {adj}, but the {noun2} was {adj2}.",
    "I would call it {adj}.",
    "A {adj} {topic} with {adj2} {noun}.",
    "Honestly, the {noun} is {adj}.",
]

TRAIN_NAMES_PER_TOPIC = 16  # names 0..15 of each topic train; 16..19 are held out for evaluation
POSITIVE_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)

_POS, _NEG = frozenset(POSITIVE), frozenset(NEGATIVE)
_WORD = re.compile(r"[a-z]+")


def sentiment_counts(text: str) -> tuple[int, int]:
    """(positive, negative) sentiment words in ``text``."""
    words = _WORD.findall(text.lower())
    return sum(w in _POS for w in words), sum(w in _NEG for w in words)


def polarity(text: str) -> float:
    pos, neg = sentiment_counts(text)
    return (pos - neg) / (pos + neg) if pos + neg else 0.0


def gold_reward(prompts: list, responses: list[str], **columns: Any) -> list[float]:
    """The gold reward (``rlhf score --reward-fn rlhf_pipeline.demo.task:gold_reward``): sentiment polarity."""
    return [polarity(r) for r in responses]


BRIEF_WORDS = 12  # the length brevity_reward likes best


def brevity_reward(prompts: list, responses: list[str], **columns: Any) -> list[float]:
    """A second reward for the demo's several-source runs (GDPO): reviews near :data:`BRIEF_WORDS` words score
    highest, ``−|words − 12| / 4``. It says nothing about sentiment; the gold reward does not read it."""
    return [-abs(len(_WORD.findall(r.lower())) - BRIEF_WORDS) / 4 for r in responses]


def prompt_rows(held_out: bool) -> list[dict[str, str]]:
    """The training prompts (``held_out=False``, 640) or the held-out evaluation prompts (160)."""
    rows = []
    for topic, names in TOPICS.items():
        for i, name in enumerate(names):
            if (i >= TRAIN_NAMES_PER_TOPIC) != held_out:
                continue
            for k, template in enumerate(PROMPT_TEMPLATES):
                rows.append({"id": f"{topic.replace(' ', '_')}-{i:02d}-{k}",
                             "prompt": template.format(topic=topic, name=name),
                             "topic": topic, "name": name})
    return rows


def review(rng: random.Random, topic: str, name: str, positive_share: float) -> str:
    """One to three template sentences; each adjective is positive with probability ``positive_share``."""

    def adjective() -> str:
        return rng.choice(POSITIVE if rng.random() < positive_share else NEGATIVE)

    sentences = []
    for _ in range(rng.randint(1, 3)):
        noun, noun2 = rng.sample(NOUNS[topic], 2)
        sentences.append(rng.choice(SENTENCES).format(
            noun=noun, noun2=noun2, adj=adjective(), adj2=adjective(), topic=topic, name=name))
    return " ".join(sentences)


def sft_rows(rng: random.Random, prompts: list[dict[str, str]], per_prompt: int) -> list[dict[str, str]]:
    """Demonstrations in ReaL's ``prompt``/``answer`` format: reviews of every shade of sentiment."""
    return [
        {"prompt": p["prompt"], "answer": review(rng, p["topic"], p["name"], rng.choice(POSITIVE_SHARES))}
        for p in prompts
        for _ in range(per_prompt)
    ]


def preference_rows(rng: random.Random, prompts: list[dict[str, str]], per_prompt: int) -> list[dict[str, str]]:
    """``prompt``/``chosen``/``rejected`` pairs labelled by the gold reward (ties are redrawn)."""
    rows = []
    for p in prompts:
        for _ in range(per_prompt):
            while True:
                a, b = (review(rng, p["topic"], p["name"], rng.choice(POSITIVE_SHARES)) for _ in range(2))
                if polarity(a) != polarity(b):
                    break
            chosen, rejected = (a, b) if polarity(a) > polarity(b) else (b, a)
            rows.append({"prompt": p["prompt"], "chosen": chosen, "rejected": rejected})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    from rlhf_pipeline.datasets_io import write_text_atomic

    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def write_task_data(directory: Path, seed: int = 0, sft_per_prompt: int = 2, pairs_per_prompt: int = 2) -> dict[str, Path]:
    """Write the task's files into ``directory`` (idempotent: the same seed writes the same bytes).

    Returns the paths of ``prompts`` (training prompts), ``eval_prompts`` (held out), ``sft`` and ``preferences``.
    """
    train_prompts, eval_prompts = prompt_rows(held_out=False), prompt_rows(held_out=True)
    rng = random.Random(seed)
    return write_task_files(directory, seed, train_prompts, eval_prompts,
                            sft=sft_rows(rng, train_prompts, sft_per_prompt),
                            preferences=preference_rows(rng, train_prompts, pairs_per_prompt))


def write_task_files(directory: Path, seed: int, train_prompts: list[dict], eval_prompts: list[dict],
                     **rows: list[dict]) -> dict[str, Path]:
    """A task's files in ``directory``, each ``NAME.jsonl``: ``prompts`` (the training prompts, shuffled with
    ``seed + 1``: iterations take consecutive chunks, so each mixes the topics), ``eval_prompts`` and each of
    ``rows`` (``sft``, ``preferences``). Returns their paths by name."""
    directory.mkdir(parents=True, exist_ok=True)
    order = list(train_prompts)
    random.Random(seed + 1).shuffle(order)
    files = {"prompts": order, "eval_prompts": eval_prompts, **rows}
    for name, content in files.items():
        write_jsonl(directory / f"{name}.jsonl", content)
    return {name: directory / f"{name}.jsonl" for name in files}
