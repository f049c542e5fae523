"""configs/ composed by Hydra onto the schema's defaults and validated: `compose` (tests, benchmarks: the config a
job would run with) and `job` (the jobs' entry point: overrides, --cfg, --help, sweeps)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from lightning_ray.config.schema import (RESUME_AUTO, APOConfig, ConfigError, LearnerConfig, TrainConfig, _Strict,
                                         moved_to_learner, validate)


def _run_dir_of(resume, new: str) -> str:
    """${run_dir_of:${resume},<new>}: Hydra's run directory (configs/train.yaml), the one resume= names, else a new one
    (resume=auto goes on in run_dir: a job's `run_dir=` is Hydra's too, `job`)."""
    return new if resume in (None, "", "None", RESUME_AUTO) else resume


def code_defaults(schema: type[_Strict]) -> dict:
    """Every key of the schema at its default: what configs/ composes onto (`code_defaults`), so the code holds
    the one set of defaults and each YAML file only what it changes."""
    # constructed, not validated: a validator's derived values (serve.drain from rollout.mode) must stay unset here,
    # or they would come back as if given and the derivation would never run on the composed config
    return schema.model_construct().model_dump(mode="json", exclude={"run_dir"})


def _register() -> None:
    """What configs/ refers to and the YAML cannot hold: the schema's defaults, and our resolver."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("run_dir_of", _run_dir_of, replace=True)
    store = ConfigStore.instance()
    store.store(name="code_defaults", node=code_defaults(TrainConfig))
    store.store(name="code_defaults", node=code_defaults(APOConfig), group="apo")


def from_hydra(raw, schema: type[TrainConfig] = TrainConfig) -> TrainConfig:
    """A job's entry point: the Hydra-composed config validated, or the process exits naming the bad keys."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from omegaconf.errors import InterpolationResolutionError

    try:
        data = OmegaConf.to_container(raw, resolve=True)
    except InterpolationResolutionError as e:  # 'serve.api_key=${oc.env:MY_KEY}' with MY_KEY unset
        raise SystemExit(f"invalid config:\n  {e.full_key}: {str(e.msg).splitlines()[0]}") from None
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN:
        # a sweep's jobs would all resolve ${now:...} alike (OmegaConf caches it), or share the run_dir given: each
        # its own folder, of the sweep's or of that run_dir
        given = OmegaConf.to_container(raw)["run_dir"] != "${hydra:run.dir}"
        data["run_dir"] = str(Path(data["run_dir"] if given else hydra.sweep.dir) / hydra.sweep.subdir)
    try:
        return validate(data, schema)
    except ConfigError as e:
        raise SystemExit(str(e)) from None


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def run_dir_is_hydras(overrides: list[str]) -> list[str]:
    """A job's `run_dir=X` is also Hydra's run directory (its log, train.log, goes there), unless one is given: run_dir
    follows Hydra's (configs/train.yaml), not the other way round."""
    given = dict(o.split("=", 1) for o in overrides if "=" in o and not o.startswith("-"))
    if "run_dir" not in given or "hydra.run.dir" in given:
        return overrides
    at = overrides.index(f"run_dir={given['run_dir']}") + 1  # beside it: flags (--cfg job) may follow
    return [*overrides[:at], f"hydra.run.dir={given['run_dir']}", *overrides[at:]]


def dicts_replace(overrides: list[str]) -> list[str]:
    """Hydra merges a dict given as an override into the configured one, by design, so `engine.options={}` would
    change nothing and `engine.options={max_num_seqs: 8}` fails as "not in struct". Ours replace it: each
    `key={...}` is preceded by `key=null`, which empties the node the dict is then assigned to."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for arg in overrides:
        if "=" in arg and not arg.startswith("-"):  # not a flag (--cfg job, -m)
            try:
                o = parser.parse_override(arg)
            except HydraException:  # left to Hydra, which reports it
                o = None
            key = o and o.key_or_group
            if o and o.type == OverrideType.CHANGE and isinstance(o.value(), dict) and not key.startswith("hydra."):
                out.append(f"{key}=null")
        out.append(arg)
    return out


def refuse_moved(overrides: list[str]) -> list[str]:
    """The overrides, or a ConfigError naming the new key of each that sets a learner key under trainer.* (Hydra's
    own error would only say the key is not there)."""
    keys = [arg.split("=", 1)[0].lstrip("+~") for arg in overrides if "=" in arg and not arg.startswith("-")]
    moved = [k.removeprefix("trainer.") for k in keys
             if k.startswith("trainer.") and k.removeprefix("trainer.").split(".")[0] in LearnerConfig.model_fields]
    groups = [arg for arg in overrides if arg.split("=", 1)[0].lstrip("+~") == "trainer"
              and (CONFIGS / "learner" / f"{arg.split('=', 1)[1]}.yaml").exists()]
    if moved or groups:
        raise ConfigError("; ".join([*(f"{g} is now {g.replace('trainer', 'learner', 1)}" for g in groups),
                                     *([moved_to_learner(moved)] if moved else [])]))
    return overrides


def job(config_name: str, schema: type[TrainConfig] = TrainConfig):
    """A job's entry point: Hydra's main on configs/<config_name>.yaml (command-line overrides, --cfg, --help),
    dict overrides replacing (dicts_replace), and the body called with the validated config."""
    import hydra

    _register()

    def wrap(body):
        @hydra.main(version_base=None, config_path=str(CONFIGS), config_name=config_name)
        @functools.wraps(body)  # Hydra names the job after the function it unwraps to: jobs/<name>.py's
        def main(raw) -> None:
            try:
                body(from_hydra(raw, schema))
            except ConfigError as e:  # the key named, no traceback (a port taken, GPUs missing: found at the start)
                raise SystemExit(str(e)) from None

        @functools.wraps(body)
        def run() -> None:
            try:
                sys.argv[1:] = run_dir_is_hydras(dicts_replace(refuse_moved(sys.argv[1:])))
            except ConfigError as e:
                raise SystemExit(str(e)) from None
            main()
        return run
    return wrap


def compose(overrides: list[str] = (), config_name: str = "train",
            schema: type[TrainConfig] = TrainConfig) -> TrainConfig:
    """The validated config a job would run with these overrides (tests, benchmarks), without running it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    _register()
    with initialize_config_dir(str(CONFIGS), version_base=None):
        raw = hydra_compose(config_name, overrides=dicts_replace(refuse_moved(list(overrides))),
                          return_hydra_config=True)
    HydraConfig.instance().set_config(raw)  # as a job's start does: ${hydra:run.dir} resolves
    with open_dict(raw):
        del raw["hydra"]
    return validate(OmegaConf.to_container(raw, resolve=True), schema)
