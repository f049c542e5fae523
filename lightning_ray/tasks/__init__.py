"""Built-in tasks. Each module offers make_tasks(n, seed, dataset, options, protocol, exclude), agent(task, base_url,
model, api_key), reward(task, answer) and, where one prompt opens its agent, system_prompt(task): that prompt, the
task's own unless task["system_prompt"] gives one (set from task.system_prompt here, or by the prompt optimizer). The
agent gets Task.input; the expected answer is in Task.reference, and reward() gets both (Task.reward_input); so does
oracle(task, messages, tools), the imitation teacher's answer to a call from the gold data (serving/teacher.py).
A reference's "problem", where a task gives one, names the problem whatever its wording: make_tasks excludes it too."""

import importlib
import inspect
from types import ModuleType

from lightning_ray.config import ConfigError, TaskConfig
from lightning_ray.types import Task


BUILT_IN = ("calc", "sql", "rag")


def load_task(name: str) -> ModuleType:
    """A built-in task by its name, or your own by its module's ("package.module"): a ConfigError naming task.name
    where it cannot be imported or lacks make_tasks or reward."""
    try:
        task = importlib.import_module(f"lightning_ray.tasks.{name}" if name in BUILT_IN else name)
    except ImportError as e:
        raise ConfigError(f"task.name={name}: not a built-in task ({', '.join(BUILT_IN)}), and its module cannot be "
                          f"imported: {e}") from None
    if missing := [f for f in ("make_tasks", "reward") if not callable(getattr(task, f, None))]:
        raise ConfigError(f"task.name={name}: the module has no {' or '.join(missing)} (docs/03-agents-and-tasks.md, "
                          "Your own task)")
    return task


def dataset_of(cfg: TaskConfig) -> str | None:
    """task.dataset, or the task's default where it is null (make_tasks' own default, if it has one)."""
    default = inspect.signature(load_task(cfg.name).make_tasks).parameters.get("dataset")
    return cfg.dataset or (default.default if default and default.default is not inspect.Parameter.empty else None)


def checked_options(task: str, dataset: str, options: dict | None, allowed: dict[str, set[str]]) -> dict:
    """A task's generator options for `dataset` (allowed: each dataset's option names), or a ValueError that names
    the unknown dataset or options."""
    if dataset not in allowed:
        raise ValueError(f"dataset {dataset!r}: the {task} task supports {', '.join(allowed)}")
    options = dict(options or {})
    if unknown := set(options) - allowed[dataset]:
        raise ValueError(f"unknown option(s) for the {task} task's {dataset}: {', '.join(sorted(unknown))} "
                         f"(expected {', '.join(sorted(allowed[dataset]))})")
    return options


def load_splits(cfg: TaskConfig) -> tuple[list[Task], list[Task]]:
    """The training split and the held-out split: different seeds, and no held-out question in training. A setting
    the task refuses (a dataset, a protocol, a generator option of another task) is a ConfigError naming task."""
    task = load_task(cfg.name)
    options = {"options": cfg.generator or None, "protocol": cfg.protocol,
               **({"dataset": cfg.dataset} if cfg.dataset else {})}  # (none: the task's default)
    try:
        held_out = task.make_tasks(cfg.eval_size, cfg.eval_seed, **options)
        # none of its questions, nor its problems worded otherwise (reference["problem"], where a task gives one)
        exclude = {key for t in held_out for key in (t.input["question"], t.reference.get("problem")) if key}
        train = task.make_tasks(cfg.train_size, cfg.seed, exclude=exclude, **options)
    except (ValueError, TypeError) as e:  # TypeError: an option of the wrong kind (people=[3])
        raise ConfigError(f"task: {e}") from e
    if cfg.balance and (lacking := next((t for t in train if cfg.balance not in t.input), None)):
        raise ValueError(f"task.balance={cfg.balance}: the {cfg.name} task's inputs have no such field "
                         f"(they have {', '.join(lacking.input)})")
    if cfg.system_prompt is not None:
        if not hasattr(task, "system_prompt"):  # set and never read: the run would not be what it says
            raise ConfigError(f"task.system_prompt: the {cfg.name} task's agents have prompts of their own, "
                              "none it takes from the task")
        train, held_out = ([t.model_copy(update={"input": {**t.input, "system_prompt": cfg.system_prompt}})
                            for t in split] for split in (train, held_out))
    return train, held_out
