"""The policy server: an OpenAI-compatible API on Ray Serve.

Each call is recorded, before it is answered, as an LLM span in the trace store with the engine's exact prompt
and completion token ids, logprobs and the policy version. A rollout's calls arrive at
/rollouts/{rollout_id}/attempts/{attempt_id}/v1/..., so the records join the rollout without the agent knowing.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import ray
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve

from lightning_ray.serving.engines import SamplingParams, make_engine
from lightning_ray.serving.schemas import ChatCompletion, ChatCompletionRequest, Choice, TokenLogprob, Usage, error_body
from lightning_ray.tracing import semconv
from lightning_ray.types import Span

api = FastAPI(title="lightning_ray policy")


@api.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"] if p != "body") or None
    return JSONResponse(error_body(f"{param or 'body'}: {err['msg']}", param=param), status_code=400)


@api.exception_handler(HTTPException)
async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)


def _fail(status: int, message: str):
    raise HTTPException(status, message)


@serve.deployment(max_ongoing_requests=64, logging_config={"enable_access_log": False})
@serve.ingress(api)
class PolicyServer:
    def __init__(self, model_path: str, model_name: str, store, registry, engine: str = "hf",
                 max_model_len: int = 512, defaults: dict | None = None, api_key: str | None = None):
        import torch

        torch.set_num_threads(1)  # a replica shares the cores with rollouts and training
        self.engine = make_engine(engine, model_path)
        self.tokenizer = self.engine.tokenizer
        self.model_name, self.store, self.registry = model_name, store, registry
        self.max_model_len, self.defaults, self.api_key = max_model_len, defaults or {}, api_key
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        ray.get(registry.register_replica.remote(self.replica_id))
        threading.Thread(target=self._follow_weights, daemon=True).start()

    def _follow_weights(self) -> None:
        """Pull every newly published policy version, load it between generations, and acknowledge it."""
        while True:
            version, refs = ray.get(self.registry.wait_newer.remote(self.engine.policy_version, timeout_s=30.0))
            if version > self.engine.policy_version:
                self.engine.load_weights(ray.get(refs[0]), version)
                self.registry.ack.remote(self.replica_id, version)

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "lightning_ray"}]}

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await self._chat(body, request, None, None)

    @api.post("/rollouts/{rollout_id}/attempts/{attempt_id}/v1/chat/completions")
    async def rollout_chat(self, rollout_id: str, attempt_id: str, body: ChatCompletionRequest, request: Request):
        return await self._chat(body, request, rollout_id, attempt_id)

    def _authorize(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            _fail(401, "invalid or missing API key")

    async def _chat(self, body: ChatCompletionRequest, request: Request, rollout_id, attempt_id):
        self._authorize(request)
        if body.model != self.model_name:
            _fail(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}")
        if body.stream:
            _fail(400, "stream=true is not supported yet")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt_ids = self.tokenizer.encode(
            self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        params = SamplingParams(
            max_tokens=body.max_completion_tokens or body.max_tokens or self.defaults.get("max_tokens", 16),
            temperature=self.defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
            top_p=self.defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
            seed=body.seed,
        )
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            _fail(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                       f"model's context length of {self.max_model_len} tokens")
        start = time.time()
        choices, spans = [], []
        for i in range(body.n):
            gen = await asyncio.to_thread(self.engine.generate, prompt_ids, params)
            text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            logprobs = None
            if body.logprobs:
                pieces = [self.tokenizer.decode([t]) for t in gen.token_ids]
                logprobs = {"content": [TokenLogprob(token=p, logprob=lp, bytes=list(p.encode()))
                                        for p, lp in zip(pieces, gen.logprobs)]}
            choices.append(Choice(index=i, message={"role": "assistant", "content": text},
                                  finish_reason=gen.finish_reason, logprobs=logprobs, token_ids=gen.token_ids))
            spans.append(Span(rollout_id=rollout_id, attempt_id=attempt_id, name=semconv.LLM_CALL,
                              start_time=start, end_time=time.time(), attributes={
                                  semconv.MODEL: body.model,
                                  semconv.POLICY_VERSION: gen.policy_version,
                                  semconv.PROMPT_TOKEN_IDS: prompt_ids,
                                  semconv.COMPLETION_TOKEN_IDS: gen.token_ids,
                                  semconv.LOGPROBS: gen.logprobs,
                                  "gen_ai.response.finish_reasons": [gen.finish_reason],
                                  "lightning_ray.messages": messages,
                                  "lightning_ray.response": text,
                              }))
        await self.store.add_spans.remote(spans)  # recorded before answered: no call can go missing
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}", model=self.model_name, choices=choices,
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens,
                        total_tokens=len(prompt_ids) + completion_tokens),
            system_fingerprint=f"lightning_ray-policy-v{gen.policy_version}", prompt_token_ids=prompt_ids,
        )


APP_NAME = "policy"


def deploy_policy(model_path: str, model_name: str, store, registry, host: str = "127.0.0.1", port: int = 8000,
                  num_replicas: int = 1, max_model_len: int = 512, defaults: dict | None = None,
                  api_key: str | None = None) -> str:
    """Start the policy app on Ray Serve and return its base URL (without /v1)."""
    serve.start(http_options={"host": host, "port": port})
    app = PolicyServer.options(num_replicas=num_replicas).bind(
        model_path, model_name, store, registry, max_model_len=max_model_len, defaults=defaults, api_key=api_key)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"
