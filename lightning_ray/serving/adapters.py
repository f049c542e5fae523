"""Which LoRA adapter serves a call (learner.lora, algorithm.adapters).

With one adapter (learner.lora alone) every call is served with it. With an adapter per agent, a call names its
adapter as the model `<model.name>/<adapter>`, or its agent does: the `x-lightning-ray-agent` header, which the
platform's OpenTelemetry propagator sends with every request an agent makes under an agent span
(tracing/agent_header.py), so an unmodified workflow's calls each reach their agent's adapter; the header's name is
matched against algorithm.adapters' regexes as algorithm.select.agents matches (the first adapter that matches).
A call of an agent no adapter names is served by the base. The adapter that served a call is recorded on its span,
and the learner trains the call with that one.
"""

from __future__ import annotations

from lightning_ray.algorithm.select import any_of
from lightning_ray.serving.http import ApiError
from lightning_ray.weight_sync.adapter import DEFAULT


class AdapterRoutes:
    def __init__(self, model_name: str, lora: bool, adapters: dict[str, list[str]] | None = None):
        self.model_name = model_name
        self.default = DEFAULT if lora and not adapters else None  # what a call that names no adapter gets
        self.by_agent = [(name, any_of(patterns)) for name, patterns in (adapters or {}).items()]
        self.models = [model_name, *(f"{model_name}/{name}" for name, _ in self.by_agent)]  # /v1/models

    def check(self, model: str) -> None:
        if model not in self.models:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                                f"{', '.join(f'`{m}`' for m in self.models)}", param="model", code="model_not_found")

    def adapter(self, model: str, agent: str | None) -> str | None:
        """The adapter for a call to `model` (one of `models`) made under `agent` (None: no agent named)."""
        if model != self.model_name:
            return model.removeprefix(f"{self.model_name}/")
        if agent is not None:
            return next((name for name, agents in self.by_agent if agents.fullmatch(agent)), self.default)
        return self.default
