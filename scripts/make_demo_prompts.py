"""Generate eaglet's demo prompts (src/eaglet/resources/demo_prompts.jsonl) from templates.

8 categories x 130 prompts, written for this project: each category has a few sentence templates
and slot lists; a seeded RNG picks distinct combinations. 16 prompts per category form the fixed
held-out split that training never sees. Re-running this script reproduces the file byte for byte.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

PER_CATEGORY = 130
HELDOUT_PER_CATEGORY = 16
SEED = 20261129
OUT = Path(__file__).resolve().parents[1] / "src" / "eaglet" / "resources" / "demo_prompts.jsonl"

CATEGORIES: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "writing": (
        [
            "Write a {form} about {topic}, {style}.",
            "Draft a {form} on the theme of {topic}. Keep it {style_short}.",
            "Compose a {form} that captures {topic}; make it {style_short}.",
        ],
        {
            "form": [
                "short poem",
                "haiku sequence",
                "limerick",
                "two-paragraph story",
                "diary entry",
                "product description",
                "wedding toast",
                "cover letter opening",
                "blog introduction",
                "fable",
            ],
            "topic": [
                "a lighthouse keeper's last night",
                "the first snow in a big city",
                "a robot learning to cook",
                "an old bicycle",
                "moving to a new country",
                "a forgotten library",
                "the smell of rain",
                "a friendship between a cat and a crow",
                "a night train across the desert",
                "a garden in winter",
                "the last day of summer",
                "a lost umbrella",
            ],
            "style": [
                "in a hopeful tone",
                "in the voice of a child",
                "with vivid sensory detail",
                "with a twist ending",
                "using simple words",
                "in a melancholic mood",
            ],
            "style_short": [
                "under 120 words",
                "light and funny",
                "warm and sincere",
                "dramatic",
                "calm and reflective",
            ],
        },
    ),
    "roleplay": (
        [
            "You are {persona}. {situation} Respond in character.",
            "Pretend to be {persona}. {situation}",
            "Act as {persona} and answer me: {situation}",
        ],
        {
            "persona": [
                "a medieval blacksmith",
                "a ship's captain in a storm",
                "a patient museum guide",
                "a grumpy but kind librarian",
                "a detective in 1920s London",
                "a friendly alien tourist",
                "a mountain guide",
                "a chef running a busy kitchen",
                "a retired astronaut",
                "a wise old tree",
                "a sports coach at half-time",
                "a travel agent from the future",
            ],
            "situation": [
                "A customer asks you for advice on their first day.",
                "I have just arrived and I am lost.",
                "Someone asks what your hardest day was like.",
                "A child asks why you chose your job.",
                "Explain your daily routine to a newcomer.",
                "I want to hear your best story.",
                "Convince me to try something new.",
                "Tell me what worries you most today.",
                "Welcome a group of visitors.",
                "Give a short pep talk to a nervous beginner.",
            ],
        },
    ),
    "reasoning": (
        [
            "{puzzle} Explain your reasoning step by step.",
            "Think carefully: {puzzle}",
            "Solve this logic question and justify each step: {puzzle}",
        ],
        {
            "puzzle": [
                f"If {a} people each shake hands with everyone else exactly once, how many handshakes happen?"
                for a in (4, 5, 6, 7, 8, 9, 10, 12)
            ]
            + [
                f"A bat and a ball cost {p} dollars in total, and the bat costs {d} dollars more than the ball. What does the ball cost?"
                for p, d in ((1.10, 1.00), (2.20, 2.00), (3.30, 3.00), (5.50, 5.00))
            ]
            + [
                f"{x} is taller than {y}, and {y} is taller than {z}. Who is the shortest?"
                for x, y, z in itertools.permutations(("Ana", "Ben", "Chloe"), 3)
            ]
            + [
                f"A train leaves at {h}:00 and travels for {t} hours. At what time does it arrive?"
                for h, t in ((9, 3), (14, 5), (22, 4), (6, 7))
            ]
            + [f"How many diagonals does a polygon with {n} sides have?" for n in range(5, 13)]
            + [
                f"A snail climbs {up} meters each day and slips back {down} at night in a {depth}-meter well. On which day does it get out?"
                for up, down, depth in ((3, 2, 10), (4, 1, 20), (5, 3, 12), (2, 1, 8), (6, 4, 15), (3, 1, 11))
            ]
            + [
                f"If today is {day}, what day of the week will it be in {k} days?"
                for day in ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
                for k in (10, 45, 100)
            ]
            + [
                "All roses are flowers, and some flowers fade quickly. Can we conclude that some roses fade quickly?",
                "If it rains, the ground gets wet. The ground is wet. Did it necessarily rain?",
                "A farmer has 17 sheep and all but 9 run away. How many are left?",
                "Which weighs more: a kilogram of feathers or a kilogram of iron?",
            ],
        },
    ),
    "math": (
        [
            "Compute {expr} and show the working.",
            "What is {expr}? Explain briefly.",
            "Solve: {eq}",
        ],
        {
            "expr": [f"{a} * {b}" for a in (12, 27, 45, 123, 99, 56) for b in (7, 13, 34, 78, 16)]
            + [f"{a}% of {b}" for a in (15, 20, 7, 12.5, 35) for b in (80, 250, 64)]
            + [f"the sum of the first {n} positive integers" for n in (10, 20, 50, 100, 250, 1000)]
            + [f"the area of a circle with radius {r}" for r in (2, 3, 5, 7, 10)],
            "eq": [
                f"{a}x + {b} = {c}"
                for a, b, c in (
                    (2, 3, 11),
                    (5, -4, 21),
                    (3, 7, 25),
                    (4, 1, 17),
                    (7, 2, 30),
                    (6, -5, 13),
                    (9, 4, 40),
                    (8, -3, 29),
                    (10, 5, 65),
                    (11, -2, 20),
                )
            ]
            + [f"x^2 - {s}x + {p} = 0" for s, p in ((5, 6), (7, 12), (9, 20), (3, 2), (11, 30), (8, 15))]
            + [
                "the system x + y = 10, x - y = 4",
                "the system 2x + y = 7, x - y = -1",
                "the system 3x + 2y = 12, x + y = 5",
            ],
        },
    ),
    "coding": (
        [
            "Write a {lang} function that {task}.",
            "In {lang}, how would you {task_how}? Include a short example.",
            "Explain this task and give {lang} code: {task}.",
        ],
        {
            "lang": ["Python", "JavaScript", "Rust", "Go", "C", "Java", "TypeScript", "Bash"],
            "task": [
                "reverses a string",
                "checks whether a number is prime",
                "returns the n-th Fibonacci number",
                "counts the words in a text",
                "removes duplicates from a list while keeping order",
                "merges two sorted lists",
                "validates an email address roughly",
                "finds the largest element of an array",
                "converts Celsius to Fahrenheit",
            ],
            "task_how": [
                "read a file line by line",
                "sort a list of records by a field",
                "parse JSON",
                "measure how long a function takes",
                "handle errors when opening a file",
            ],
        },
    ),
    "extraction": (
        [
            'Extract {what} from this text: "{text}"',
            "From the following passage, list {what}. Passage: {text}",
            "Read this and return {what} as JSON: {text}",
        ],
        {
            "what": [
                "all dates",
                "the names of people",
                "every place mentioned",
                "the prices and items",
                "the main action items",
                "the company names",
                "every number with its unit",
            ],
            "text": [
                "On March 3rd, Maria Lopez flew from Madrid to Oslo to meet the team at Nordwind AS; the tickets cost 240 euros.",
                "Tom and Priya will review the budget on Friday, then send the report to Acme Corp by June 10.",
                "The bakery sells bread for 3 dollars, croissants for 2 dollars and cakes for 15 dollars, every day except Monday.",
                "In 1969 Neil Armstrong walked on the Moon while Michael Collins orbited above in Columbia.",
                "Please book the Berlin hotel, email Dr. Chen about the results, and renew the license before April 1.",
                "Globex and Initech signed the deal in Chicago on 12 May 2021 after talks led by Sarah Kim.",
                "The museum in Florence opens at 9; tickets are 12 euros for adults and 6 euros for students.",
                "Kenji ordered 2 kilograms of rice and 500 grams of tea from a shop in Kyoto on the 4th of July.",
            ],
        },
    ),
    "stem": (
        [
            "Explain {concept} to a {audience}.",
            "Teach me about {concept}; I am a {audience}.",
            "Give a clear, short explanation of {concept} with one everyday example.",
        ],
        {
            "concept": [
                "photosynthesis",
                "how vaccines train the immune system",
                "entropy",
                "plate tectonics",
                "why the sky is blue",
                "how a transistor works",
                "Newton's third law",
                "DNA replication",
                "the greenhouse effect",
                "how batteries store energy",
                "black holes",
                "natural selection",
                "how GPS finds your position",
                "the speed of sound",
                "how antibiotics work",
                "why ice floats",
            ],
            "audience": ["ten-year-old", "high-school student", "busy adult", "first-year university student"],
        },
    ),
    "humanities": (
        [
            "Summarize the main causes of {event}.",
            "What can we learn today from {event}? Give three points.",
            "Discuss the idea of {idea} in {thinker_context}.",
            "Who were the key figures in {event}, and what did they do?",
            "How did {event} change everyday life for ordinary people?",
        ],
        {
            "event": [
                "the fall of the Western Roman Empire",
                "the printing revolution",
                "the French Revolution",
                "the Industrial Revolution",
                "the Renaissance in Italy",
                "the end of the Cold War",
                "the Silk Road trade",
                "the abolition of slavery in Britain",
                "the spread of literacy in Europe",
                "the founding of the United Nations",
                "the Meiji Restoration",
                "the Protestant Reformation",
                "the Age of Exploration",
                "the rise of the Mongol Empire",
                "the American civil rights movement",
                "the Scientific Revolution",
            ],
            "idea": [
                "justice",
                "freedom",
                "happiness",
                "duty",
                "beauty",
                "truth",
                "courage",
                "equality",
                "friendship",
                "the good life",
            ],
            "thinker_context": [
                "ancient Greek philosophy",
                "Confucian thought",
                "the Enlightenment",
                "modern political theory",
                "Stoicism",
                "Buddhist philosophy",
                "existentialism",
            ],
        },
    ),
}


def expand(templates: list[str], slots: dict[str, list[str]]) -> list[str]:
    prompts = []
    for template in templates:
        names = [n for n in slots if "{" + n + "}" in template]
        for combo in itertools.product(*(slots[n] for n in names)):
            prompts.append(template.format(**dict(zip(names, combo))))
    return sorted(set(prompts))


def main() -> None:
    rng = random.Random(SEED)
    rows = []
    for category, (templates, slots) in CATEGORIES.items():
        pool = expand(templates, slots)
        if len(pool) < PER_CATEGORY:
            raise SystemExit(f"{category}: only {len(pool)} distinct prompts")
        chosen = rng.sample(pool, PER_CATEGORY)
        for index, prompt in enumerate(chosen):
            split = "heldout" if index < HELDOUT_PER_CATEGORY else "train"
            rows.append({"id": f"{category}-{index:03d}", "category": category, "split": split, "prompt": prompt})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {OUT}")


if __name__ == "__main__":
    main()
