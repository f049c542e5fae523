from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from lightning_ray.config import ConfigError, TaskConfig
from lightning_ray.models.tiny import EASY, build_tokenizer
from lightning_ray.tasks import calc, load_splits
from lightning_ray.tracing import semconv


def test_tasks_are_deterministic_json_safe_and_scored_by_their_generator():
    tasks = calc.make_tasks(200, seed=3)
    assert tasks == calc.make_tasks(200, seed=3)
    assert [t.task_id for t in tasks[:2]] == ["basic_arithmetic-3-0", "basic_arithmetic-3-1"]
    assert len({t.input["question"] for t in tasks}) == 200
    for t in tasks:
        assert json.loads(json.dumps(t.reference)) == t.reference  # tuples in the generator's metadata became lists
        assert (t.input["dataset"], t.input["protocol"]) == ("basic_arithmetic", "tools")
        assert set(t.input) == {"question", "dataset", "protocol"}  # the agent's: the answer is not among them
        # our calculator, on the generator's own expression, gives the generator's answer
        assert str(calc.calculate(t.reference["metadata"]["expression"])) == t.reference["answer"]
    word = calc.make_tasks(3, seed=3, dataset="gsm_symbolic", protocol="text")
    assert word == calc.make_tasks(3, seed=3, dataset="gsm_symbolic", protocol="text")
    assert word[0].task_id == "gsm_symbolic-3-0" and word[0].input["protocol"] == "text"
    with pytest.raises(ValueError, match="supports"):
        calc.make_tasks(1, seed=0, dataset="chess")


def test_exclude_keeps_training_disjoint_from_held_out():
    held_out = calc.make_tasks(100, seed=1)
    questions = {t.input["question"] for t in held_out}
    # reasoning-gym seeds item i with seed + i: neighbouring seeds share most of their items
    assert questions & {t.input["question"] for t in calc.make_tasks(300, seed=0)}
    train = calc.make_tasks(300, seed=0, exclude=questions)
    assert len(train) == 300 and not questions & {t.input["question"] for t in train}
    # a generator with fewer distinct questions than asked for is an error, not an endless loop
    tiny_space = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                  "allow_parentheses": False, "allow_negation": False}
    with pytest.raises(ValueError, match="distinct questions"):
        calc.make_tasks(500, seed=0, options=tiny_space)


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "2**100", "open('x')", "1/0", "x + 1",
                                  "(1).real", "True + 1", "1j * 2", "9" * 300, "1e200 * 1e200 / 3"])
def test_calculator_evaluates_nothing_but_arithmetic(expr):
    with pytest.raises((ValueError, SyntaxError)):
        calc.calculate(expr)


@pytest.mark.parametrize("expr, value", [("-( 20 + 67 + -59 )", -28), ("85 / 17", 5), ("-9 / 9", -1), ("7 / 2", 3.5),
                                         ("1 / 3", 0.333333), ("2 * -3 - -1", -5), ("0.1 + 0.2", 0.3)])
def test_calculator_divides_exactly(expr, value):
    result = calc.calculate(expr)
    assert result == value and type(result) is type(value)  # whole results are ints, as the generators write them


def test_reward_is_the_answers_number_exactly():
    [task] = calc.make_tasks(1, seed=0)
    assert (task.input["question"], task.reference["answer"]) == ("Calculate -33 / 11 + -22.", "-25")
    for right in ("-25", "-25.0", " -25 ", -25):  # however written, by any agent
        assert calc.reward(task.reward_input, right) == 1.0
    # the generator's scorer gave an answer containing the reference partial credit ("-250": 0.75, and "25" for
    # "-25" or "-2" for "2" 0.5: always writing a minus sign paid)
    for wrong in ("-24", "-250", "25", "-2", "ANSWER -25", "1/0", "", None, "-25e0", "1e999999999"):  # no 10**1e9
        assert calc.reward(task.reward_input, wrong) == 0.0
    [word] = calc.make_tasks(1, seed=0, dataset="gsm_symbolic")
    assert calc.reward(word.reward_input, word.reference["answer"]) == 1.0
    assert calc.reward(word.reward_input, None) == 0.0


