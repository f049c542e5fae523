"""A generated world of invented people, companies, cities and countries, written as one-sentence facts, and the
multi-hop questions it answers ("In which country was Delste Burme born?": where Delste Burme was born, then which
country that city is in). The names are made of random syllables, so no model knows an answer from pretraining:
it has to be retrieved, one hop at a time. Everything is a function of (seed, people): the same arguments give
the same world on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache

_ONSETS = ("b", "br", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s")
_CITY = ("mor", "vik", "ford", "heim", "dell", "grad", "wick", "stead")
_COUNTRY = ("ia", "land", "ara", "estan", "onia")
_COMPANY = ("Works", "Labs", "Foundry", "Trading", "Mills", "Systems")

# One sentence per fact: the documents the retrieval tool searches.
SENTENCES = {"born_in": "{} was born in {}.", "works_for": "{} works for {}.", "founded_in": "{} was founded in {}.",
             "located_in": "{} is a city in {}."}
# Question templates: the relations followed from a person, in order; the answer is where the chain ends.
TEMPLATES = {
    "birth_country": ("In which country was {} born?", ("born_in", "located_in")),
    "employer_city": ("In which city was the company that {} works for founded?", ("works_for", "founded_in")),
    "employer_country": ("In which country was the company that {} works for founded?",
                         ("works_for", "founded_in", "located_in")),
}
# Each hop as a single-hop question of its own (the question's decomposition, as MuSiQue records it).
HOP_QUESTIONS = {"born_in": "Where was {} born?", "works_for": "Which company does {} work for?",
                 "founded_in": "Where was {} founded?", "located_in": "In which country is {}?"}
DEFAULT_TEMPLATES = ("birth_country", "employer_city")  # two hops; employer_country (three) on request


@dataclass(frozen=True)
class Fact:
    subject: str
    relation: str
    object: str

    @property
    def text(self) -> str:
        return SENTENCES[self.relation].format(self.subject, self.object)


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    template: str
    hops: tuple[Fact, ...]  # the supporting facts, in the order they are needed

    @property
    def decomposition(self) -> list[str]:
        """One single-hop question per hop: the first names the person, each later one the entity found before."""
        return [HOP_QUESTIONS[f.relation].format(f.subject) for f in self.hops]


@dataclass(frozen=True)
class World:
    facts: tuple[Fact, ...]  # in a shuffled order: a fact's position says nothing about it
    people: tuple[str, ...]

    @property
    def documents(self) -> list[str]:
        return [f.text for f in self.facts]

    def questions(self, templates=DEFAULT_TEMPLATES) -> list[Question]:
        """Every question of these templates about every person, person by person."""
        lookup = {(f.subject, f.relation): f for f in self.facts}
        out = []
        for person in self.people:
            for name in templates:
                text, relations = TEMPLATES[name]
                hops, entity = [], person
                for relation in relations:
                    hops.append(lookup[entity, relation])
                    entity = hops[-1].object
                out.append(Question(text.format(person), entity, name, tuple(hops)))
        return out


@cache
def make_world(seed: int = 0, people: int = 500) -> World:
    """`people` people, each born in a city and working for a company; a company per 10 people, a city per 12 and a
    country per 5 cities (at least 2 of each), every company founded in a city, every city in a country."""
    rng = random.Random(f"rag-world-{seed}")
    taken: set[str] = set()

    def name(syllables: int, suffix: str = "") -> str:
        while True:
            word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
            candidate = word.capitalize() + suffix
            if candidate not in taken:
                taken.add(candidate)
                return candidate

    countries = [name(2, rng.choice(_COUNTRY)) for _ in range(max(2, people // 60))]
    cities = [name(2, rng.choice(_CITY)) for _ in range(max(2, people // 12))]
    companies = [f"{name(2)} {rng.choice(_COMPANY)}" for _ in range(max(2, people // 10))]
    persons = [f"{name(2)} {name(2)}" for _ in range(people)]
    facts = [Fact(c, "located_in", countries[i % len(countries)]) for i, c in enumerate(cities)]  # none left empty
    facts += [Fact(c, "founded_in", rng.choice(cities)) for c in companies]
    for p in persons:
        facts += [Fact(p, "born_in", rng.choice(cities)), Fact(p, "works_for", rng.choice(companies))]
    rng.shuffle(facts)
    return World(tuple(facts), tuple(persons))
