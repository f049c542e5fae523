"""The server's gate around a weight update (serving/gate.py): under serve.drain=keep a generation goes on through
a load the engine can make under it, and is drained by the deadline through one it cannot (vLLM swapping an
adapter)."""

import asyncio

from lightning_ray.serving.gate import DrainTimeout, Gate


async def _generation(gate: Gate, started: asyncio.Event):
    async with gate.admit():
        started.set()
        await asyncio.sleep(30)  # a long generation
        return "finished"


async def _update(keeps_generations: bool):
    gate, started = Gate(drain_timeout_s=0.2, drain="keep"), asyncio.Event()
    generation = asyncio.create_task(_generation(gate, started))
    await started.wait()
    async with gate.for_weights(keeps_generations):
        running_during_the_load = gate.in_flight
    if generation.done():
        return running_during_the_load, generation.exception()
    generation.cancel()
    return running_during_the_load, None


def test_keep_lets_a_generation_run_through_a_load_the_engine_makes_under_it():
    running, ended = asyncio.run(_update(keeps_generations=True))
    assert running == 1 and ended is None


def test_keep_drains_by_the_deadline_through_a_load_the_engine_cannot_make_under_it():
    running, ended = asyncio.run(asyncio.wait_for(_update(keeps_generations=False), 10))
    assert running == 0 and isinstance(ended, DrainTimeout) and ended.code == "drain_timeout"
    assert "ended after 0.2 s" in str(ended)
