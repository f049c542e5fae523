"""The rag task's parts, real ones: the generated world and its questions, retrieval with the packaged
all-MiniLM-L6-v2 embeddings, the format + F1 reward, and the MuSiQue loader on a small file written here."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from lightning_ray.config import TaskConfig
from lightning_ray.tasks import load_splits, rag
from lightning_ray.tasks.rag.musique import MusiqueFormatError, read_musique
from lightning_ray.tasks.rag.retrieval import Index, embedder
from lightning_ray.tasks.rag.world import TEMPLATES, make_world


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Embedding one query at a time on 2 shared cores: 2 torch threads wait on each other (~15x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_world_and_its_questions_are_deterministic():
    world = make_world(0, 500)
    rebuilt = make_world.__wrapped__(0, 500)  # not the cached object: built again from the seed
    assert rebuilt == world and len(set(world.documents)) == len(world.documents) == 500 * 2 + 50 + 41
    assert make_world.__wrapped__(1, 500).documents != world.documents
    assert len(set(world.people)) == 500 and not set(world.people) & {f.object for f in world.facts}
    tasks = rag.make_tasks(50, seed=3)
    assert tasks == rag.make_tasks(50, seed=3) and tasks != rag.make_tasks(50, seed=4)
    assert len({t.task_id for t in tasks}) == 50


def test_each_question_is_answered_by_following_its_supporting_facts():
    documents = make_world(0, 500).documents
    facts = {f.text: f for f in make_world(0, 500).facts}
    for t in rag.make_tasks(200, seed=0, options={"templates": list(TEMPLATES)}):
        hops = [facts[documents[i]] for i in t.reference["supporting"]]
        assert len(hops) == len(TEMPLATES[t.input["template"]][1])
        assert hops[0].subject in t.input["question"]  # the first hop is about the person asked about
        assert all(a.object == b.subject for a, b in zip(hops, hops[1:]))  # each hop starts where the last ended
        assert t.reference["answers"] == [hops[-1].object] and not set(rag.REFERENCE) & set(t.input)
        # the answer is nowhere in the question: it has to be looked up
        assert rag.f1(t.input["question"], hops[-1].object) == 0.0


def test_training_and_held_out_splits_share_no_question():
    cfg = TaskConfig(name="rag", dataset="facts", protocol="tools", train_size=850, eval_size=100)
    train, held_out = load_splits(cfg)
    assert (len(train), len(held_out)) == (850, 100)
    questions = {t.input["question"] for t in held_out}
    assert not questions & {t.input["question"] for t in train}
    assert questions & {t.input["question"] for t in rag.make_tasks(850, seed=0)}  # exclude did remove some
    with pytest.raises(ValueError, match="has 900 questions outside `exclude`; 1000 were asked for"):
        rag.make_tasks(1000, seed=0, exclude=questions)  # 500 people × 2 templates, 100 held out


def test_the_system_prompt_is_the_tasks_unless_the_run_gives_one():
    cfg = TaskConfig(name="rag", dataset="facts", protocol="tools", train_size=2, eval_size=2, system_prompt="Be brief.")
    train, held_out = load_splits(cfg)
    assert [rag.system_prompt(t.input) for t in train + held_out] == ["Be brief."] * 4
    assert rag.system_prompt(rag.make_tasks(1, seed=0)[0].input) == rag.INSTRUCTIONS


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="supports facts, musique"):
        rag.make_tasks(1, seed=0, dataset="basic_arithmetic")
    with pytest.raises(ValueError, match="task.protocol=tools"):
        rag.make_tasks(1, seed=0, protocol="text")
    with pytest.raises(ValueError, match="unknown option.*: size"):
        rag.make_tasks(1, seed=0, options={"size": 3})
    with pytest.raises(ValueError, match="unknown template.*: birth_city"):
        rag.make_tasks(1, seed=0, options={"templates": ["birth_city"]})
    # one name as text, as the command line gives it (templates=birth_country): that name, not its letters
    assert rag.make_tasks(3, seed=0, options={"templates": "birth_country"}) == \
        rag.make_tasks(3, seed=0, options={"templates": ["birth_country"]})
    with pytest.raises(ValueError, match="needs task.generator.path"):
        rag.make_tasks(1, seed=0, dataset="musique")


def test_embeddings_are_unit_vectors_that_rank_by_meaning():
    embed = embedder()
    vectors = embed(["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."])
    assert vectors.shape == (3, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert vectors[0] @ vectors[1] > 0.6 > 0.2 > vectors[0] @ vectors[2]
    assert np.allclose(embed(["A man is eating food."])[0], vectors[0], atol=1e-5)  # padding changes nothing


@pytest.fixture(scope="module")
def world_index(tmp_path_factory):
    cache = tmp_path_factory.mktemp("embeddings")
    built = Index.build(make_world(0, 500).documents, cache_dir=cache)
    [saved] = cache.iterdir()
    written = saved.stat().st_mtime_ns
    reread = Index.build(make_world(0, 500).documents, cache_dir=cache)  # from the file, not embedded again
    assert np.array_equal(reread.vectors, built.vectors)
    assert list(cache.iterdir()) == [saved] and saved.stat().st_mtime_ns == written
    return reread


def test_retrieval_finds_the_supporting_fact_of_every_hop(world_index):
    """Each hop asked as its own question (the decomposition a searching agent writes) finds that hop's fact among
    the TOP_K passages; the whole question finds the first hop's fact almost always (dense retrieval on a
    question about two things now and then ranks the other thing's facts higher: 2 of 60 here)."""
    documents = world_index.documents
    tasks = rag.make_tasks(60, seed=0, options={"templates": list(TEMPLATES)})
    for t in tasks:
        for query, position in zip(t.reference["decomposition"], t.reference["supporting"], strict=True):
            assert documents[position] in world_index.search(query, rag.TOP_K), query
    first_hop = [documents[t.reference["supporting"][0]] in world_index.search(t.input["question"], rag.TOP_K)
                 for t in tasks]
    assert sum(first_hop) >= 0.9 * len(tasks)


