"""Server-sent events as OpenAI streams them: `data: <json>` frames, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from lightning_ray.serving.http import ApiError, error_body

logger = logging.getLogger(__name__)


def sse_response(events: AsyncIterator[dict], done_marker: bool = True, named: bool = False) -> StreamingResponse:
    """named=True writes `event: <type>` lines too (the Responses API's style)."""

    async def frames():
        try:
            async for event in events:
                prefix = f"event: {event['type']}\n" if named else ""
                yield f"{prefix}data: {json.dumps(event)}\n\n"
        except ApiError as e:  # headers are sent already: report in-band, as OpenAI does
            yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"
        except Exception as e:
            logger.exception("stream failed")
            yield f"data: {json.dumps(error_body(f'internal error: {type(e).__name__}', 'server_error'))}\n\n"
        if done_marker:
            yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
