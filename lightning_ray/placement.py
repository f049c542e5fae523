"""Where each component runs on a Ray cluster, and where its results land.

Resources are written as Ray Train's `resources_per_worker` is: {"CPU": 1, "GPU": 1, "trainer_gpu": 1}, custom
resources included, so one shape serves the config of every component; `actor_options` turns one into the
num_cpus / num_gpus / resources that actors and Serve replicas take."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Every head node carries this resource (Ray's own Train state actor is pinned with it): a sliver of it puts an
# actor on the head without taking anything the head schedules.
ON_HEAD = {"resources": {"node:__internal_head__": 0.001}}


def actor_options(resources: dict[str, float]) -> dict:
    """{"CPU": 1, "GPU": 1, "x": 2} -> {"num_cpus": 1, "num_gpus": 1, "resources": {"x": 2}}; an unnamed CPU
    stays at the actor's own default."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    options = {key: resources[name] for name, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")) if name in resources}
    return {**options, "resources": custom} if custom else options


def share_a_gpu(a: dict[str, float], b: dict[str, float]) -> bool:
    """Whether Ray may put two components with these resources on one GPU: each asks for a fraction of one (it
    lets two actors share a GPU only so: placement=colocated)."""
    return 0 < a.get("GPU", 0) < 1 and 0 < b.get("GPU", 0) < 1


def job_working_dir() -> str | None:
    """The working_dir a `ray job submit` gave this driver, if any: then the current directory is Ray's temporary
    copy of it, deleted with the cluster, and no place for results."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
    return job.get("runtime_env", {}).get("working_dir")


def results_base() -> Path:
    """What a relative run directory is relative to: the directory the job was started from, or, under a submitted
    job with a working_dir, ~/lightning_ray on the driver's node (the head)."""
    return Path.home() / "lightning_ray" if job_working_dir() else Path.cwd()
