"""Warm start by imitation, then RL: can an agent that starts at 0.00 learn? (SmolLM2-135M on the sql and rag tasks:
RL alone cannot lift a reward that is always 0.) Held-out accuracy before, after the imitation phase (jobs/imitate.py:
the task's oracle behind the endpoint, SFT on its episodes) and after RL from its checkpoint, in one run, with each
phase's wall minutes; `rl_gain` is what RL added over the warm start alone.

    python benchmarks/warm_start.py --imitation-minutes 20 --rl-minutes 40 task=sql \\
        'algorithm.select.agents=[writer,rewriter]' \\
        --imitation learner.lr=5e-5 --rl rollout.tasks_per_iteration=8   # Hydra overrides: both phases, or one

Each phase ends after the iteration running when its minutes run out (trainer.max_minutes); held-out evaluation
(task.eval_size, 100 by default here) before and after each. Not part of CI. Prints one JSON line and writes
warm_start.json beside the RL run (runs/warm_start-<time>/{imitation,rl}/).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from learning import trained

from lightning_ray.config import compose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--imitation-minutes", type=float, default=20.0)
    parser.add_argument("--rl-minutes", type=float, default=40.0)
    for phase in ("imitation", "rl"):
        parser.add_argument(f"--{phase}", action="append", default=[], metavar="KEY=VALUE",
                            help=f"a Hydra override for the {phase} phase only (repeatable)")
    args, overrides = parser.parse_known_args()
    root = Path(__file__).resolve().parents[1] / "runs" / time.strftime("warm_start-%Y-%m-%d_%H-%M-%S")
    every = ["task.eval_size=100", "trainer.iterations=1000", "trainer.eval_every=1000", *overrides]
    imitation = compose([*every, *args.imitation, f"trainer.max_minutes={args.imitation_minutes}",
                         f"run_dir={root / 'imitation'}"], config_name="imitate")
    warm = trained(imitation)
    rl = trained(compose([*every, *args.rl, f"trainer.max_minutes={args.rl_minutes}", f"run_dir={root / 'rl'}",
                          f"model.path={imitation.run_path / 'checkpoint'}"]))
    result = {"benchmark": "warm_start", "teacher": imitation.teacher.kind, "overrides": overrides,
              "imitation_overrides": args.imitation, "rl_overrides": args.rl,
              "accuracy_before": warm["accuracy"][0][1], "accuracy_after_imitation": warm["accuracy"][-1][1],
              "accuracy_after_rl": rl["accuracy"][-1][1],
              "rl_gain": round(rl["accuracy"][-1][1] - warm["accuracy"][-1][1], 3),
              "training_minutes": round(sum(v for phase in (warm, rl) for k, v in phase["seconds_by_phase"].items()
                                            if k != "eval") / 60, 1),  # the budget: evaluations left out
              "wall_minutes": round(warm["wall_minutes"] + rl["wall_minutes"], 1),
              "imitation": warm, "rl": rl}
    (root / "warm_start.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
