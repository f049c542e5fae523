"""The jobs' configuration: every config group option and experiment preset composes and validates, every override
the README and docs/ show works as written, dict overrides replace, bad keys and values fail by name before anything
starts, `--cfg job` prints the resolved config, and the run directory's record of it has its secrets masked."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT
import yaml
from omegaconf import OmegaConf

from lightning_ray.config import APOJobConfig, ConfigError, TrainConfig, compose, masked, validate

CONFIGS = ROOT / "configs"
GROUPS = ["model", "engine", "task", "algorithm", "trainer", "store", "cluster", "placement"]


def run_job(*args: str, job: str = "train") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"jobs/{job}.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in options(g)])
def test_each_group_option_composes_and_validates(group, option, tmp_path):
    cfg = compose([f"{group}={option}", f"run_dir={tmp_path}"])
    text = (CONFIGS / group / f"{option}.yaml").read_text()
    chosen = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k != "defaults"}
    resolved = cfg.model_dump(mode="json")
    if "# @package _global_" not in text:  # the option's keys are its group's (cluster's are ray.*)
        resolved = resolved["ray" if group == "cluster" else group]
    # the option's own values reach the validated config (those it inherits are checked as their own option)
    assert within(chosen, resolved)


def within(chosen, resolved) -> bool:
    """Every value `chosen` sets is the one `resolved` has (dicts: key by key, the rest left as resolved)."""
    if isinstance(chosen, dict) and isinstance(resolved, dict):
        return all(k in resolved and within(v, resolved[k]) for k, v in chosen.items())
    return chosen == resolved


@pytest.mark.parametrize("experiment", options("experiment"))
@pytest.mark.parametrize("job, schema", [("train", TrainConfig), ("apo", APOJobConfig)])
def test_each_experiment_composes_and_validates(experiment, job, schema, tmp_path):
    cfg = compose([f"experiment={experiment}", f"run_dir={tmp_path}"], job, schema)
    preset = yaml.safe_load((CONFIGS / "experiment" / f"{experiment}.yaml").read_text())
    expected = OmegaConf.create()  # each group option the preset picks, then the preset's own values over them
    for entry in preset.get("defaults", []):
        if isinstance(entry, dict) and (override := next(iter(entry))).startswith("override /"):
            group, option = override.removeprefix("override /"), entry[override]
            text = (CONFIGS / group / f"{option}.yaml").read_text()
            chosen = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k != "defaults"}
            expected = OmegaConf.merge(expected, chosen if "# @package _global_" in text else {group: chosen})
    expected = OmegaConf.merge(expected, {k: v for k, v in preset.items() if k != "defaults"})
    assert within(OmegaConf.to_container(expected), cfg.model_dump(mode="json"))


def test_the_default_run_is_the_calc_smollm2_preset(tmp_path):
    default = compose([f"run_dir={tmp_path}"])
    assert compose(["experiment=calc_smollm2", f"run_dir={tmp_path}"]) == default
    assert (default.model.path, default.engine.kind, default.task.name, default.algorithm.estimator) == \
        ("smollm2-135m-instruct", "vllm", "calc", "grpo")


def test_a_preset_is_still_overridden_by_what_follows(tmp_path):
    cfg = compose(["experiment=calc_tiny", "trainer.iterations=3", "engine.max_model_len=256", f"run_dir={tmp_path}"])
    assert (cfg.model.path, cfg.engine.kind, cfg.trainer.iterations, cfg.engine.max_model_len) == (None, "hf", 3, 256)


def test_the_hf_engine_carries_no_vllm_options(tmp_path):
    cfg = compose(["engine=hf", f"run_dir={tmp_path}"])
    assert cfg.engine.kind == "hf" and cfg.engine.options == {} and cfg.engine.env == {}
    with pytest.raises(ConfigError, match="engine.options"):  # vLLM's arguments on the hf engine: named, not run
        compose(["engine=hf", "+engine.options.max_num_seqs=8", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size"):
        compose(["engine=hf", "engine.tensor_parallel_size=2", f"run_dir={tmp_path}"])


CPU_THREADS = {"OMP_NUM_THREADS": "2"}  # configs/engine/vllm.yaml


@pytest.mark.parametrize("override, env", [
    ("engine.env={}", {}),
    ("engine.env={VLLM_CPU_KVCACHE_SPACE: '2'}", {"VLLM_CPU_KVCACHE_SPACE": "2"}),  # replaced, not merged in
    ("engine.env.OMP_NUM_THREADS='1'", {"OMP_NUM_THREADS": "1"}),  # in place
    ("engine.env.OMP_NUM_THREADS=1", {"OMP_NUM_THREADS": "1"}),  # a number, as the environment has it: text
    ("+engine.env.VLLM_CPU_KVCACHE_SPACE='2'", {**CPU_THREADS, "VLLM_CPU_KVCACHE_SPACE": "2"}),
])
def test_a_dict_override_replaces_the_dict(override, env, tmp_path):
    assert compose([override, f"run_dir={tmp_path}"]).engine.env == env


def test_environment_values_given_as_numbers_or_booleans_are_their_text(tmp_path):
    cfg = compose(["+learner.env.MALLOC_ARENA_MAX=2", "+engine.env.VLLM_CPU_SGL_KERNEL=true", f"run_dir={tmp_path}"])
    assert cfg.learner.env["MALLOC_ARENA_MAX"] == "2" and cfg.engine.env["VLLM_CPU_SGL_KERNEL"] == "true"


def test_a_dict_override_of_an_empty_dict_needs_no_plus(tmp_path):
    cfg = compose(["engine.options={max_num_seqs: 8}", f"run_dir={tmp_path}"])  # no "not in struct"
    assert cfg.engine.options == {"max_num_seqs": 8}


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_overrides() -> list[tuple[str, list[str]]]:
    """(job, overrides) of every command in the bash blocks of README.md and docs/*.md that runs a job:
    `make train ARGS="..."` or `python jobs/<job>.py ...` (flags such as --cfg left out)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", "\n".join(p.read_text() for p in DOCS), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "jobs/" not in line and "make train" not in line:
                continue  # not a job (e.g. a kubectl here-string, not shell words line by line)
            words = shlex.split(line, comments=True)
            if words[:2] == ["make", "train"]:
                job, args = "train", shlex.split(next((w[5:] for w in words if w.startswith("ARGS=")), ""))
            elif any(re.fullmatch(r"jobs/\w+\.py", w) for w in words):
                i = next(i for i, w in enumerate(words) if re.fullmatch(r"jobs/\w+\.py", w))
                job, args = Path(words[i]).stem, words[i + 1:]
            else:
                continue
            commands.append((job, [a for a in args if "=" in a and not a.startswith("-")]))
    return commands


def test_the_docs_show_overrides():
    shown = documented_overrides()
    assert len(shown) >= 10 and any("engine.options={}" in args for _, args in shown)


@pytest.mark.parametrize("job, overrides", documented_overrides(),
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_documented_override_works_as_written(job, overrides, tmp_path):
    schema = APOJobConfig if job == "apo" else TrainConfig
    compose([*overrides, f"run_dir={tmp_path}"], job if job in ("apo", "imitate") else "train", schema)


@pytest.mark.parametrize("override, named", [
    ("rollout.group_size=0", "rollout.group_size"),
    ("algorithm.estimator=ppo2", "algorithm.estimator"),
    ("algorithm.credit=per_step", "algorithm.credit"),  # per-call advantages on the default trajectory level
    ("algorithm.kl_penalty=reward", "algorithm.kl_penalty"),  # token rewards without a critic to use them
    ("serve.port=99999", "serve.port"),
    ("task.agent=my_agent.py", "task.agent"),  # an entry point is module:function
    ("engine=vlm", "engine/vlm"),  # a misspelt group option: Hydra lists the options there are
    ("experiment=calc_smolm2", "experiment/calc_smolm2"),
    ("engine.tensor_parallel_size=0", "engine.tensor_parallel_size"),
    ("trainer.learning_rate=1e-3", "trainer.learning_rate"),  # a key that does not exist, by Hydra
    ("+trainer.learning_rate=1e-3", "trainer.learning_rate"),  # ... added anyway: by the schema
    ("engine.options=[1]", "engine.options"),
    ("model.path=runs/<run>/checkpoint", "model.path=runs/<run>/checkpoint"),  # not Hydra's grammar: shown where
    ("+serve.resources.policy_gpu=-1", "serve.resources.policy_gpu"),
    ("learner.placement_strategy=CLOSE", "learner.placement_strategy"),
    ("serve.host=0.0.0.0", "serve.api_key"),  # exposed without a key: refused, the key it needs named
    ("rollout.timeout_seconds=null", "rollout.timeout_seconds"),  # every rollout has a deadline
])
def test_bad_values_name_the_key(override, named, tmp_path):
    r = run_job(override, f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0
    assert named in r.stderr and "Traceback" not in r.stderr
    assert {p.suffix for p in tmp_path.iterdir()} <= {".log"}  # nothing started: Hydra's log file at most


@pytest.mark.parametrize("host", ["0.0.0.0", "'::'", "10.1.2.3", "head.example.org"])
def test_a_host_beyond_loopback_needs_an_api_key(host, tmp_path):
    with pytest.raises(ConfigError, match=r"serve.host=.* serve\.api_key is not set"):
        compose([f"serve.host={host}", f"run_dir={tmp_path}"])
    assert compose([f"serve.host={host}", "serve.api_key=k", f"run_dir={tmp_path}"]).serve.api_key == "k"
    for loopback in ("127.0.0.1", "localhost", "'::1'", "127.0.0.2"):  # no key needed where only this machine reaches
        assert compose([f"serve.host={loopback}", f"run_dir={tmp_path}"]).serve.api_key is None
    with pytest.raises(ConfigError, match="serve.api_key"):  # an empty key would turn the check off
        compose(["serve.host=0.0.0.0", "serve.api_key=''", f"run_dir={tmp_path}"])


def test_cfg_job_prints_the_resolved_config_and_runs_nothing(tmp_path):
    run_dir = tmp_path / "run"
    r = run_job("--cfg", "job", "--resolve", "task=sql", "engine=hf", "learner.zero_stage=3",
                "engine.options={}", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    cfg = validate(yaml.safe_load(r.stdout))
    assert (cfg.task.name, cfg.engine.kind, cfg.learner.zero_stage, cfg.run_dir) == ("sql", "hf", 3, str(run_dir))
    assert not run_dir.exists()
    r = run_job("--cfg", "job", "--resolve", "apo.beam=2", "engine.options={max_num_seqs: 4}", job="apo")
    cfg = validate(yaml.safe_load(r.stdout), APOJobConfig)
    assert cfg.apo.beam == 2 and cfg.engine.options == {"max_num_seqs": 4}  # the job's own argv: dicts replace


def test_no_secret_reaches_the_run_directory(tmp_path):
    """Hydra's own record of a run (.hydra/, with every override) would keep the API key in clear; the job's
    config.yaml keeps the resolved config with the key masked."""
    r = run_job("serve.api_key=sk-secret-1", "rollout.group_size=0", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and "rollout.group_size" in r.stderr
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and b"sk-secret-1" in p.read_bytes()]
    # asked for, .hydra/ is written, then masked before the job runs
    r = run_job("serve.api_key=plain-secret", "rollout.group_size=0", "hydra.output_subdir=.hydra",
                f"hydra.run.dir={tmp_path / 'recorded'}")
    assert r.returncode != 0 and (tmp_path / "recorded" / ".hydra" / "overrides.yaml").exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and b"plain-secret" in p.read_bytes()]

    cfg = compose([f"run_dir={tmp_path}", "serve.api_key=sk-secret-1", "learner.lr=3e-4", "+engine.env.HF_TOKEN=abc",
                   "task.runtime_env={env_vars: {OPENAI_API_KEY: xyz, WANDB_MODE: offline}}",
                   "task.generator={note: ghp_0123456789abcdef}"])
    cfg.save(tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    for secret in ("sk-secret-1", "abc", "xyz", "ghp_0123456789abcdef"):
        assert f": {secret}" not in saved
    data = yaml.safe_load(saved)
    assert data["serve"]["api_key"] == data["engine"]["env"]["HF_TOKEN"] == "***"
    assert data["task"]["runtime_env"]["env_vars"] == {"OPENAI_API_KEY": "***", "WANDB_MODE": "offline"}
    assert validate(data).learner == cfg.learner  # everything else as the run resolved it
    assert data["run_dir"] == str(tmp_path)
    # what only looks like one stays: a variable's name, a path's part (store inspect re-validates the record)
    cfg = compose([f"run_dir={tmp_path / 'hf_downloads_run'}", "model.path=/data/hf_downloads/SmolLM2",
                   "algorithm=sft", "teacher.kind=model", "teacher.path=/models/t", "teacher.api_key_env=MY_KEY"])
    cfg.save(tmp_path / "config.yaml")
    assert validate(yaml.safe_load((tmp_path / "config.yaml").read_text())) == cfg
    assert masked("git+https://ghp_0123456789abcdef@github.com/o/r") == "git+https://***@github.com/o/r"
    assert masked("serve.api_key=abc,teacher.api_key_env=MY_KEY") == "serve.api_key=***,teacher.api_key_env=MY_KEY"
    # a password in a URL (a teacher's endpoint, a pip index); a port is none
    assert masked("teacher.base_url=https://bob:hunter2@api.example.com/v1") == (
        "teacher.base_url=https://bob:***@api.example.com/v1")
    assert masked("ray.address=ray://head:10001") == "ray.address=ray://head:10001"


def test_the_default_config_has_nothing_that_looks_secret(tmp_path):
    data = compose([f"run_dir={tmp_path}"]).model_dump(mode="json")
    assert masked(data) == data


def test_results_land_outside_a_submitted_jobs_temporary_copy(tmp_path, monkeypatch):
    """Under `ray job submit --working-dir`, the current directory is Ray's copy of it, deleted with the cluster: a
    relative run directory goes under ~/lightning_ray on the driver's node instead; an absolute one is kept."""
    from lightning_ray.config import validate

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert validate({"run_dir": "runs/a"}).run_path == tmp_path / "runs" / "a"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"working_dir": "gcs://_ray_pkg_0.zip"}}')
    assert validate({"run_dir": "runs/a"}).run_path == tmp_path / "home" / "lightning_ray" / "runs" / "a"
    assert validate({"run_dir": str(tmp_path / "b")}).run_path == tmp_path / "b"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {}}')  # submitted without a working_dir
    assert validate({"run_dir": "runs/a"}).run_path == tmp_path / "runs" / "a"


def test_the_rl_run_an_imitation_prints_keeps_its_placement_and_model_and_drops_its_teacher(tmp_path):
    """After a GPU imitation run, the command it prints goes on with RL on the same GPUs and model preset (it
    printed task= and model.path= alone: RL then ran the CPU placement, the tiny model's defaults)."""
    from lightning_ray.cli.imitate import rl_command

    given = ["placement=colocated", "model=qwen2.5-0.5b-instruct", "engine=vllm", "learner.lr=3e-6", "task=sql",
             "teacher.kind=model", "teacher.path=/models/teacher", "trainer.iterations=3", "algorithm.kl_coef=0",
             f"run_dir={tmp_path}"]
    imitation = compose(given, config_name="imitate")
    program, *printed = shlex.split(rl_command(imitation, given))[1:]
    assert program == "jobs/train.py" and not any(o.split("=")[0].startswith(("teacher", "trainer", "algorithm",
                                                                              "run_dir")) for o in printed)
    rl = compose([*printed, f"run_dir={tmp_path / 'rl'}"])
    assert rl.model.path == str(tmp_path / "checkpoint") and rl.task.name == "sql"
    for key in ("serve.resources", "learner.resources_per_worker", "engine.kind", "engine.max_model_len",
                "learner.lr", "learner.micro_batch_tokens"):
        section, name = key.split(".")
        assert getattr(getattr(rl, section), name) == getattr(getattr(imitation, section), name), key
    # a task preset, and task settings, go on as imitated (the command said task=<its module>: another task)
    for task in (["task=calc_gsm"], ["task=calc_autogen"], ["task=calc", "task.protocol=tools"]):
        imitation = compose([*task, f"run_dir={tmp_path}"], config_name="imitate")
        printed = shlex.split(rl_command(imitation, [*task, f"run_dir={tmp_path}"]))[2:]
        assert compose([*printed, f"run_dir={tmp_path / 'rl'}"]).task == imitation.task, task
    # printed to the terminal and the job's logs: a key given in clear is not; one from the environment is kept
    keys = ["serve.api_key=sk-live-0123456789abcdef", "+engine.env.HF_TOKEN=${oc.env:HF_TOKEN}"]
    printed = rl_command(compose([f"run_dir={tmp_path}"], config_name="imitate"), keys)
    assert "sk-live" not in printed and "serve.api_key=***" in printed and "${oc.env:HF_TOKEN}" in printed


def test_a_runs_local_cluster_hides_the_gpus_from_components_given_none(tmp_path):
    """On a GPU node Ray leaves a worker given no GPU its CUDA_VISIBLE_DEVICES as it is, so with placement=cpu the
    engine took the GPU beside a learner on CPUs: a run's local cluster hides them (Ray's override on zero).
    Checked in a process of its own (a cluster the run starts), by what a worker given no GPU sees. And a GPU
    placement asking for more GPUs than the cluster detected is refused (its replicas waited for ever): here, none."""
    script = f"""
import os, ray
from lightning_ray.config import compose
from lightning_ray.services import Services, check_gpus
cfg = compose(["run_dir={tmp_path}", "ray.num_cpus=1"])
Services._start_ray(Services.__new__(Services), cfg, learner=True)
print("SEEN", repr(ray.get(ray.remote(num_cpus=0)(lambda: os.environ.get("CUDA_VISIBLE_DEVICES")).remote())))
try:
    check_gpus(compose(["run_dir={tmp_path}", "placement=colocated"]), True, ray.cluster_resources().get("GPU", 0))
except ValueError as e:
    print("REFUSED", e)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "RAY_ADDRESS")}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert "SEEN ''" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "REFUSED the run asks for 1 GPUs" in out.stdout and "Ray detected 0" in out.stdout, out.stdout[-2000:]
