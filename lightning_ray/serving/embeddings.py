"""POST /v1/embeddings: a sentence-embedding model beside the policy (serve.embeddings; all-MiniLM-L6-v2 by default),
for agents that embed through the same OpenAI base URL they chat through (retrieval, memory) and would stop at a 404.

It answers to the names the agents already use (OpenAI's embedding models'), runs on the replica's CPU, loaded at its
first call, and is not the policy: nothing here is trained. Each call is recorded in its rollout's trace as an
`embeddings` span (OpenTelemetry GenAI's operation), beside the agent's LLM calls.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from lightning_ray.models.embedder import Embedder
from lightning_ray.serving.http import ApiError, CallTrace
from lightning_ray.serving.schemas import _Request
from lightning_ray.tracing import semconv
from lightning_ray.tracing.spans import new_span_id
from lightning_ray.types import Span

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(_Request):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"  # the openai client asks for base64, and decodes it
    dimensions: int | None = Field(None, gt=0)
    user: str | None = None

    @property
    def inputs(self) -> list:
        return [self.input] if isinstance(self.input, str) else self.input

    @model_validator(mode="after")
    def _check_input(self):
        texts = self.inputs
        if not texts or any(t == "" or t == [] for t in texts):
            raise ValueError("input: an empty input has no embedding")
        if len(texts) > MAX_INPUTS:
            raise ValueError(f"input: at most {MAX_INPUTS} inputs per request, not {len(texts)}")
        return self


class Embeddings:
    """serve.embeddings on one replica: the names it answers to, and its model, loaded at the first call."""

    def __init__(self, path: str | None, names: list[str]):
        self.path, self.names = path, names
        self._model: Embedder | None = None
        self._loading = asyncio.Lock()

    async def model(self) -> Embedder:
        async with self._loading:
            if self._model is None:
                try:
                    self._model = await asyncio.to_thread(Embedder, self.path)
                except Exception as e:  # not installed, not a model directory: the operator's to fix
                    raise ApiError(503, f"the embedding model (serve.embeddings.path) cannot be loaded: {e}",
                                   type="server_error", code="embeddings_unavailable") from None
        return self._model


async def create_embeddings(server, body: EmbeddingRequest, trace: CallTrace) -> dict:
    embeddings: Embeddings | None = server.embedding_model
    if embeddings is None:
        raise ApiError(404, "this server has no embedding model (serve.embeddings.enabled=false)", param="model",
                       code="model_not_found")
    if body.model not in embeddings.names:
        raise ApiError(404, f"the embedding model {body.model!r} does not exist here; it answers to "
                            f"{', '.join(embeddings.names)} (serve.embeddings.names)", param="model",
                       code="model_not_found")
    texts = body.inputs
    if not isinstance(texts[0], str):
        raise ApiError(400, "input as token ids is not supported: they are another tokenizer's (tiktoken's), send "
                            "the text (LangChain: OpenAIEmbeddings(check_embedding_ctx_length=False))", param="input")
    model = await embeddings.model()
    if body.dimensions is not None and body.dimensions != model.dimensions:
        raise ApiError(400, f"this embedding model gives {model.dimensions} dimensions, not {body.dimensions}",
                       param="dimensions")
    start = time.time()
    vectors, tokens = await asyncio.to_thread(model.encode, texts)
    await server.spans.write([Span(
        span_id=new_span_id(), rollout_id=trace.rollout_id, attempt_id=trace.attempt_id, trace_id=trace.trace_id,
        parent_id=trace.parent_id, name=semconv.EMBEDDINGS, start_time=start, end_time=time.time(),
        attributes={"gen_ai.operation.name": "embeddings", semconv.MODEL: body.model,
                    "gen_ai.usage.input_tokens": tokens, "lightning_ray.inputs": len(texts),
                    "lightning_ray.embedding_model": model.path.name, "lightning_ray.replica": server.replica_id})])
    return {"object": "list", "model": body.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)]}


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32s, as OpenAI sends them
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
