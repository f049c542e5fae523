"""A run's curves as PNGs: the learning curve the trainer writes at the end (mean rollout reward and held-out
accuracy per iteration), and `lightning-ray report`'s page (Markdown or HTML) with one curve per metric and a
summary table, made from the run directory's metrics.jsonl."""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path

# (file stem, title, metrics.jsonl field): the report's curves over iterations; held-out accuracy is added apart
CURVES = [("reward", "training reward (mean of the iteration's rollouts)", "reward_mean"),
          ("loss", "policy loss", "loss"),
          ("response_length", "response length (policy tokens per rollout)", "action_tokens_mean")]
ACCURACY = ("heldout_accuracy", "held-out accuracy (greedy)")


def plot_learning_curve(history: list[dict], evals: list[dict], path: Path, title: str = "") -> Path:
    """Both curves over iterations done: the rollouts of iteration i were sampled after i iterations (history:
    metrics.jsonl records); evals: {"after", "accuracy"}, `after` iterations (0: before training)."""
    fig, ax = _axes()
    ax.plot([h["iteration"] for h in history], [h["reward_mean"] for h in history], "o-",
            label="training reward (mean of the iteration's rollouts)")
    ax.plot([e["after"] for e in evals], [e["accuracy"] for e in evals], "s-",
            label="held-out accuracy (greedy)")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    return _save(fig, ax, path, title)


def write_report(run_dir: Path, fmt: str = "md", out_dir: Path | None = None) -> Path:
    """report.md or report.html in out_dir (default <run_dir>/report), beside a PNG per curve; returns the page."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no metrics.jsonl in it)")
    history = _lines(path)
    if not history:
        raise FileNotFoundError(f"{path}: no iteration written yet")
    evals = [h[k] for h in history for k in ("eval_before", "eval") if k in h]
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = []
    for stem, title, key in CURVES:
        points = [(h["iteration"], h[key]) for h in history if key in h]
        if points:
            figures.append((title, _curve(points, title, out_dir / f"{stem}.png")))
    if evals:
        stem, title = ACCURACY
        figures.append((title, _curve([(e["after"], e["accuracy"]) for e in evals], title, out_dir / f"{stem}.png",
                                      xlabel="iterations done")))
    rows = _summary(history, evals)
    page = out_dir / f"report.{fmt}"
    page.write_text((_markdown if fmt == "md" else _html)(run_dir, rows, figures))
    return page


def _lines(path: Path) -> list[dict]:
    """metrics.jsonl's records; a last line still being written (a running job's; a job killed mid-write) is left
    out, said on stderr. A line cut off before others is a ValueError: one line on the CLI."""
    text = path.read_text()
    lines = [line for line in text.split("\n") if line.strip()]
    history = []
    for n, line in enumerate(lines, 1):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                print(f"{path}: its last line is not written yet; the report leaves it out", file=sys.stderr)
                break
            raise ValueError(f"{path}: line {n} is not JSON ({e}): was it cut off?") from None
    return history


def _summary(history: list[dict], evals: list[dict]) -> list[tuple[str, str]]:
    first, last = history[0], history[-1]
    before = first.get("eval_before", {})  # its seconds are in no iteration's
    rows = [("iterations", str(len(history))),
            ("training reward", f"{first['reward_mean']:.3f} → {last['reward_mean']:.3f}"),
            ("rollouts", str(sum(h["rollouts"] for h in history))),
            ("transitions", str(sum(h["transitions"] for h in history))),
            ("policy updates", f"{sum(h['updated'] for h in history)} (policy v{last['policy_version']})"),
            ("trained tokens", str(sum(h.get("trained_tokens", 0) for h in history))),
            ("seconds", f"{sum(map(loop_seconds, history)) + before.get('seconds', 0):.0f}")]
    if evals:
        rows.insert(2, ("held-out accuracy", " → ".join(
            f"{e['accuracy']:.3f} " + (f"after {e['after']}" if e["after"] else "before") for e in evals)))
    return rows


def loop_seconds(line: dict) -> float:
    """An iteration's seconds on the training loop: an asynchronous batch's rollout and adapt ran while the update
    before it trained (what the loop waited for them is its `wait`), so they are not added again."""
    seconds = line["seconds"]
    return sum(v for phase, v in seconds.items() if "wait" not in seconds or phase not in ("rollout", "adapt"))


def _markdown(run_dir: Path, rows, figures) -> str:
    lines = [f"# Run {run_dir.name}", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    lines += [f"![{title}]({png.name})\n" for title, png in figures]
    return "\n".join(lines)


def _html(run_dir: Path, rows, figures) -> str:
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    images = "".join(f'<p><img src="{png.name}" alt="{html.escape(title)}"></p>' for title, png in figures)
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>Run {html.escape(run_dir.name)}</title>"
            f"</head><body><h1>Run {html.escape(run_dir.name)}</h1><table>{table}</table>{images}</body></html>\n")


def _curve(points: list[tuple], title: str, path: Path, xlabel: str = "iteration") -> Path:
    fig, ax = _axes()
    ax.plot(*zip(*points), "o-")
    ax.set_xlabel(xlabel)
    return _save(fig, ax, path, title)


def _axes():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.set_xlabel("iterations done")
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
