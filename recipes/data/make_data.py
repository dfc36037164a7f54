"""Generate the recipes' embedded dataset: ``recipes/data/chat.jsonl``.

Each line is one conversation in the conversational ``messages`` format that TRL's ``SFTTrainer`` takes::

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}

The conversations are templated question/answer turns about small, consistent facts (capitals, opposites,
plurals, animals, colours, days and months, counting and small sums), so a tiny randomly initialised model
learns them visibly within a hundred steps: first the templates, then the facts. Everything is written here,
nothing is downloaded; the output is deterministic (seeded), so re-running this script reproduces the
shipped file byte for byte::

    python recipes/data/make_data.py            # rewrites recipes/data/chat.jsonl
    python recipes/data/make_data.py --check    # exits 1 if the shipped file differs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

OUTPUT = Path(__file__).with_name("chat.jsonl")
NUM_CONVERSATIONS = 400
SEED = 0

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Greece": "Athens",
    "Turkey": "Ankara",
    "Russia": "Moscow",
    "Australia": "Canberra",
    "Ireland": "Dublin",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "Switzerland": "Bern",
    "Hungary": "Budapest",
    "Czechia": "Prague",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Indonesia": "Jakarta",
    "Nigeria": "Abuja",
    "Morocco": "Rabat",
    "Cuba": "Havana",
    "Iceland": "Reykjavik",
    "Ukraine": "Kyiv",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "happy": "sad",
    "light": "dark",
    "early": "late",
    "up": "down",
    "open": "closed",
    "full": "empty",
    "old": "young",
    "strong": "weak",
    "loud": "quiet",
    "wet": "dry",
    "hard": "soft",
    "rich": "poor",
    "near": "far",
    "thick": "thin",
    "high": "low",
    "clean": "dirty",
    "heavy": "light",
    "long": "short",
    "true": "false",
    "begin": "end",
    "win": "lose",
}
PLURALS = {
    "mouse": "mice",
    "child": "children",
    "goose": "geese",
    "tooth": "teeth",
    "foot": "feet",
    "man": "men",
    "woman": "women",
    "person": "people",
    "leaf": "leaves",
    "knife": "knives",
    "box": "boxes",
    "city": "cities",
    "baby": "babies",
    "potato": "potatoes",
    "cactus": "cacti",
    "fish": "fish",
    "sheep": "sheep",
    "ox": "oxen",
    "wolf": "wolves",
    "berry": "berries",
}
ANIMALS = {  # animal: (sound, young)
    "cow": ("moo", "calf"),
    "dog": ("woof", "puppy"),
    "cat": ("meow", "kitten"),
    "sheep": ("baa", "lamb"),
    "duck": ("quack", "duckling"),
    "horse": ("neigh", "foal"),
    "pig": ("oink", "piglet"),
    "lion": ("roar", "cub"),
    "owl": ("hoot", "owlet"),
    "frog": ("croak", "tadpole"),
    "goat": ("bleat", "kid"),
    "bee": ("buzz", "larva"),
}
COLOURS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a ripe tomato": "red",
    "an orange": "orange",
    "a plum": "purple",
    "chocolate": "brown",
    "a flamingo": "pink",
    "an emerald": "green",
    "a ruby": "red",
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
GREETINGS = ["Hello!", "Hi there.", "Good morning.", "Hey, quick question.", "Hi!"]
REPLIES = ["Hello! How can I help?", "Hi! What would you like to know?", "Good day! Ask me anything."]
THANKS = ["Thanks!", "Thank you.", "Great, thanks.", "Perfect, thank you!"]
WELCOMES = ["You are welcome!", "Happy to help.", "Any time!", "Glad I could help."]

Turn = tuple[str, str]


def capital(rng: random.Random) -> Turn:
    country, city = rng.choice(sorted(CAPITALS.items()))
    q = rng.choice(["What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital of {c}."])
    return q.format(c=country), f"The capital of {country} is {city}."


def opposite(rng: random.Random) -> Turn:
    word, opp = rng.choice(sorted(OPPOSITES.items()))
    q = rng.choice(
        ["What is the opposite of {w}?", "Give me the opposite of {w}.", "What word means the opposite of {w}?"]
    )
    return q.format(w=word), f"The opposite of {word} is {opp}."


def plural(rng: random.Random) -> Turn:
    word, many = rng.choice(sorted(PLURALS.items()))
    q = rng.choice(["What is the plural of {w}?", "How do you say more than one {w}?"])
    return q.format(w=word), f"The plural of {word} is {many}."


def animal(rng: random.Random) -> Turn:
    name, (sound, young) = rng.choice(sorted(ANIMALS.items()))
    if rng.random() < 0.5:
        return f"What sound does a {name} make?", f"A {name} says {sound}."
    return f"What is a baby {name} called?", f"A baby {name} is called a {young}."


def colour(rng: random.Random) -> Turn:
    thing, col = rng.choice(sorted(COLOURS.items()))
    return f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {col}."


def calendar(rng: random.Random) -> Turn:
    names, kind = rng.choice([(DAYS, "day"), (MONTHS, "month")])
    i = rng.randrange(len(names))
    after, before = names[(i + 1) % len(names)], names[i - 1]
    if rng.random() < 0.5:
        return f"Which {kind} comes after {names[i]}?", f"{after} comes after {names[i]}."
    return f"Which {kind} comes before {names[i]}?", f"{before} comes before {names[i]}."


def counting(rng: random.Random) -> Turn:
    n = rng.randrange(1, 99)
    if rng.random() < 0.5:
        return f"What number comes after {n}?", f"The number after {n} is {n + 1}."
    return f"Count from {n} to {n + 4}.", ", ".join(str(k) for k in range(n, n + 5)) + "."


def addition(rng: random.Random) -> Turn:
    a, b = rng.randrange(0, 20), rng.randrange(0, 20)
    q = rng.choice(["What is {a} plus {b}?", "What is {a} + {b}?", "Add {a} and {b}."])
    return q.format(a=a, b=b), f"{a} plus {b} is {a + b}."


TOPICS: list[Callable[[random.Random], Turn]] = [
    capital,
    opposite,
    plural,
    animal,
    colour,
    calendar,
    counting,
    addition,
]


def conversation(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """One conversation: an optional greeting, 2-4 question/answer turns, an optional thank-you."""
    messages: list[dict[str, str]] = []

    def turn(user: str, assistant: str) -> None:
        messages.extend([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}])

    if rng.random() < 0.3:
        turn(rng.choice(GREETINGS), rng.choice(REPLIES))
    for _ in range(rng.randint(2, 4)):
        turn(*rng.choice(TOPICS)(rng))
    if rng.random() < 0.3:
        turn(rng.choice(THANKS), rng.choice(WELCOMES))
    return {"messages": messages}


def render(num: int = NUM_CONVERSATIONS, seed: int = SEED) -> str:
    """The JSONL text of ``num`` seeded conversations."""
    rng = random.Random(seed)
    return "".join(json.dumps(conversation(rng), ensure_ascii=False) + "\n" for _ in range(num))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify the shipped file instead of writing it")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"where to write (default: {OUTPUT})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = args.output.exists() and args.output.read_text(encoding="utf-8") == text
        print(f"{args.output}: {'up to date' if same else 'DIFFERS from the generator'}")
        return 0 if same else 1
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {NUM_CONVERSATIONS} conversations ({len(text.encode()) / 1024:.0f} KiB) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
