"""The store over HTTP, for agents that live outside Ray: the rollout queue, spans, queries, and an OTLP/HTTP
trace receiver (POST /v1/traces, protobuf or JSON) so any OpenTelemetry exporter or collector can send us spans.

It runs as a Ray Serve app next to the policy (same proxy and port, under /store) and forwards to the StoreClient.
With serve.api_key set, that key opens all of it; an agent's own key posts its attempt's spans only
(lightning_ray/auth.py), and an attempt's heartbeats and finish need the lease token dequeue gave with it.
"""

from __future__ import annotations

import hmac
import zlib
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from google.protobuf.json_format import MessageToJson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from pydantic import BaseModel, Field, FiniteFloat
from ray import serve

from lightning_ray import auth
from lightning_ray.serving.deploy import start_apps, wait_running
from lightning_ray.serving.http import ApiError, error_response, install
from lightning_ray.store.client import StoreClient
from lightning_ray.store.errors import InvalidLeaseToken, StoreError
from lightning_ray.tracing.otlp import OtlpDecodeError, spans_from_otlp
from lightning_ray.types import (Attempt, AttemptPolicy, AttemptStatus, CancelOutcome, QueueName, Rollout, RolloutStatus,
                                 Span, Task, Verdict)

APP_NAME, ROUTE_PREFIX = "store", "/store"
api = FastAPI(title="lightning_ray trace store")
install(api)
# what an agent's own key may call (lightning_ray/auth.py): posting its attempt's spans; the rest needs the operator's
api.state.agent_routes = {("POST", "/v1/spans"), ("POST", "/v1/traces")}


@api.exception_handler(StoreError)
async def _store_error(_: Request, e: StoreError):
    cause = getattr(e, "cause", None) or e  # raised through Ray: the original error, without the remote traceback
    return error_response(ApiError(e.status, str(cause), code=e.code))


class EnqueueRequest(BaseModel):
    tasks: list[Task] = Field(min_length=1)
    config: AttemptPolicy | None = None
    queue: QueueName = "default"


# chosen by the worker so that it can ask again after a lost reply; it goes into URL paths
AttemptId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,128}$")]
MAX_BATCH = 1024  # attempts per dequeue_batch or finish_attempts call


class DequeueRequest(BaseModel):
    worker_id: str | None = None
    attempt_id: AttemptId | None = None
    queue: QueueName = "default"


class DequeueBatchRequest(BaseModel):
    attempt_ids: list[AttemptId] = Field(min_length=1, max_length=MAX_BATCH)
    worker_id: str | None = None
    queue: QueueName = "default"


class Lease(Rollout):
    lease_token: str | None = None  # its heartbeats and finish show it (X-Lease-Token); None: no serve.api_key


class FinishRequest(BaseModel):
    status: AttemptStatus
    reward: FiniteFloat | None = None  # NaN or infinity: 400, never stored
    error: str | None = None


class LeasedVerdict(Verdict):
    reward: FiniteFloat | None = None
    lease_token: str | None = None  # the one dequeue gave with the attempt (X-Lease-Token's, in the body)


class FinishBatchRequest(BaseModel):
    verdicts: list[LeasedVerdict] = Field(min_length=1, max_length=MAX_BATCH)


class Outcome(BaseModel):
    """A verdict's: the rollout it ended or requeued, or the error it met ({"code", "message"})."""

    rollout: Rollout | None = None
    error: dict[str, str] | None = None


class RolloutIdsRequest(BaseModel):
    rollout_ids: list[str] = Field(min_length=1)


MAX_WAIT_S = 60.0  # one long poll; LightningClient polls again for longer waits


class WaitRequest(RolloutIdsRequest):
    timeout: float = Field(30.0, ge=0, le=MAX_WAIT_S)


class SpansRequest(BaseModel):
    spans: list[Span]


def gunzip(body: bytes, limit: int) -> bytes | None:
    """A gzip body (one or more members) decompressed, or None as soon as it passes `limit` bytes: a small body
    must not inflate into gigabytes."""
    out = bytearray()
    while body:
        member = zlib.decompressobj(wbits=31)
        out += member.decompress(body, limit + 1 - len(out))
        if len(out) > limit or member.unconsumed_tail:
            return None
        if not member.eof:
            raise EOFError("truncated gzip body")
        body = member.unused_data
    return bytes(out)


