"""Server-sent events as OpenAI streams them: `data: <json>` frames, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from lightning_ray.serving.http import ApiError, error_body

logger = logging.getLogger(__name__)


def frame(payload: dict, event: str | None = None) -> str:
    """One SSE frame; `event:` names it (the Responses API's style; chat and completions send data only)."""
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[dict], done_marker: bool = True, named: bool = False,
                 failed: Callable[[ApiError], list[dict]] | None = None) -> StreamingResponse:
    """named=True names each frame after its event's `type`. A stream that fails after its headers went out reports
    it in-band: `failed(error)` gives the closing events (the Responses API's), else one OpenAI error body."""

    async def frames():
        error = None
        try:
            async for event in events:
                yield frame(event, event["type"] if named else None)
        except ApiError as e:
            error = e
        except Exception as e:
            logger.exception("stream failed")
            error = ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
        if error:
            for event in failed(error) if failed else [error_body(error.message, error.type, error.param, error.code)]:
                yield frame(event, event.get("type") if named else None)
        if done_marker:
            yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
