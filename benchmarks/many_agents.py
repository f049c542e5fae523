"""Many agents at once: a rollout phase with ≥ 1,000 agents running together on the local cluster, beside the same
work with a tenth as many agents.

Every agent is the calc task's own with a slow tool between two tries (`slow_tool_agent`: calc's agent, a sleep of
MANY_AGENTS_TOOL_S seconds, calc's agent again), so most agents wait at once, as agents do on a slow tool; the tiny
model on the HF engine answers their calls through Serve. Each setting starts the platform (Services: store, Serve,
rollout workers), runs the same rollouts to their end and stops it: `--waves` per agent of the large setting, and as
many waves of the baseline as make the same number (agents x waves on each side). A sampler reads, every second, the
attempts running in the store, the resident memory (RSS) of the driver and of every process it started (Ray's
daemons, the store, Serve, the workers) and the rollout workers' threads.

    python benchmarks/many_agents.py [--agents 1000] [--baseline 100] [--workers 4] [--waves 2] [--tool-seconds 20]
                                     [key=value ...]   # Hydra overrides, for both settings

Prints one JSON line per setting (rollouts/s, peak agents running, memory at the start, peak, end and as each wave
ends, threads, rollouts by status and error, spans recorded) and one with the ratios of the large setting to the
baseline and the rollouts each ran. Not part of CI (~20 minutes with the defaults on 2 cores: the baseline's 2,000
rollouts in 20 waves).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from lightning_ray.tasks import calc
from lightning_ray.types import FINISHED

TOOL_SECONDS = "MANY_AGENTS_TOOL_S"


def slow_tool_agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    """task.agent=benchmarks.many_agents:slow_tool_agent: the calc agent twice, a slow tool between."""
    calc.agent(task, base_url=base_url, model=model, api_key=api_key)
    time.sleep(float(os.environ.get(TOOL_SECONDS, "20")))
    return calc.agent(task, base_url=base_url, model=model, api_key=api_key)


class Sampler(threading.Thread):
    """Every second: attempts running (the store's counts), RSS of this process and its descendants, in MiB, and the
    threads of each rollout worker process (Ray names them ray::RolloutWorker...)."""

    def __init__(self, store):
        super().__init__(daemon=True)
        self.store, self.stop, self.samples = store, threading.Event(), []

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.samples.append(self.sample())

    def sample(self) -> dict:
        rss, workers = 0, []
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                rss += (used := p.memory_info().rss)
                if "RolloutWorker" in " ".join(p.cmdline()):
                    workers.append((used, p.num_threads()))
            except psutil.NoSuchProcess:
                continue
        stats = self.store.stats()
        return {"t": time.monotonic(), "running": stats["rollouts"].get("running", 0), "spans": stats["spans"],
                "ended": sum(n for status, n in stats["rollouts"].items() if status in FINISHED),
                "rss_mib": rss / 2**20, "worker_rss_mib": sum(r for r, _ in workers) / 2**20,
                "worker_threads": max((n for _, n in workers), default=0)}


def run(agents: int, workers: int, waves: int, tool_seconds: float, overrides: list[str], root: Path) -> dict:
    from lightning_ray.config import compose
    from lightning_ray.services import Services
    from lightning_ray.tasks import load_splits

    if agents % workers:
        raise SystemExit(f"--agents={agents} is not a multiple of --workers={workers}")
    run_dir = root / "runs" / time.strftime(f"many-agents-{agents}-%Y-%m-%d_%H-%M-%S")
    cfg = compose(["experiment=calc_tiny", f"rollout.num_workers={workers}",
                   f"rollout.agents_per_worker={agents // workers}",
                   "task.agent=benchmarks.many_agents:slow_tool_agent",
                   f"+task.runtime_env.env_vars.{TOOL_SECONDS}='{tool_seconds}'", "rollout.max_tokens=16",
                   f"run_dir={run_dir}", *overrides])
    train_tasks = load_splits(cfg.task)[0]
    tasks = [train_tasks[i % len(train_tasks)] for i in range(agents * waves)]
    with Services(cfg) as services:
        sampler = Sampler(services.store)
        start_sample = sampler.sample()
        sampler.start()
        start = time.perf_counter()
        rollouts = services.run_rollouts(tasks, f"{agents} agents")
        wall = time.perf_counter() - start
        sampler.stop.set()
        sampler.join()
        end_sample = sampler.sample()
    samples = sampler.samples or [end_sample]
    statuses = Counter(r.status for r in rollouts)
    peak = max(samples, key=lambda s: s["rss_mib"])
    return {"benchmark": "many_agents", "agents": agents, "workers": workers, "rollouts": len(rollouts),
            "tool_seconds": tool_seconds, "engine": cfg.engine.kind, "model": cfg.model.path or "tiny",
            "wall_s": round(wall, 1), "rollouts_per_s": round(len(rollouts) / wall, 2),
            "spans": end_sample["spans"] - start_sample["spans"],  # policy calls', tool calls', rewards', rollouts'
            "peak_running": max(s["running"] for s in samples), "statuses": dict(statuses),
            "errors": dict(Counter(r.error for r in rollouts if r.error)),
            "rss_mib": {"start": round(start_sample["rss_mib"]), "peak": round(peak["rss_mib"]),
                        "end": round(end_sample["rss_mib"])},
            # as each wave's rollouts have ended: flat from wave to wave, or growing with the rollouts run
            "rss_mib_by_wave": [round(next((s for s in samples if s["ended"] >= agents * wave), end_sample)["rss_mib"])
                                for wave in range(1, waves + 1)],
            "worker_rss_mib": {"start": round(start_sample["worker_rss_mib"]),
                               "peak": round(max(s["worker_rss_mib"] for s in samples)),
                               "end": round(end_sample["worker_rss_mib"])},
            "worker_threads": {"start": start_sample["worker_threads"],
                               "peak": max(s["worker_threads"] for s in samples),
                               "end": end_sample["worker_threads"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--baseline", type=int, default=100, help="agents of the setting compared against")
    parser.add_argument("--workers", type=int, default=4, help="rollout workers (rollout.num_workers), both settings")
    parser.add_argument("--waves", type=int, default=2, help="rollouts per agent")
    parser.add_argument("--tool-seconds", type=float, default=20.0)
    args, overrides = parser.parse_known_args()
    root = Path(__file__).resolve().parent.parent
    # the same work on both sides: the baseline runs as many waves as the large setting's rollouts take it
    rollouts = args.agents * args.waves
    if rollouts % args.baseline:
        raise SystemExit(f"--agents x --waves = {rollouts} rollouts are not whole waves of --baseline={args.baseline}")
    lines = []
    for agents in (args.baseline, args.agents):
        lines.append(run(agents, args.workers, rollouts // agents, args.tool_seconds, overrides, root))
        print(json.dumps(lines[-1]), flush=True)
    small, large = lines
    print(json.dumps({"benchmark": "many_agents", "ratio": f"{large['agents']} / {small['agents']} agents",
                      "rollouts": {"large": large["rollouts"], "baseline": small["rollouts"]},
                      "rollouts_per_s": round(large["rollouts_per_s"] / small["rollouts_per_s"], 2),
                      "peak_running": round(large["peak_running"] / small["peak_running"], 2),
                      "rss_peak": round(large["rss_mib"]["peak"] / small["rss_mib"]["peak"], 2),
                      "worker_rss_peak": round(large["worker_rss_mib"]["peak"] / small["worker_rss_mib"]["peak"], 2)}))


if __name__ == "__main__":
    main()