def test_agents_in_threads_search_one_index(world_index):
    """A rollout worker's agents share its index and its model from several threads: each gets its own answer."""
    queries = [q for t in rag.make_tasks(12, seed=5) for q in t.reference["decomposition"]]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(world_index.search, queries)) == [world_index.search(q) for q in queries]


def test_reward_is_format_plus_answer_f1():
    assert rag.normalize("The  Drolmoia Trading, Ltd.!") == "drolmoia trading ltd"
    assert rag.f1("the city of Zenmor", "Zenmor") == pytest.approx(0.5)  # precision 1/3, recall 1
    assert rag.f1("Keza Works", "Keza Foundry") == pytest.approx(0.5)  # precision 1/2, recall 1/2
    assert rag.f1("", "") == 1.0 and rag.f1("the", "Zenmor") == 0.0
    task = {"answers": ["Drolmoia"]}
    assert rag.reward(task, "ANSWER: Drolmoia") == 1.0
    assert rag.reward(task, "I searched twice.\nANSWER: drolmoia.") == 1.0  # normalized; the ANSWER line is read
    assert rag.reward(task, "ANSWER: Zenmor\nANSWER: Drolmoia") == 1.0  # the last ANSWER line counts
    assert rag.reward(task, "ANSWER Drolmoia") == rag.reward(task, "ANSWER:Drolmoia") == 1.0  # colon optional
    assert rag.reward(task, "Drolmoia") == pytest.approx(0.9)  # right, but not in the format
    assert rag.reward(task, "It is Drolmoia") == pytest.approx(0.9 * 0.5)  # the whole reply is the answer
    assert rag.reward(task, "ANSWER: Zenmor") == pytest.approx(0.1)  # the format alone
    assert rag.reward(task, "The ANSWER: Drolmoia") == pytest.approx(0.9 * 2 / 3)  # not a line of its own
    assert rag.reward(task, "ANSWER:") == 0.0 and rag.reward(task, None) == 0.0
    aliases = {"answers": ["United States", "USA"]}
    assert rag.reward(aliases, "ANSWER: USA") == 1.0
    assert rag.reward(aliases, "ANSWER: the United States of America") == pytest.approx(0.1 + 0.9 * 2 / 3)


