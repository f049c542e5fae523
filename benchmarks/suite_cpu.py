"""Where the test suite's time goes: per test, the seconds it took (setup, call and teardown) and the seconds the whole
machine's CPUs were busy meanwhile (/proc/stat: the test's Ray, Serve and job processes included), so a test that
waits shows as idle cores and one that computes as busy ones.

Record, as a pytest plugin (one JSON line per test, appended):
    SUITE_CPU=runs/suite_cpu.jsonl .venv/bin/python -m pytest -p benchmarks.suite_cpu ...
Summarize one record, or compare two (e.g. before and after a change) file by file, as ratios:
    .venv/bin/python benchmarks/suite_cpu.py runs/before.jsonl [runs/after.jsonl]
The summary's last line is JSON: the totals and the busy share of the machine's cores."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest


def busy_seconds() -> float:
    """CPU-seconds every core of the machine has spent busy since boot (user, nice, system, irq, softirq, steal)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, busy = time.monotonic(), busy_seconds()
    yield
    with open(os.environ.get("SUITE_CPU", "suite_cpu.jsonl"), "a") as out:
        out.write(json.dumps({"test": item.nodeid, "wall_s": round(time.monotonic() - started, 2),
                              "busy_s": round(busy_seconds() - busy, 2)}) + "\n")


def by_file(path: str) -> dict[str, list[float]]:
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        totals = files[row["test"].split("::")[0]]
        totals[0] += row["wall_s"]
        totals[1] += row["busy_s"]
    return files


def main(paths: list[str]) -> None:
    runs, cores = [by_file(p) for p in paths], os.cpu_count()
    names = sorted(set().union(*runs), key=lambda n: -max(r.get(n, [0, 0])[0] for r in runs))
    header = "".join(f"{'wall s':>9s}{'busy s':>9s}" for _ in runs) + ("  wall ratio" if len(runs) > 1 else "")
    print(f"{'file':58s}{header}")
    for name in names:
        cells = [r.get(name, [0.0, 0.0]) for r in runs]
        ratio = f"  {cells[1][0] / cells[0][0]:.2f}" if len(runs) > 1 and cells[0][0] else ""
        print(f"{name[-58:]:58s}" + "".join(f"{w:9.0f}{b:9.0f}" for w, b in cells) + ratio)
    totals = []
    for path, run in zip(paths, runs):
        wall, busy = sum(w for w, _ in run.values()), sum(b for _, b in run.values())
        totals.append({"file": path, "wall_s": round(wall), "busy_s": round(busy), "cores": cores,
                       "busy_share": round(busy / (wall * cores), 2)})
    ratio = {"wall_ratio": round(totals[1]["wall_s"] / totals[0]["wall_s"], 3)} if len(totals) > 1 else {}
    print(json.dumps({"benchmark": "suite_cpu", "runs": totals, **ratio}))


if __name__ == "__main__":
    if not 1 <= len(sys.argv) - 1 <= 2:
        raise SystemExit("usage: suite_cpu.py RECORD.jsonl [OTHER.jsonl]")
    main(sys.argv[1:])
