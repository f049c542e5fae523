"""One short run of `lightning-ray train`, shared by this folder's tests of the command (test_cli.py) and of what an
operator sees of a run (test_observability.py): a job start costs a minute or two on this machine, so the suite
starts one for both."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest
from helpers import CLI, ROOT, TINY, free_port
from prometheus_client.parser import text_string_to_metric_families


class Scraper:
    """Reads the job's metrics from Ray's Prometheus endpoint while it runs: the last value of every sample seen
    (series of processes that have ended drop out of later scrapes). Once the store's HTTP API is up, it posts one
    undecodable OTLP payload, an error the store counts by kind."""

    def __init__(self, metrics_port: int, serve_port: int):
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.otlp_url = f"http://127.0.0.1:{serve_port}/store/v1/traces"
        self.samples: dict[tuple, float] = {}
        self.bad_otlp_sent = False

    def __call__(self) -> None:
        try:
            if not self.bad_otlp_sent:
                r = httpx.post(self.otlp_url, content=b"not protobuf",
                               headers={"content-type": "application/x-protobuf"}, timeout=5)
                self.bad_otlp_sent = r.status_code == 400
            text = httpx.get(self.metrics_url, timeout=5).text
        except httpx.HTTPError:  # not up yet
            return
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("ray_lightning_ray_"):
                    self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def values(self, name: str, **labels) -> list[float]:
        return [v for (n, ls), v in self.samples.items() if n == name and labels.items() <= dict(ls).items()]


@pytest.fixture(scope="session")
def cli_run(tiny_model_path, tmp_path_factory) -> dict:
    """`lightning-ray train` on the tiny model (helpers.TINY), run to its end while its metrics are scraped about twice
    a second (its iterations take about one): two iterations of PPO (its value head gives every transition a signal,
    so each iteration updates, syncs and serves a new version, for sure; a group baseline's iteration can have none),
    evaluated before and after, and store.keep_iterations=1: after the second iteration, the spans of the first (and
    of the evaluation before it) are deleted. Gives its run directory, terminal output, metrics.jsonl's lines and the
    scraper."""
    run_dir = tmp_path_factory.mktemp("cli-run") / "run"
    run_dir.mkdir()
    metrics_port, serve_port = free_port(), free_port()
    scraper = Scraper(metrics_port, serve_port)
    terminal = run_dir.parent / "terminal.txt"
    env = {**os.environ, "RAY_metrics_report_interval_ms": "1000"}  # Ray's default exports every 10 s
    with open(terminal, "w") as out:
        job = subprocess.Popen([*CLI, "train", *TINY, "algorithm=ppo", "trainer.iterations=2", "trainer.eval_every=2",
                                "store.keep_iterations=1", f"serve.port={serve_port}",
                                f"ray.metrics_export_port={metrics_port}", f"hydra.run.dir={run_dir}"],
                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while job.poll() is None and time.monotonic() < deadline:
            scraper()
            time.sleep(0.5)
        if job.poll() is None:
            job.kill()
    output = terminal.read_text()
    assert job.returncode == 0, output[-3000:]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"dir": run_dir, "output": output, "history": history, "metrics": scraper}