def _paragraph(idx, title, text, supporting=False):
    return {"idx": idx, "title": title, "paragraph_text": text, "is_supporting": supporting}


MUSIQUE = [
    {"id": "2hop__1_2", "question": "In which country is the city where Mira Tolvane was born?",
     "question_decomposition": [{"id": 1, "question": "Where was Mira Tolvane born?", "answer": "Ostrel",
                                 "paragraph_support_idx": 2},
                                {"id": 2, "question": "In which country is Ostrel?", "answer": "Vandemar",
                                 "paragraph_support_idx": 0}],
     "paragraphs": [_paragraph(2, "Mira Tolvane", "Mira Tolvane is a painter, born in Ostrel in 1911.", True),
                    _paragraph(0, "Ostrel", "Ostrel is a port city in the north of Vandemar.", True),
                    _paragraph(1, "Kessa Run", "Kessa Run is a river that floods every spring.")],
     "answer": "Vandemar", "answer_aliases": ["Republic of Vandemar"], "answerable": True},
    {"id": "2hop__3_4", "question": "Who founded the company that makes the Lumo lamp?",
     "paragraphs": [_paragraph(0, "Lumo", "The Lumo lamp is made by Brightwell.")],
     "answer": "", "answer_aliases": [], "answerable": False},
    {"id": "3hop1__5_6_7", "question": "What river runs through the birthplace of the founder of Brightwell?",
     "paragraphs": [_paragraph(0, "Brightwell", "Brightwell was founded by Ada Quorn.", True),
                    _paragraph(1, "Ada Quorn", "Ada Quorn was born in Lisk.", True),
                    _paragraph(2, "Lisk", "The Kessa Run flows through Lisk.", True)],
     "answer": "Kessa Run", "answer_aliases": [], "answerable": True},
]


def test_musique_files_load_as_tasks_with_their_own_paragraphs(tmp_path):
    path = tmp_path / "musique_ans_v1.0_dev.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in MUSIQUE) + "\n\n")
    records = read_musique(path)
    assert [r["id"] for r in records] == ["2hop__1_2", "3hop1__5_6_7"]  # the unanswerable one is left out
    first = records[0]
    assert [p["title"] for p in first["paragraphs"]] == ["Ostrel", "Kessa Run", "Mira Tolvane"]  # by idx
    assert first["supporting"] == [0, 2] and first["answers"] == ["Vandemar", "Republic of Vandemar"]

    tasks = rag.make_tasks(2, seed=0, dataset="musique", options={"path": str(path)})
    assert sorted(t.task_id for t in tasks) == ["2hop__1_2", "3hop1__5_6_7"]
    [task] = [t.reward_input for t in tasks if t.task_id == "2hop__1_2"]
    corpus = rag.index(task)
    assert corpus.documents == rag.documents(task) and corpus.documents[0].startswith("Ostrel: ")
    for hop, position in zip(MUSIQUE[0]["question_decomposition"], (2, 0)):  # each hop finds its paragraph first
        assert corpus.search(hop["question"], 1) == [corpus.documents[position]]
    assert rag.reward(task, "ANSWER: the Republic of Vandemar") == 1.0

    held_out = rag.make_tasks(1, seed=1, dataset="musique", options={"path": str(path)})
    train = rag.make_tasks(1, seed=0, dataset="musique", options={"path": str(path)},
                           exclude={held_out[0].input["question"]})
    assert train[0].input["question"] != held_out[0].input["question"]
    with pytest.raises(ValueError, match="has 0 questions outside `exclude`"):
        rag.make_tasks(1, seed=0, dataset="musique", options={"path": str(path)},
                       exclude={r["question"] for r in MUSIQUE})


def test_a_malformed_musique_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MUSIQUE[0]) + "\n" + json.dumps({"id": "x", "question": "q?"}) + "\n")
    with pytest.raises(MusiqueFormatError, match=r"bad.jsonl:2: not a MuSiQue record \(KeyError: 'paragraphs'\)"):
        read_musique(path)