def otlp_response(content_type: str, rejected: int, message: str) -> Response:
    """OTLP's reply: an ExportTraceServiceResponse in the request's encoding, with a partial success if needed."""
    reply = ExportTraceServiceResponse()
    if rejected:
        reply.partial_success.rejected_spans, reply.partial_success.error_message = rejected, message
    if content_type == "application/json":
        return Response(MessageToJson(reply), media_type="application/json")
    return Response(reply.SerializeToString(), media_type="application/x-protobuf")


def holds_lease(key: str | None, rollout_id: str, attempt_id: str, token: str | None) -> bool:
    """Whether `token` is the attempt's lease token (any is, without serve.api_key)."""
    return not key or hmac.compare_digest((token or "").encode(),
                                          auth.lease_token(key, rollout_id, attempt_id).encode())


def check_lease(request: Request, rollout_id: str, attempt_id: str, x_lease_token: str = Header("")) -> None:
    """Only the worker holding an attempt's lease beats for it and ends it: it shows the token dequeue gave it."""
    if not holds_lease(request.app.state.api_key, rollout_id, attempt_id, x_lease_token):
        raise ApiError(403, f"attempt {attempt_id}: missing or wrong X-Lease-Token (the lease_token dequeue returned "
                            f"with it)", code="invalid_lease_token")


def leased(rollout: Rollout | None, key: str | None) -> Lease | None:
    """A leased rollout with the token its heartbeats and verdict must show (with serve.api_key set)."""
    return rollout and Lease(**rollout.model_dump(),
                             lease_token=key and auth.lease_token(key, rollout.rollout_id, rollout.attempt_id))


def own_spans(request: Request, spans: list[Span]) -> None:
    """An agent's key posts its own attempt's spans only."""
    if (agent := getattr(request.state, "agent", None)) and any((s.rollout_id, s.attempt_id) != agent for s in spans):
        raise ApiError(403, f"this key posts spans of rollout {agent[0]}, attempt {agent[1]} only",
                       code="permission_denied")


def _outcome(o: Rollout | StoreError) -> Outcome:
    return Outcome(error={"code": o.code, "message": str(o)}) if isinstance(o, StoreError) else Outcome(rollout=o)


