"""Multi-session dialogues with interleaved threads whose facts are introduced, revised and recalled.

A *thread* is one person and one attribute (where Mia lives, how many dinner parties Omar went to). Each dialogue
interleaves several threads with small talk. Per turn the generator picks one event:

* ``intro`` - a thread's fact is stated for the first time ("My cousin Mia just moved to Lisbon.");
* ``revise`` - a later turn changes it ("Mia left Lisbon; she lives in Oslo now."; a count goes up by one);
* ``recall`` - a question about a thread whose last statement is at least ``min_gap`` turns back; the reply
  holds the current value, whose character span is the gold answer;
* ``chat`` - small talk with no fact (its own thread per topic, so every turn belongs to a thread).

Every recall turn carries the turn of the fact's last statement (``fact_turn``), its distance in turns and
whether the value was revised before the question (``revised``). Turns are grouped into sessions of
``session_turns``. All text is written here from templates (names, places and wordings are this project's).

A dialogue: ``{"id", "turns": [{"user", "assistant", "session", "thread", "kind", "answer", "answer_start",
"fact_turn", "distance", "revised"}]}``; ``answer_start`` is the answer's character offset in ``assistant``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

__all__ = ["DialogueSpec", "ATTRIBUTES", "generate_dialogue", "generate_dialogues"]

NAMES = ["Mia", "Omar", "Lena", "Tariq", "Ines", "Bruno", "Yuki", "Ravi", "Greta", "Kofi", "Nadia", "Pavel",
         "Sofia", "Hugo", "Amara", "Felix", "Leila", "Marco", "Zara", "Emil", "Priya", "Jonas", "Chloe", "Dmitri",
         "Aisha", "Lukas", "Noor", "Tomas", "Elena", "Kenji"]
RELATIONS = ["cousin", "neighbour", "colleague", "friend", "sister", "brother", "aunt", "old classmate"]

# attribute -> values, intro wordings, revision wordings, question wordings, reply wordings ({v}: the value)
ATTRIBUTES: Dict[str, Dict[str, Any]] = {
    "city": {
        "values": ["Lisbon", "Oslo", "Nairobi", "Denver", "Krakow", "Osaka", "Porto", "Quito", "Tallinn", "Perth",
                   "Valencia", "Halifax", "Seoul", "Bergen", "Tunis", "Leeds"],
        "intro": ["My {rel} {p} just moved to {v}.", "Did I tell you? {p}, my {rel}, lives in {v} now.",
                  "{p} (my {rel}) has settled in {v}."],
        "revise": ["Update on {p}: {pr} left {old} and lives in {v} now.",
                   "{p} moved again, from {old} to {v}.", "Turns out {p} did not stay in {old}; {pr} is in {v}."],
        "ask": ["Remind me, where does {p} live these days?", "Which city is {p} in now?",
                "Where is {p} living at the moment?"],
        "reply": ["{p} lives in {v}.", "{p} is in {v} now.", "Last I heard, {p} lives in {v}."],
        "ack": ["Noted: {p} is in {v}.", "Got it, {p} lives in {v}.", "Thanks, I will remember {v} for {p}."],
    },
    "job": {
        "values": ["nurse", "pilot", "carpenter", "librarian", "chemist", "baker", "architect", "translator",
                   "firefighter", "surveyor", "jeweller", "plumber", "geologist", "tailor"],
        "intro": ["My {rel} {p} works as a {v}.", "{p}, my {rel}, started a job as a {v}.",
                  "You know {p}? {pr} is a {v} by trade."],
        "revise": ["{p} quit being a {old} and now works as a {v}.", "Big news: {p} switched from {old} to {v}.",
                   "{p} is no longer a {old}; {pr} retrained as a {v}."],
        "ask": ["What does {p} do for a living now?", "Remind me of {p}'s job?", "What is {p}'s job these days?"],
        "reply": ["{p} works as a {v}.", "{p} is a {v} now.", "These days {p} is a {v}."],
        "ack": ["Noted, {p} is a {v}.", "A {v}, got it.", "I will remember that {p} is a {v}."],
    },
    "pet": {
        "values": ["Biscuit", "Pepper", "Mochi", "Rufus", "Clementine", "Ziggy", "Nutmeg", "Waffles", "Juniper",
                   "Pickles", "Marble", "Sprout", "Tofu", "Basil"],
        "intro": ["My {rel} {p} adopted a dog called {v}.", "{p}'s new cat is named {v}.",
                  "{p}, my {rel}, has a parrot called {v}."],
        "revise": ["{p} renamed the pet: not {old} any more, it is {v} now.",
                   "Funny thing, {p} changed the pet's name from {old} to {v}.",
                   "{p} decided {old} did not suit the pet and went with {v}."],
        "ask": ["What is the name of {p}'s pet?", "What does {p} call the pet now?", "Remind me, {p}'s pet is called?"],
        "reply": ["{p}'s pet is called {v}.", "The pet is named {v}.", "{p} calls it {v}."],
        "ack": ["{v}, what a name.", "Noted: the pet is {v}.", "Cute, {v} it is."],
    },
    "parties": {
        "values": [str(n) for n in range(1, 10)],
        "intro": ["So far {p} has been to {v} dinner parties this month.",
                  "{p}, my {rel}, counted {v} dinner parties this month.",
                  "{p} told me {pr} attended {v} dinner parties this month."],
        "revise": ["{p} went to another dinner party, so that makes {v} this month.",
                   "One more dinner party for {p}: {v} in total now.",
                   "{p} added a dinner party last night, {v} this month."],
        "ask": ["How many dinner parties has {p} attended this month?", "What is {p}'s dinner party count now?",
                "How many dinner parties did {p} go to this month?"],
        "reply": ["{p} has attended {v} dinner parties.", "That is {v} dinner parties for {p}.",
                  "{p} is at {v} dinner parties this month."],
        "ack": ["{v} dinner parties, noted.", "Busy month, {v} so far.", "I will keep the count at {v}."],
    },
}

CHAT = {
    "weather": ["It rained all morning here.", "The sun finally came out this afternoon.",
                "It is so windy today that my umbrella broke.", "They say it will snow tomorrow."],
    "food": ["I tried a new soup recipe with lentils.", "I baked bread for the first time.",
             "Lunch was just a sandwich today.", "I am thinking of making curry tonight."],
    "books": ["I started a long novel about sailors.", "The library had a sale on old atlases.",
              "I keep falling asleep while reading.", "I finished a short story collection."],
    "work": ["The meeting ran over again.", "My inbox is finally empty.", "I am training a new colleague.",
             "The printer jammed three times today."],
    "sport": ["I went for a run by the river.", "The local team lost again.", "I signed up for a swimming class.",
              "My knee hurts after the hike."],
}
CHAT_REPLIES = ["That sounds nice.", "Oh no, I hope it gets better.", "Tell me more some time.",
                "Sounds like quite a day.", "Good for you.", "Ha, that happens."]


@dataclass
class DialogueSpec:
    """How one dialogue is drawn.

    Attributes:
        turns: number of turns (a turn = one user message and one assistant reply).
        threads: fact threads (distinct people; attributes drawn round robin over ``attributes``).
        attributes: attribute kinds to draw threads from (keys of :data:`ATTRIBUTES`).
        p_revise, p_recall: per-turn chances of a revision and of a recall (when one is possible).
        min_gap: a recall asks about a fact last stated at least this many turns earlier; a revision comes at least
            this many turns after the previous statement.
        intro_within: every thread is introduced within the first ``intro_within`` turns (None: the first third).
        session_turns: turns per session.
    """

    turns: int = 24
    threads: int = 4
    attributes: tuple = ("city", "job", "pet", "parties")
    p_revise: float = 0.2
    p_recall: float = 0.3
    min_gap: int = 3
    intro_within: Optional[int] = None
    session_turns: int = 8


def _pronoun(rng: random.Random) -> str:
    return rng.choice(["she", "he", "they"])


def _next_value(attr: str, seen: List[str], rng: random.Random) -> str:
    """A revision's value: one more dinner party, or a value the thread never had (so an old value does not
    become right again, until a long dialogue has used every value)."""
    if attr == "parties":
        return str(int(seen[-1]) + 1)
    fresh = [v for v in ATTRIBUTES[attr]["values"] if v not in seen]
    return rng.choice(fresh or [v for v in ATTRIBUTES[attr]["values"] if v != seen[-1]])


def generate_dialogue(spec: DialogueSpec, seed: int, dialogue_id: Optional[str] = None) -> Dict[str, Any]:
    """One dialogue (see the module docstring), a pure function of ``spec`` and ``seed``."""
    rng = random.Random(seed)
    if spec.threads > len(NAMES):
        raise ValueError(f"threads={spec.threads}: at most {len(NAMES)} (one person per thread)")
    people = rng.sample(NAMES, spec.threads)
    attrs = [spec.attributes[i % len(spec.attributes)] for i in range(spec.threads)]
    rng.shuffle(attrs)
    window = spec.intro_within or max(spec.threads, spec.turns // 3)
    intro_turns = sorted(rng.sample(range(min(window, spec.turns)), min(spec.threads, window, spec.turns)))
    intro_at = {t: i for i, t in enumerate(intro_turns)}
    state: Dict[int, Dict[str, Any]] = {}
    turns: List[Dict[str, Any]] = []
    for t in range(spec.turns):
        base = {"session": t // spec.session_turns, "answer": None, "answer_start": None, "fact_turn": None,
                "distance": None, "revised": None}
        ready = [i for i, s in state.items() if t - s["last"] >= spec.min_gap]
        if t in intro_at:
            i = intro_at[t]
            p, attr = people[i], attrs[i]
            v = rng.choice(ATTRIBUTES[attr]["values"][:5] if attr == "parties" else ATTRIBUTES[attr]["values"])
            state[i] = {"value": v, "last": t, "revised": False, "seen": [v]}
            user = rng.choice(ATTRIBUTES[attr]["intro"]).format(p=p, v=v, rel=rng.choice(RELATIONS),
                                                               pr=_pronoun(rng).capitalize())
            reply = rng.choice(ATTRIBUTES[attr]["ack"]).format(p=p, v=v)
            turns.append({**base, "user": user, "assistant": reply, "thread": f"{p}:{attr}", "kind": "intro"})
            continue
        roll = rng.random()
        if ready and roll < spec.p_recall:
            i = rng.choice(ready)
            p, attr, s = people[i], attrs[i], state[i]
            user = rng.choice(ATTRIBUTES[attr]["ask"]).format(p=p)
            reply = rng.choice(ATTRIBUTES[attr]["reply"]).format(p=p, v=s["value"])
            start = reply.rfind(s["value"])
            turns.append({**base, "user": user, "assistant": reply, "thread": f"{p}:{attr}", "kind": "recall",
                          "answer": s["value"], "answer_start": start, "fact_turn": s["last"],
                          "distance": t - s["last"], "revised": s["revised"]})
            continue
        if ready and roll < spec.p_recall + spec.p_revise:
            i = rng.choice(ready)
            p, attr, s = people[i], attrs[i], state[i]
            new = _next_value(attr, s["seen"], rng)
            user = rng.choice(ATTRIBUTES[attr]["revise"]).format(p=p, old=s["value"], v=new,
                                                                pr=_pronoun(rng))
            reply = rng.choice(ATTRIBUTES[attr]["ack"]).format(p=p, v=new)
            state[i] = {"value": new, "last": t, "revised": True, "seen": s["seen"] + [new]}
            turns.append({**base, "user": user, "assistant": reply, "thread": f"{p}:{attr}", "kind": "revise"})
            continue
        topic = rng.choice(sorted(CHAT))
        turns.append({**base, "user": rng.choice(CHAT[topic]), "assistant": rng.choice(CHAT_REPLIES),
                      "thread": f"chat:{topic}", "kind": "chat"})
    return {"id": dialogue_id or f"dialogue-{seed}", "turns": turns}


def generate_dialogues(spec: DialogueSpec, n: int, seed: int) -> List[Dict[str, Any]]:
    """``n`` dialogues with seeds ``seed * 100003 + i``."""
    return [generate_dialogue(spec, seed * 100003 + i, f"dialogue-{seed}-{i}") for i in range(n)]
