"""A quiet terminal: progress for the long phases and a line per iteration, while Ray's, Serve's and the
libraries' logs go to <run_dir>/logs/ (the driver's) and Ray's session log files (the workers'). `verbose=true`
brings them all back to the terminal."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

console = Console(highlight=False, markup=False, soft_wrap=True)  # a log line stays one line


def route_logs(log_dir: Path, verbose: bool = False) -> Path:
    """Write the driver's log records (Ray's, Serve's, the libraries', Python warnings) to `log_dir`/driver.log
    and, unless `verbose`, only there: of ours, records from WARNING up still reach the terminal (a dead worker, a
    failed load need a reader). Ray's and Serve's loggers do not propagate to the root logger: their handlers are
    replaced here, after `ray.serve`'s import installed them. Returns the file."""
    import ray.serve  # noqa: F401  (installs Serve's driver-side handler, replaced below)

    for noisy in ("httpx", "httpx2"):  # a line per HTTP request: noise even in a file
        logging.getLogger(noisy).setLevel(logging.WARNING)
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "driver.log"
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for logger in (root, logging.getLogger("ray"), logging.getLogger("ray.serve")):
        if not verbose:
            for handler in logger.handlers[:]:
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                    logger.removeHandler(handler)
        logger.addHandler(to_file)
    if not verbose:
        ours = logging.StreamHandler()
        ours.setLevel(logging.WARNING)
        ours.addFilter(lambda record: record.name.startswith("lightning_ray"))
        root.addHandler(ours)
    logging.captureWarnings(True)  # libraries' warnings: in the file, not between progress bars
    return path


@contextmanager
def status(description: str, report: bool = True):
    """A long phase without a count (building the model, starting the engine, a training step): a spinner while it
    runs, then, if `report`, one line with how long it took."""
    start = time.perf_counter()
    with console.status(f"{description} ..."):
        yield
    if report:
        console.print(f"{description}: {time.perf_counter() - start:.1f}s")
