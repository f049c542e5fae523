"""Server-sent events as OpenAI streams them: `data: <json>` frames, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from lightning_ray.serving.http import ApiError, error_body

logger = logging.getLogger(__name__)


def frame(payload: dict, event: str | None = None) -> str:
    """One SSE frame; `event:` names it (the Responses API's style; chat and completions send data only)."""
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[dict], done_marker: bool = True, named: bool = False) -> StreamingResponse:
    """named=True names each frame after its event's `type`."""

    async def frames():
        try:
            async for event in events:
                yield frame(event, event["type"] if named else None)
        except ApiError as e:  # headers are sent already: report in-band, as OpenAI does
            yield frame(error_body(e.message, e.type, e.param, e.code))
        except Exception as e:
            logger.exception("stream failed")
            yield frame(error_body(f"internal error: {type(e).__name__}", "server_error"))
        if done_marker:
            yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