# (Serve captures a deployment's module globals when it is decorated: helpers go above it.)
@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False}, graceful_shutdown_wait_loop_s=0.1)
@serve.ingress(api)
class StoreApi:
    def __init__(self, store: StoreClient, api_key: str | None = None, max_request_bytes: int = 64 << 20):
        self.store = store
        api.state.api_key, api.state.max_request_bytes = api_key, max_request_bytes
        api.state.count_rejected = store.count_error

    @api.post("/v1/rollouts")
    def enqueue(self, body: EnqueueRequest) -> list[Rollout]:
        return self.store.enqueue(body.tasks, body.config, body.queue)

    @api.post("/v1/rollouts/dequeue")
    def dequeue(self, body: DequeueRequest) -> Lease | None:
        return leased(self.store.dequeue(body.worker_id, body.attempt_id, body.queue), api.state.api_key)

    @api.post("/v1/rollouts/dequeue_batch")
    def dequeue_batch(self, body: DequeueBatchRequest) -> list[Lease | None]:
        key = api.state.api_key
        return [leased(r, key) for r in self.store.dequeue_batch(body.attempt_ids, body.worker_id, body.queue)]

    @api.post("/v1/rollouts/{rollout_id}/attempts/{attempt_id}/heartbeat", dependencies=[Depends(check_lease)])
    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        return self.store.heartbeat(rollout_id, attempt_id)

    @api.post("/v1/rollouts/{rollout_id}/attempts/{attempt_id}/finish", dependencies=[Depends(check_lease)])
    def finish_attempt(self, rollout_id: str, attempt_id: str, body: FinishRequest) -> Rollout:
        return self.store.finish_attempt(rollout_id, attempt_id, body.status, body.reward, body.error)

    @api.post("/v1/rollouts/finish")
    def finish_attempts(self, body: FinishBatchRequest) -> list[Outcome]:
        """Each verdict's outcome, in order; one without its attempt's lease token is refused alone."""
        key = api.state.api_key
        held = [holds_lease(key, v.rollout_id, v.attempt_id, v.lease_token) for v in body.verdicts]
        taken = iter(self.store.finish_attempts([Verdict(**v.model_dump(exclude={"lease_token"}))
                                                 for v, ok in zip(body.verdicts, held) if ok]))
        return [_outcome(next(taken) if ok else InvalidLeaseToken(
            f"attempt {v.attempt_id}: missing or wrong lease_token (the one dequeue gave with it)"))
                for v, ok in zip(body.verdicts, held)]

    @api.post("/v1/rollouts/cancel")
    def cancel(self, body: RolloutIdsRequest) -> dict[str, CancelOutcome]:
        """Per rollout: cancelled, already_ended or unknown; one unknown or ended rollout does not fail the rest."""
        return self.store.cancel(body.rollout_ids)

    @api.post("/v1/rollouts/wait")
    async def wait_for_rollouts(self, body: WaitRequest) -> list[Rollout]:
        """On the event loop, not a thread each: any number of waiters, and the rest of the API stays free."""
        return await self.store.wait_for_rollouts_async(body.rollout_ids, body.timeout)

    @api.get("/v1/rollouts")
    def query_rollouts(self, status: list[RolloutStatus] | None = Query(None), since: float | None = None,
                       until: float | None = None, limit: int | None = Query(None, ge=1)) -> list[Rollout]:
        return self.store.query_rollouts(status, since, until, limit)

    @api.get("/v1/rollouts/{rollout_id}")
    def get_rollout(self, rollout_id: str) -> Rollout:
        return self.store.get_rollouts([rollout_id], strict=True)[0]

    @api.get("/v1/rollouts/{rollout_id}/attempts")
    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        self.store.get_rollouts([rollout_id], strict=True)
        return self.store.get_attempts(rollout_id)

    @api.post("/v1/spans")
    def add_spans(self, body: SpansRequest, request: Request) -> dict:
        own_spans(request, body.spans)
        return self.store.add_spans(body.spans)

    @api.get("/v1/spans")
    def query_spans(self, rollout_id: list[str] | None = Query(None), attempt_id: str | None = None,
                    name: str | None = None, since: float | None = None, until: float | None = None,
                    limit: int | None = Query(None, ge=1)) -> list[Span]:
        return self.store.query_spans(rollout_id, attempt_id, name, since, until, limit)

    @api.get("/v1/stats")
    def stats(self) -> dict:
        return self.store.stats()

    @api.post("/v1/traces")
    async def otlp_traces(self, request: Request) -> Response:
        """OTLP/HTTP. Undecodable payloads get 400; spans the store rejects are reported as a partial success."""
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        try:
            body = await request.body()
            limit = request.app.state.max_request_bytes
            if request.headers.get("content-encoding") == "gzip" and (body := gunzip(body, limit)) is None:
                self.store.count_error("request_too_large")
                raise ApiError(413, f"decompressed body exceeds the limit of {limit} bytes", code="request_too_large")
            spans = spans_from_otlp(body, content_type)
        except (OtlpDecodeError, OSError, EOFError, zlib.error) as e:
            self.store.count_error("otlp_malformed")
            raise ApiError(400, f"malformed OTLP payload: {e}", code="otlp_malformed") from None
        own_spans(request, spans)
        result = await self.store.add_spans_async(spans, strict=False) if spans else {"rejected": 0, "errors": []}
        return otlp_response(content_type, result["rejected"], "; ".join(result["errors"]))


def store_api_target(store: StoreClient, api_key: str | None = None) -> serve.RunTarget:
    """The store's HTTP API as Serve runs it: under ROUTE_PREFIX on the proxy."""
    return serve.RunTarget(StoreApi.bind(store, api_key=api_key), name=APP_NAME, route_prefix=ROUTE_PREFIX)


def deploy_store_api(store: StoreClient, host: str = "127.0.0.1", port: int = 8000,
                     api_key: str | None = None) -> str:
    """Serve the store over HTTP on the Serve proxy; return its base URL (OTLP exporters post to {url}/v1/traces)."""
    wait_running(start_apps([store_api_target(store, api_key)], host, port))
    return f"http://{host}:{port}{ROUTE_PREFIX}"