def test_gsm_symbolics_splits_load_whole():
    """Its metadata holds fractions (a serving_fraction), which JSON refused: task=calc_gsm failed at its start."""
    train, held_out = load_splits(TaskConfig(dataset="gsm_symbolic", train_size=200))
    assert (len(train), len(held_out)) == (200, 100) and any(
        "serving_fraction" in t.reference["metadata"]["variables"] for t in train + held_out)


def test_a_problem_is_in_one_split_however_it_is_worded():
    """format_style=natural words one expression many ways ("What is ...", "Solve ..."): 41 of 100 held-out
    expressions were in training, told apart by their questions only."""
    cfg = TaskConfig(generator={**EASY, "format_style": "natural"}, train_size=200)
    train, held_out = load_splits(cfg)
    problems = [t.reference["problem"] for t in train]
    assert len(set(problems)) == 200 and not set(problems) & {t.reference["problem"] for t in held_out}


def test_only_problems_the_calculator_agrees_with_are_drawn():
    """basic_arithmetic's generator divides with floor division: with four terms some answers were not the
    calculator's ("Calculate 8 / -( 5 * -8 + -39 )." is 0 there), so an agent using the tool right scored 0."""
    for t in calc.make_tasks(1000, seed=0, options={"max_terms": 4}):
        assert str(calc.calculate(t.reference["metadata"]["expression"])) == t.reference["answer"]


def test_a_generator_option_it_has_not_is_a_config_error_naming_task():
    with pytest.raises(ConfigError, match="task: the calc task's basic_arithmetic: .*no_such_option"):
        load_splits(TaskConfig(generator={"no_such_option": 1}))


def test_the_cached_tiny_model_has_the_tokenizer_a_fresh_machine_builds(tiny_model_path):
    """The model's cache key names every source its build reads (models/__init__.py): a warm machine whose cache
    predates a change of the chat template kept testing the old model, where CI's fresh one built another."""
    cached, fresh = AutoTokenizer.from_pretrained(tiny_model_path), build_tokenizer()
    assert cached.get_vocab() == fresh.get_vocab() and cached.chat_template == fresh.chat_template


@pytest.fixture(scope="module")
def server(policy_app):
    with policy_app(rollout={"temperature": 0.0, "max_tokens": 96}, engine={"max_model_len": 1024}) as app:
        yield app


@pytest.mark.parametrize("protocol", ["tools", "text"])
def test_agent_runs_the_calculator_through_a_served_model(server, tiny_model_path, protocol):
    """The tiny model, greedy: the agent's calls are recorded under the rollout, the calculator's result is in the
    second prompt, and the answer is read from the second reply."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for task in calc.make_tasks(20, seed=5, options=EASY, protocol=protocol):  # the tiny model misses many: take
        rid = server["new_rollout"]()                                         # the first it calls the tool on
        answer = calc.agent(task.input, base_url=f"{server['url']}/rollouts/{rid}/attempts/at-1/v1", model="tiny-calc")
        calls = sorted((s for s in server["store"].query_spans([rid]) if s.name == semconv.LLM_CALL),
                       key=lambda s: s.start_time)
        if len(calls) == 2:
            break
    assert len(calls) == 2
    first, second = (c.attributes["lightning_ray.response"] for c in calls)
    prompt = tokenizer.decode(calls[1].attributes[semconv.PROMPT_TOKEN_IDS])
    if protocol == "tools":
        call = json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", first).group(1))
        assert call["name"] == "calculator" and "# Tools" in prompt
        result = calc._evaluate(call["arguments"]["expression"])  # what the tool answered, an error included
        assert f"<|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>" in prompt
    else:
        result = calc._evaluate(re.fullmatch(r"CALC (.*)", first).group(1))
        assert f"<|im_start|>user\nRESULT {result}<|im_end|>" in prompt and "# Tools" not in prompt
    assert second == f"ANSWER {answer}" and re.fullmatch(r"-?\d+", answer)
