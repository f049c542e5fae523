"""JSON schemas of response formats are checked once per distinct schema, and off the event loop when a request
brings one (compiling can take long while the replica's loop serves every stream)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from lightning_ray.serving.engines.grammar import check_json_schema, schema_error
from lightning_ray.serving.http import ApiError
from lightning_ray.serving.schemas import JsonSchemaFormat, check_schema

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
UNENFORCEABLE = {"type": "array", "uniqueItems": True}


def test_a_schema_is_compiled_once_however_often_it_comes():
    schema_error.cache_clear()
    check_json_schema(SCHEMA)
    check_json_schema(dict(reversed(SCHEMA.items())))  # the same schema, its keys in another order
    check_json_schema({**SCHEMA})
    assert (schema_error.cache_info().misses, schema_error.cache_info().hits) == (1, 2)
    for _ in range(2):  # a refusal is remembered too
        with pytest.raises(ValueError, match="uniqueItems cannot be enforced"):
            check_json_schema(UNENFORCEABLE)
    assert (schema_error.cache_info().misses, schema_error.cache_info().hits) == (2, 3)


class CountingExecutor(ThreadPoolExecutor):
    """The event loop's executor, counting what it is given to run."""

    submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        CountingExecutor.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_a_request_schema_is_checked_in_a_worker_thread_and_refused_with_a_400():
    async def requests():
        asyncio.get_running_loop().set_default_executor(CountingExecutor(max_workers=1))
        await check_schema(JsonSchemaFormat(schema=SCHEMA), "text.format.schema")
        await check_schema(JsonSchemaFormat(), "text.format.schema")  # no schema: any JSON object, nothing to check
        with pytest.raises(ApiError) as e:
            await check_schema(JsonSchemaFormat(schema=UNENFORCEABLE), "response_format.json_schema.schema")
        return e.value

    error = asyncio.run(requests())
    assert CountingExecutor.submitted == 2
    assert (error.status, error.param) == (400, "response_format.json_schema.schema")
    assert "uniqueItems cannot be enforced" in error.message
