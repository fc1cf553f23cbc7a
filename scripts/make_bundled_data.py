"""Regenerate the bundled offline data in src/rlhf_pipeline/data/ (deterministic; run from the repo root).

- tiny_corpus.txt: English text the tiny tokenizer is trained on (short reviews, plain sentences).
- prompts.jsonl:   200 review prompts ({"id", "prompt", "label"}), the bundled prompt set of the CPU runs.

    python scripts/make_bundled_data.py
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from rlhf_pipeline.demo.task import NEGATIVE, NOUNS, POSITIVE, PROMPT_TEMPLATES, SENTENCES, TOPICS  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "src" / "rlhf_pipeline" / "data"

PLAIN = [
    "The weather was mild and the streets were quiet in the morning.",
    "She opened the window and the sound of the river filled the room.",
    "We walked to the market, bought bread and apples, and came home before noon.",
    "He wrote a short letter to his brother and left it on the kitchen table.",
    "The children played in the garden until the sun went down.",
    "A small dog slept by the door while the rain fell on the roof.",
    "They talked about books, music and the places they wanted to visit.",
    "The train was late, so I read a few pages and drank a cup of tea.",
    "Numbers like one, two, three, four, five, six, seven, eight, nine and ten are easy to say.",
    "Thank you for asking. Here is my answer in a few words.",
]


def main() -> None:
    rng = random.Random(0)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for topic, names in TOPICS.items():
        for i, name in enumerate(names):
            rows.append({"id": f"{topic.replace(' ', '_')}-{i:02d}",
                         "prompt": PROMPT_TEMPLATES[i % len(PROMPT_TEMPLATES)].format(topic=topic, name=name),
                         "label": topic})
    with (OUT / "prompts.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    lines = list(PLAIN) * 3
    for topic, names in TOPICS.items():
        for name in names:
            for template in PROMPT_TEMPLATES:
                lines.append(template.format(topic=topic, name=name))
            for _ in range(6):
                pool = POSITIVE if rng.random() < 0.5 else NEGATIVE
                n1, n2 = rng.sample(NOUNS[topic], 2)
                lines.append(" ".join(
                    rng.choice(SENTENCES).format(noun=n1, noun2=n2, adj=rng.choice(pool), adj2=rng.choice(pool),
                                                 topic=topic, name=name)
                    for _ in range(rng.randint(1, 3))))
    rng.shuffle(lines)
    (OUT / "tiny_corpus.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(rows)} prompts and {len(lines)} corpus lines to {OUT}")


if __name__ == "__main__":
    main()
