"""An adapter per agent (algorithm.adapters), piece by piece: the config, the header that names a call's agent, the
server's choice of adapter, and the learner's step (a real DeepSpeed engine on one rank: each adapter trains on its
own calls as if it were alone, and one without calls in a step does not move). Through the whole stack:
tests/integration/trainer/test_adapter_per_agent.py; the engines: tests/integration/serving/test_lora_serving.py."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import small
from opentelemetry.sdk.trace import TracerProvider
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ray import weight_sync
from lightning_ray.algorithm.lightningrl import merge_calls
from lightning_ray.config import AlgorithmConfig, ConfigError, LearnerConfig, LoraConfig, ModelConfig
from lightning_ray.learner import lora
from lightning_ray.learner.driver import batch_plan, micro_batch_adapters
from lightning_ray.learner.worker import deepspeed_engine, parameter_groups, train_step
from lightning_ray.models import resolve_adapter
from lightning_ray.serving.adapters import AdapterRoutes
from lightning_ray.serving.http import ApiError
from lightning_ray.tracing.agent_header import AgentHeader, AgentSpans
from lightning_ray.tracing.semconv import AGENT_HEADER
from lightning_ray.types import Transition
from test_learner_math import TINY, batch_of

ADAPTERS = {"plan": ["planner"], "code": ["coder", "fixer.*"]}


# ---- config -----------------------------------------------------------------------------------------------------
def test_adapters_need_lora_and_an_adapter_sync():
    def config(algorithm: dict, learner: dict | None = None):
        return small({"run_dir": "r", "algorithm": algorithm, "learner": learner or {}})

    with pytest.raises(ConfigError, match="algorithm.adapters .* needs learner.lora"):
        config({"adapters": ADAPTERS})
    with pytest.raises(ConfigError, match="learner.lora.sync=merged"):
        config({"adapters": ADAPTERS}, {"lora": {"sync": "merged"}})
    for name in ("default", "ra", "bad name"):
        with pytest.raises(ConfigError, match=r"algorithm.adapters\."):
            config({"adapters": {name: ["x"]}}, {"lora": {}})
    with pytest.raises(ConfigError, match="not a regex"):
        config({"adapters": {"plan": ["("]}}, {"lora": {}})
    with pytest.raises(ConfigError, match="model.adapter is LoRA's"):
        small({"run_dir": "r", "model": {"adapter": "somewhere"}})
    # on CPUs one adapter alone ships merged weights; an adapter per agent ships the adapters
    assert weight_sync.of_run(config({"adapters": ADAPTERS}, {"lora": {}})) == "adapter"
    assert weight_sync.of_run(config({}, {"lora": {}})) == "object_store"


def test_adapters_served_from_a_directory_must_be_there(tmp_path):
    """model.adapter: a checkpoint's adapter/ (peft's files at its root, or a directory per adapter)."""
    with pytest.raises(FileNotFoundError, match="model.adapter=.*no LoRA adapter there"):
        resolve_adapter(ModelConfig(adapter=str(tmp_path)))
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "adapter_config.json").write_text("{}")
    assert resolve_adapter(ModelConfig(adapter=str(tmp_path))) == tmp_path.resolve()
    assert resolve_adapter(ModelConfig()) is None


# ---- the header naming a call's agent ---------------------------------------------------------------------------
def test_a_request_made_under_an_agent_span_names_the_nearest_agent():
    spans = AgentSpans()
    provider = TracerProvider()
    provider.add_span_processor(spans)
    tracer, header = provider.get_tracer("t"), AgentHeader(spans)

    def sent() -> str | None:
        carrier: dict = {}
        header.inject(carrier)
        return carrier.get(AGENT_HEADER)

    assert sent() is None
    with tracer.start_as_current_span("workflow"):
        assert sent() is None  # no agent named yet
        with tracer.start_as_current_span("invoke_agent planner", attributes={"gen_ai.agent.name": "planner"}):
            with tracer.start_as_current_span("chain"), tracer.start_as_current_span("http"):
                assert sent() == "planner"  # inherited through spans that name none
            with tracer.start_as_current_span("coder.agent", attributes={"traceloop.span.kind": "agent"}):
                assert sent() == "coder"  # an older OpenLLMetry agent span
            assert sent() == "planner"
        assert sent() is None
    assert spans.agents == {}  # every ended span left


# ---- the server's choice of adapter -----------------------------------------------------------------------------
def test_each_call_gets_its_agents_adapter_or_the_one_it_names():
    routes = AdapterRoutes("policy", lora=True, adapters=ADAPTERS)
    assert routes.models == ["policy", "policy/plan", "policy/code"]
    assert routes.adapter("policy", "planner") == "plan"
    assert routes.adapter("policy", "fixer-2") == "code"
    assert routes.adapter("policy", "checker") is None  # an agent no adapter names: the base
    assert routes.adapter("policy", None) is None
    assert routes.adapter("policy/code", "planner") == "code"  # an explicit model name wins
    with pytest.raises(ApiError) as e:
        routes.check("policy/other")
    assert e.value.status == 404 and "policy/plan" in e.value.message
    one = AdapterRoutes("policy", lora=True)  # learner.lora's one adapter serves every call
    assert one.models == ["policy"] and one.adapter("policy", "planner") == one.adapter("policy", None) == "default"
    assert AdapterRoutes("policy", lora=False).adapter("policy", None) is None


# ---- the learner's step -----------------------------------------------------------------------------------------
def adapted(names: list[str]) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).float()
    model = lora.with_adapter(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), names)
    with torch.no_grad():  # as after some training: B no longer zero, so A has a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def engine_for(model, names, stage: int = 0):
    # no clipping: the gradient norm is clipped over every adapter together
    t = LearnerConfig(zero_stage=stage, lr=1e-2, weight_decay=0.0, grad_clip=1e9, dtype="float32")
    return deepspeed_engine(model, parameter_groups(model, names), t, on_cuda=False)


def step(engine, transitions, adapters: dict | None):
    alg = AlgorithmConfig(adapters=adapters)
    plan = batch_plan(transitions, alg, max_tokens=12, token_budget=256, ranks=1)
    return train_step(engine, plan[0], 0, alg, 1, adapters=micro_batch_adapters(plan) if adapters else None)


def test_every_ranks_micro_batch_runs_the_same_adapter_side_by_side():
    """ZeRO-2 and 3 reduce each gradient as backward makes it: at each micro-batch index every rank must run the same
    adapter (an empty micro-batch too), or they would reduce different parameters."""
    calls = [t.model_copy(update={"adapter": "xyy"[i % 3]}) for i, t in enumerate(batch_of(15, seed=2))]
    alg = AlgorithmConfig(adapters={"x": ["x"], "y": ["y"]}, mini_batches=2)
    plan = batch_plan(calls, alg, max_tokens=12, token_budget=64, ranks=3)
    adapters = micro_batch_adapters(plan)
    for m, names in enumerate(adapters):
        assert set(names) == {"x", "y"} and all(len(rank[m]) == len(names) for rank in plan)
        for j, name in enumerate(names):
            assert all(t.adapter == name for rank in plan for t, _ in rank[m][j])
            assert any(rank[m][j] for rank in plan)  # no index where every rank idles
    assert sorted(t.span_id for rank in plan for mini in rank for mb in mini for t, _ in mb) == \
        sorted(t.span_id for t in calls)


def own(model, name: str) -> dict[str, torch.Tensor]:
    """An adapter's weights, whole (ZeRO-3 keeps each parameter partitioned: gathered for the read)."""
    import deepspeed

    params = [(k, p) for k, p in model.named_parameters() if f".{name}." in k and ".lora_" in k]
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=hasattr(params[0][1], "ds_id")):
        return {k.replace(f".{name}.", "."): p.detach().clone() for k, p in params}


