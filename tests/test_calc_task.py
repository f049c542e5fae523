from __future__ import annotations

import pytest

from lightning_ray.tasks import calc


def test_tasks_are_deterministic_and_answers_correct():
    tasks = calc.make_tasks(50, seed=3)
    assert tasks == calc.make_tasks(50, seed=3)
    for t in tasks:
        a, op, b = t.input["question"].removeprefix("What is ").removesuffix("?").split()
        assert t.input["answer"] == (int(a) + int(b) if op == "+" else int(a) - int(b))


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "2**100", "open('x')", "1/0"])
def test_calculator_evaluates_nothing_but_arithmetic(expr):
    with pytest.raises((ValueError, SyntaxError)):
        calc.calculate(expr)


def test_reward_is_exact_match():
    task = {"question": "What is 2 - 5?", "answer": -3}
    assert calc.reward(task, "-3") == 1.0
    assert calc.reward(task, "3") == 0.0
    assert calc.reward(task, None) == 0.0
