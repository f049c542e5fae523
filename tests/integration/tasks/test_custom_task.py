"""A task of the user's own (task.name=package.module: examples/custom_task/letters.py) through the real stack: its
problems split, its default agent's calls served and recorded, its reward scoring them, the policy trained; and the
mistakes a newcomer makes with one named at once."""

from __future__ import annotations

import pytest
from helpers import small

from lightning_ray.config import ConfigError, compose
from lightning_ray.tasks import dataset_of, load_splits
from lightning_ray.trainer import train

LETTERS = "examples.custom_task.letters"


def test_a_task_module_of_ones_own_trains(ray_cluster, tiny_model_path, serve_port, tmp_path):
    cfg = small({"run_dir": str(tmp_path), "model": {"path": str(tiny_model_path)}, "serve": {"port": serve_port},
                 "task": {"name": LETTERS, "train_size": 16, "eval_size": 4},
                 "rollout": {"tasks_per_iteration": 4, "group_size": 4, "max_tokens": 16},
                 "trainer": {"iterations": 1, "eval_every": 1}})
    train_split, held_out = load_splits(cfg.task)
    assert not {t.input["question"] for t in train_split} & {t.input["question"] for t in held_out}
    assert dataset_of(cfg.task) == "words"  # its make_tasks' default, task.dataset left null
    [h] = train(cfg)
    assert h["rollouts"] == 16 and h["failed_rollouts"] == 0 and h["policy_calls"] == 16  # one call each
    assert h["transitions"] == 16 and h["policy_version"] == int(h["updated"])
    assert h["eval"]["tasks"] == 4 and 0.0 <= h["eval"]["accuracy"] <= 1.0


@pytest.mark.parametrize("override, named", [
    ("task.name=examples.no_such_task", "task.name=examples.no_such_task: not a built-in task"),
    ("task.name=os.path", "task.name=os.path: the module has no make_tasks or reward"),
    ("task.name=Calc", "task.name"),  # neither a built-in nor a module path
    (f"task.name={LETTERS} task.dataset=sentences", "task: the letters task has one dataset"),
])
def test_a_task_module_that_cannot_serve_is_named(tmp_path, override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("(", r"\(")):
        load_splits(compose([f"run_dir={tmp_path}", *override.split()]).task)