@pytest.mark.parametrize("stage", [0, 3])
def test_each_adapter_trains_on_its_own_calls_as_if_alone_and_one_without_calls_stays(one_rank, stage):
    adapters = {"x": ["x"], "y": ["y"]}
    calls = [t.model_copy(update={"adapter": "xy"[i % 2]}) for i, t in enumerate(batch_of(8, seed=3))]
    model = adapted(["x", "y"])
    alone = {name: copy.deepcopy(model) for name in adapters}
    engine = engine_for(model, ["x", "y"], stage)
    before = {name: own(model, name) for name in adapters}
    assert step(engine, calls, adapters)["updated"]
    for name in adapters:  # the same step, the other adapter's calls absent: the same update
        solo = engine_for(alone[name], ["x", "y"], stage)
        step(solo, [t for t in calls if t.adapter == name], adapters)
        moved, expected = own(model, name), own(alone[name], name)
        assert any(not torch.equal(moved[k], before[name][k]) for k in moved)
        assert all(torch.allclose(moved[k], expected[k], atol=1e-6) for k in moved)
    after_first = own(model, "y")
    step(engine, [t for t in calls if t.adapter == "x"], adapters)  # y has no call: Adam's momentum must not move it
    assert all(torch.equal(t, after_first[k]) for k, t in own(model, "y").items())
    base = {k: p for k, p in model.named_parameters() if ".lora_" not in k}
    assert all(not p.requires_grad for p in base.values())  # the base never trains


def test_the_trajectory_merge_keeps_each_adapters_calls_apart():
    """algorithm.level=trajectory: calls that extend each other merge into one sequence only under one adapter (one
    forward pass runs one adapter)."""
    def call(step: int, prompt: list[int], response: list[int], adapter: str) -> Transition:
        return Transition(rollout_id="r", group_id="g", span_id=f"s{step}", step=step, prompt_ids=prompt,
                          response_ids=response, logprobs=[-1.0] * len(response), reward=1.0, policy_version=0,
                          adapter=adapter)

    first, second = ([1, 2], [3]), ([1, 2, 3, 4], [5])
    merged, _ = merge_calls([call(0, *first, "plan"), call(1, *second, "plan")])
    assert len(merged) == 1 and merged[0].adapter == "plan"
    apart, breaks = merge_calls([call(0, *first, "plan"), call(1, *second, "code")])
    assert [t.adapter for t in apart] == ["plan", "code"] and breaks == 0
