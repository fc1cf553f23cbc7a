"""Regenerate the bundled offline data in src/rlhf_pipeline/data/ (deterministic; run from the repo root).

- tiny_corpus.txt: English text the tiny tokenizer is trained on (short reviews, plain sentences).
- prompts.jsonl:   200 review prompts ({"id", "prompt", "label"}), the bundled prompt set of the CPU runs.

    python scripts/make_bundled_data.py
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "rlhf_pipeline" / "data"

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
