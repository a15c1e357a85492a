"""A generated multi-hop corpus: a small world of people, organisations, cities and books, one document per entity,
and questions whose answer needs 2 or 3 linked facts stated in different documents, with the gold supporting
sentences.

The world (seeded): every person was born in a city, works at an organisation, studied at a school and was
mentored by another person; every organisation (schools and publishers among them) is based in a city and was
founded by a person; every book was written by a person and published by a publisher. Each fact is one sentence
(one of two phrasings) in its subject's document, among filler sentences that state no relation. A question
names only its starting entity, so the document holding the answer never mentions it: retrieving with the question
alone finds the first hop, and the next hop needs the bridge entity (what multi-step retrieval and working memory
are for).

Question paths (:data:`PATHS`), e.g. ``book.written_by.works_at.based_in``: "In which city is the organisation
based where the author of "Silent Harbour" works?". The relation phrasings are regular, so
:func:`extraction_patterns` gives a regex per phrasing (named groups ``head`` / ``tail``) that extracts every fact
exactly: the rule-based extractor of the HGMem index reads them from the corpus folder (``patterns.json``), where a
135M model cannot extract reliably.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from litctx_common.seeding import stable_seed

__all__ = ["World", "make_world", "world_documents", "make_questions", "extraction_patterns", "PATHS", "RELATIONS"]

CITIES = ("Aldmere Brackwater Corrin Dunmoor Eastholm Fenwick Galloway Harrowgate Ivel Jarrow Kestwick Lowmarsh "
          "Marrowby Northwell Oakridge Pellham Quarry Redcliff Stonebury Thornvale").split()
FIRST = ("Ada Aron Bela Cora Dario Edda Femi Gita Hugo Ines Joris Kaia Lars Mira Nils Odile Pavel Quinn Rosa Sven "
         "Tova Umar Vera Wim Xenia Yusuf Zora Anouk Bram Cleo Dmitri Elin Farah Gustav Hana Ilse Jonas Kenji Lea "
         "Milan Nora Otto Priya Ravi Saskia Tomas Una Viggo Wanda").split()
LAST = ("Brandt Kovacs Lindqvist Okafor Moreau Castell Varga Nakamura Haddad Petrov Solberg Duarte Fischer Ibsen "
        "Marsh Novak Quist Rahman Sato Tanaka Ulrich Vidal Weiss Yilmaz Zeller Achebe Berg Costa Dahl Engel").split()
ORG_WORDS = ("Amber Beacon Cedar Copper Falcon Granite Harbour Iris Juniper Lantern Linden Meridian Northern Orchard "
             "Quartz Raven Silver Tidewater Willow Zenith").split()
ORG_KINDS = {"organisation": ("Society", "Works", "Institute", "Foundation", "Observatory", "Company"),
             "school": ("Academy", "College"), "publisher": ("Press", "Editions")}
BOOK_A = ("Silent Bright Hidden Northern Patient Restless Quiet Salt Distant Hollow Winter Open").split()
BOOK_B = ("Harbour Ledger Orchard Compass Lantern Tide Meadow Archive Bridge Atlas Garden Signal").split()
HOBBIES = ("sailing", "chess", "birdwatching", "pottery", "long walks", "choir singing", "fly fishing", "baking bread")
MONTHS = ("January", "March", "May", "July", "September", "November")

# relation -> (subject type, object type, two phrasings with {h} and {t})
RELATIONS: Dict[str, Tuple[str, str, Tuple[str, str]]] = {
    "born_in": ("person", "city", ("{h} was born in {t}.", "{h} grew up in {t}, the city of {h_pos} birth.")),
    "works_at": ("person", "organisation", ("{h} works at the {t}.", "{h} is employed by the {t}.")),
    "studied_at": ("person", "school", ("{h} studied at the {t}.", "{h} is a graduate of the {t}.")),
    "mentored_by": ("person", "person", ("{h} was mentored by {t}.", "Early on, {h} learned the trade from {t}.")),
    "based_in": ("organisation", "city", ("The {h} is based in {t}.", "The headquarters of the {h} are in {t}.")),
    "founded_by": ("organisation", "person", ("The {h} was founded by {t}.", "The {h} owes its founding to {t}.")),
    "written_by": ("book", "person", ('The book "{h}" was written by {t}.', '"{h}" is a book by {t}.')),
    "published_by": ("book", "publisher", ('"{h}" was published by the {t}.', 'The {t} brought out "{h}".')),
}

# question paths: (start type, relations, question template with {x})
PATHS: Tuple[Tuple[str, Tuple[str, ...], str], ...] = (
    ("person", ("works_at", "based_in"), "In which city is the organisation that {x} works at based?"),
    ("person", ("mentored_by", "born_in"), "In which city was the mentor of {x} born?"),
    ("organisation", ("founded_by", "born_in"), "In which city was the founder of the {x} born?"),
    ("book", ("written_by", "works_at"), 'Which organisation does the author of "{x}" work at?'),
    ("book", ("published_by", "based_in"), 'In which city is the publisher of "{x}" based?'),
    ("person", ("studied_at", "founded_by"), "Who founded the school where {x} studied?"),
    ("book", ("written_by", "works_at", "based_in"),
     'In which city is the organisation based where the author of "{x}" works?'),
    ("organisation", ("founded_by", "mentored_by", "born_in"),
     "In which city was the mentor of the founder of the {x} born?"),
    ("person", ("mentored_by", "works_at", "founded_by"), "Who founded the organisation where the mentor of {x} works?"),
    ("book", ("written_by", "studied_at", "based_in"), 'In which city is the school where the author of "{x}" studied?'),
)

DEFAULT_ORDER = (0, 6, 1, 7, 2, 8, 3, 9, 4, 5)
"""The round robin over PATHS: 2- and 3-hop questions alternate, so any prefix mixes both."""

NAME = r"[A-Z][a-z]+ [A-Z][a-z]+"
ORG = r"[A-Z][a-z]+ [A-Z][a-z]+"
CITY = r"[A-Z][a-z]+"
BOOK = r"[A-Z][a-z]+ [A-Z][a-z]+"


@dataclass
class World:
    """Entities by type (``person``, ``organisation`` (every org, schools and publishers too), ``school``,
    ``publisher``, ``city``, ``book``) and facts ``(head, relation, tail)``."""

    entities: Dict[str, List[str]]
    facts: List[Tuple[str, str, str]] = field(default_factory=list)
    female: Dict[str, bool] = field(default_factory=dict)

    def value(self, head: str, relation: str) -> str:
        for h, r, t in self.facts:
            if h == head and r == relation:
                return t
        raise KeyError(f"{head} has no {relation}")

    def type_of(self, name: str) -> str:
        for kind in ("person", "school", "publisher", "organisation", "city", "book"):
            if name in self.entities[kind]:
                return kind
        raise KeyError(name)


def make_world(seed: int = 0, people: int = 40, organisations: int = 12, schools: int = 4, publishers: int = 4,
               cities: int = 12, books: int = 20) -> World:
    """A seeded world (see the module docstring)."""
    rng = random.Random(stable_seed(seed, "multihop-world"))
    names = [f"{a} {b}" for a in FIRST for b in LAST]
    rng.shuffle(names)
    persons = sorted(names[:people], key=names.index)
    if people > len(names) or cities > len(CITIES):
        raise ValueError(f"multihop world: at most {len(names)} people and {len(CITIES)} cities")
    city = rng.sample(CITIES, cities)
    used = set()

    def org_names(kind: str, n: int) -> List[str]:
        out = []
        while len(out) < n:
            name = f"{rng.choice(ORG_WORDS)} {rng.choice(ORG_KINDS[kind])}"
            if name not in used:
                used.add(name)
                out.append(name)
        return out

    orgs, sch, pub = org_names("organisation", organisations), org_names("school", schools), org_names("publisher",
                                                                                                         publishers)
    titles = [f"{a} {b}" for a in BOOK_A for b in BOOK_B]
    book = rng.sample(titles, books)
    world = World({"person": persons, "organisation": orgs + sch + pub, "school": sch, "publisher": pub,
                   "city": city, "book": book})
    world.female = {p: rng.random() < 0.5 for p in persons}
    for p in persons:
        world.facts += [(p, "born_in", rng.choice(city)), (p, "works_at", rng.choice(orgs + pub)),
                        (p, "studied_at", rng.choice(sch)), (p, "mentored_by", rng.choice([q for q in persons if q != p]))]
    for o in orgs + sch + pub:
        world.facts += [(o, "based_in", rng.choice(city)), (o, "founded_by", rng.choice(persons))]
    for b in book:
        world.facts += [(b, "written_by", rng.choice(persons)), (b, "published_by", rng.choice(pub))]
    return world


def _sentence(world: World, head: str, relation: str, tail: str, rng: random.Random) -> str:
    phrasing = rng.choice(RELATIONS[relation][2])
    pos = "her" if world.female.get(head) else "his"
    return phrasing.format(h=head, t=tail, h_pos=pos)


def world_documents(world: World, seed: int = 0, filler: int = 2) -> Tuple[List[Dict[str, Any]], Dict[tuple, str]]:
    """``(documents, where)``: one document per person, organisation and book (``id``, ``title``, ``text``; the
    entity's facts and ``filler`` sentences without a relation, shuffled) and ``where[(head, relation)]`` = the
    sentence stating that fact."""
    rng = random.Random(stable_seed(seed, "multihop-docs"))
    docs, where = [], {}
    subjects = world.entities["person"] + world.entities["organisation"] + world.entities["book"]
    for i, subject in enumerate(subjects):
        kind = world.type_of(subject)
        sentences = []
        for h, r, t in world.facts:
            if h == subject:
                s = _sentence(world, h, r, t, rng)
                where[(h, r)] = s
                sentences.append(s)
        pool = HOBBIES if kind == "person" else MONTHS
        picks = rng.sample(pool, filler) if filler <= len(pool) else [rng.choice(pool) for _ in range(filler)]
        for pick in picks:
            if kind == "person":
                sentences.append(f"In {'her' if world.female[subject] else 'his'} spare time {subject} enjoys {pick}.")
            elif kind == "book":
                sentences.append(f'Readers often recommend "{subject}" for a {pick} evening.')
            else:
                sentences.append(f"The {subject} holds an open day every {pick}.")
        rng.shuffle(sentences)
        prefix = {"person": "p", "book": "b"}.get(kind, "o")
        docs.append({"id": f"{prefix}{i:03d}", "title": subject, "text": " ".join(sentences)})
    return docs, where


def make_questions(world: World, where: Dict[tuple, str], docs: List[Dict[str, Any]], n: int, seed: int = 0,
                   paths: Tuple[int, ...] = (), allow_fewer: bool = False) -> List[Dict[str, Any]]:
    """``n`` questions over ``PATHS`` (round robin in :data:`DEFAULT_ORDER`, or over the given path indices),
    each with its answer, hop count, path, and gold supporting facts (``doc`` id and ``sentence``), distinct start entities per path where possible;
    ``allow_fewer``: stop with what a small world allows instead of raising."""
    rng = random.Random(stable_seed(seed, "multihop-questions"))
    doc_of = {d["title"]: d["id"] for d in docs}
    chosen = list(paths) or list(DEFAULT_ORDER)
    out, seen = [], set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 1000:
            if allow_fewer:
                return out
            raise ValueError(f"multihop: could not make {n} distinct questions from this world; make it larger")
        p = chosen[len(out) % len(chosen)]
        start_type, rels, template = PATHS[p]
        x = rng.choice(world.entities[start_type])
        if (p, x) in seen:
            continue
        node, gold, chain = x, [], [x]
        for r in rels:
            gold.append({"doc": doc_of[node], "sentence": where[(node, r)], "fact": [node, r, world.value(node, r)]})
            node = world.value(node, r)
            chain.append(node)
        if len(set(chain)) < len(chain) or len({g["doc"] for g in gold}) < len(gold):
            continue  # a chain through the same entity twice is not multi-hop
        seen.add((p, x))
        out.append({"id": f"mh-{len(out):03d}", "task": "multihop", "question": template.format(x=x),
                    "answers": [node], "answer_mode": "any", "hops": len(rels), "path": list(rels), "chain": chain,
                    "gold": gold, "documents": None})
    return out


def extraction_patterns() -> List[Dict[str, str]]:
    """One regex per relation phrasing (named groups ``head`` and ``tail``), with the relation and the entity
    types: the rule-based extractor's input (JSON-serialisable)."""
    slot = {"person": NAME, "organisation": ORG, "school": ORG, "publisher": ORG, "city": CITY, "book": BOOK}
    out = []
    for rel, (htype, ttype, phrasings) in RELATIONS.items():
        for ph in phrasings:
            pattern = ph.replace(".", r"\.").replace("{h_pos}", r"(?:his|her)")
            pattern = pattern.replace("{h}", f"(?P<head>{slot[htype]})", 1).replace("{h}", "(?P=head)")
            pattern = pattern.replace("{t}", f"(?P<tail>{slot[ttype]})", 1)
            out.append({"relation": rel, "pattern": pattern, "head_type": htype, "tail_type": ttype,
                        "description": rel.replace("_", " ")})
    return out
