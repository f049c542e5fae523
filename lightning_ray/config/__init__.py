"""The job's configuration: the schema (schema.py: every key, its default and its checks), the secrets a run's
records leave out (secrets.py), and configs/ composed by Hydra onto the schema (compose.py)."""

from lightning_ray.config.compose import CONFIGS, code_defaults, compose, job
from lightning_ray.config.schema import (AIRConfig, AlgorithmConfig, APOConfig, APOJobConfig, ConfigError,
                                         EngineConfig, EvalConfig, LearnerConfig, LoraConfig, LossAggregation,
                                         ModelConfig, RayConfig, RolloutConfig, SelectConfig, ServeConfig,
                                         StoreConfig, TaskConfig, TeacherConfig, TrainConfig, TrainerConfig,
                                         as_recorded_today, loopback, validate)
from lightning_ray.config.secrets import mask_file, masked

__all__ = ["AIRConfig", "AlgorithmConfig", "APOConfig", "APOJobConfig", "CONFIGS", "ConfigError", "EngineConfig",
           "EvalConfig", "LearnerConfig", "LoraConfig", "LossAggregation", "ModelConfig", "RayConfig", "RolloutConfig",
           "SelectConfig", "ServeConfig", "StoreConfig", "TaskConfig", "TeacherConfig", "TrainConfig", "TrainerConfig",
           "as_recorded_today", "code_defaults", "compose", "job", "loopback", "mask_file", "masked", "validate"]
