"""The trainer: the RL loop (loop.py, top to bottom) and its steps, a module each — what a run carries (run.py),
collect a batch (collect.py), update the policy (update.py), evaluate on held-out tasks (evaluate.py), log the
iteration (log.py; its record: record.py). Configured by `trainer.*`."""


def __getattr__(name: str):
    """`from lightning_ray.trainer import train`, imported on first use: a step's module (`python -m
    lightning_ray.trainer.record`, the eval job's evaluate.py) does not pull in the whole loop."""
    if name == "train":
        from lightning_ray.trainer.loop import train
        return train
    raise AttributeError(f"module 'lightning_ray.trainer' has no attribute {name!r}")
