"""Sentences of realistic, varied length (a few words to a long paragraph sentence), drawn
from a seeded generator: examples/data/sentences.jsonl and the MiniLM benchmark's inputs.

    python3 examples/make_sentences.py [N] [OUT]   (defaults: 200, examples/data/sentences.jsonl)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SHORT = ["Good morning.", "Thanks a lot!", "Where is the station?", "It rained all day.",
         "Call me later.", "The meeting moved to Friday.", "I lost my keys again.",
         "Is the kitchen open?", "Prices went up.", "She laughed."]
SUBJECTS = ["The committee", "My neighbour", "A small startup in Lisbon", "The new library",
            "Our physics teacher", "The river", "A delivery drone", "The city council",
            "An old fisherman", "The research team", "The hospital's night shift",
            "Every student in the class", "The orchestra", "A stray cat", "The train to Milan",
            "The quarterly report", "My grandmother", "The vaccine trial", "The bakery",
            "A group of hikers"]
VERBS = ["announced", "rejected", "described", "repaired", "photographed", "questioned",
         "celebrated", "measured", "postponed", "explained", "borrowed", "painted",
         "translated", "ignored", "recommended", "discovered"]
OBJECTS = ["a plan to rebuild the harbour", "the results of the soil survey",
           "an unusual pattern in the winter temperatures", "the broken bicycle",
           "a recipe for lemon cake", "the budget for next year", "a rare orchid",
           "the first chapter of the novel", "a faster route through the mountains",
           "the noise complaints from the neighbours", "its decision to close early",
           "a method for cleaning old coins", "the schedule for the summer festival",
           "a map of the underground tunnels", "the reasons for the delay"]
CLAUSES = ["after a long debate that lasted well past midnight",
           "although nobody expected it to work on the first try",
           "because the weather forecast promised a week of storms",
           "while the rest of the town was asleep",
           "even though the budget had already been cut twice this year",
           "so that the children could walk to school safely",
           "before the inspectors arrived on Monday morning",
           "which surprised everyone who had followed the story from the start",
           "despite warnings from several experts in the field",
           "until the last train had left the station"]
TAILS = ["The local paper covered it on the front page.", "Nobody has commented yet.",
         "More details will follow next week.", "It was the talk of the market for days.",
         "Several readers wrote letters in response."]


def sentence(rng: random.Random) -> str:
    """One sentence: short (a fifth), a clause or two, or a long one with a follow-up."""
    r = rng.random()
    if r < 0.2:
        return rng.choice(SHORT)
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if r > 0.45:
        s += f" {rng.choice(CLAUSES)}"
    if r > 0.75:
        s += f", and then {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(CLAUSES)}"
    s += "."
    if r > 0.9:
        s += " " + " ".join(rng.sample(TAILS, rng.randint(1, 3)))
    return s


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [sentence(rng) for _ in range(n)]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    out = Path(sys.argv[2] if len(sys.argv) > 2 else Path(__file__).parent / "data/sentences.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i, s in enumerate(sentences(n)):
            f.write(json.dumps({"id": f"s{i:05d}", "text": s}) + "\n")
    print(f"wrote {n} sentences to {out}")


if __name__ == "__main__":
    main()
