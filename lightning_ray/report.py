"""The learning curve of a run as a PNG: mean rollout reward and held-out accuracy per iteration."""

from __future__ import annotations

from pathlib import Path


def plot_learning_curve(history: list[dict], evals: list[dict], path: Path, title: str = "") -> Path:
    """Both curves over iterations done: the rollouts of iteration i were sampled after i iterations (history:
    metrics.jsonl records); evals: {"after", "accuracy"}, `after` iterations (0: before training)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([h["iteration"] for h in history], [h["reward_mean"] for h in history], "o-",
            label="training reward (mean of the iteration's rollouts)")
    ax.plot([e["after"] for e in evals], [e["accuracy"] for e in evals], "s-",
            label="held-out accuracy (greedy)")
    ax.set_xlabel("iterations done")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
