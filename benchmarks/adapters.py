"""An adapter per agent against one shared adapter, on the same work: the sql workflow (SmolLM2-135M; its writer's
and rewriter's calls trained, the checker's served by the base) trained for the same iterations twice from the same
start, side by side in one run: once with one LoRA adapter for both agents, once with one for each
(algorithm.adapters). Held-out accuracy before and after, seconds per iteration, and per iteration each arm's
reward and the calls with a learning signal (per adapter where there are two).

    python benchmarks/adapters.py [--iterations 6] [key=value ...]   # Hydra overrides, both runs
    python benchmarks/adapters.py model.path=runs/warm_start-<time>/imitation/checkpoint seed=2   # from imitation

SmolLM2 answers no held-out sql question before imitation (benchmarks/warm_start.py): start from an imitation
checkpoint, with another seed than the imitation's so RL draws other questions. Both arms serve through LoRA (the
adapter sync: an adapter per agent needs it), at the same learning rate. Not part of CI. Prints one JSON line per
arm and one comparing them, and writes adapters.json in runs/adapters-<time>/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from learning import trained

from lightning_ray.config import compose

# the second arm starts where the first did: its accuracy before training is the first's
ARMS = {"shared": [],
        "per_agent": ["algorithm.adapters={write:[writer],rewrite:[rewriter]}", "trainer.eval_before=false"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3, help="LoRA's (both arms)")
    args, overrides = parser.parse_known_args()
    root = Path(__file__).resolve().parents[1] / "runs" / time.strftime("adapters-%Y-%m-%d_%H-%M-%S")
    every = ["experiment=sql_smollm2", "learner.lora={sync: adapter}", f"learner.lr={args.lr}",
             f"trainer.iterations={args.iterations}", f"trainer.eval_every={args.iterations}", "task.eval_size=100",
             "rollout.tasks_per_iteration=8", "rollout.max_tokens=160", *overrides]
    runs = {}
    for name, extra in ARMS.items():
        cfg = compose([*every, *extra, f"run_dir={root / name}"])
        result = trained(cfg)
        records = [json.loads(line) for line in (cfg.run_path / "metrics.jsonl").read_text().splitlines()]
        runs[name] = {"run": name, **result,
                      "iteration_s": round(sum(sum(r["seconds"].values()) - r["seconds"].get("eval", 0.0)
                                               for r in records) / len(records), 1),
                      "groups_with_signal": [r["groups_with_signal"] for r in records],
                      "adapters": [r.get("adapters") for r in records]}
        print(json.dumps(runs[name]), flush=True)
    shared, per_agent = runs["shared"], runs["per_agent"]
    comparison = {"benchmark": "adapters", "iterations": args.iterations, "overrides": overrides,
                  "accuracy_before": shared["accuracy"][0][1],
                  "accuracy_after": {k: r["accuracy"][-1][1] for k, r in runs.items()},
                  "per_agent_minus_shared_points": round(
                      100 * (per_agent["accuracy"][-1][1] - shared["accuracy"][-1][1]), 1),
                  "iteration_time_ratio": round(per_agent["iteration_s"] / shared["iteration_s"], 2)}
    print(json.dumps(comparison), flush=True)
    (root / "adapters.json").write_text(json.dumps({**comparison, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
