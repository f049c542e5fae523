"""Automatic prompt optimization: python jobs/apo.py [key=value ...]  (Hydra overrides; see configs/apo.yaml).

The policy critiques and rewrites the task's system prompt from its own worst validation rollouts; a rewrite is kept
only when it measures better (lightning_ray/algorithm/apo.py). Writes apo_rounds.jsonl, apo.json and best_prompt.txt
to the run directory; train or evaluate with the result by "task.system_prompt='$(cat <run_dir>/best_prompt.txt)'" (in Hydra's quotes)."""

import json

from lightning_ray.config import APOJobConfig, job


@job("apo", APOJobConfig)
def main(cfg: APOJobConfig) -> None:
    from lightning_ray.algorithm.apo import optimize  # imported late: `--help` and config errors stay instant
    from lightning_ray.terminal import route_logs

    route_logs(cfg.run_path / "logs", cfg.verbose)
    result = optimize(cfg)
    initial, best = result["initial"], result["best"]
    print(json.dumps({"initial": initial["held_out"], "best": best["held_out"]}))
    print(f"best prompt (round {best['round']}): {best['prompt']!r}")
    print(f"held-out reward {initial['held_out']['reward_mean']:.3f} → {best['held_out']['reward_mean']:.3f}, "
          f"accuracy {initial['held_out']['accuracy']:.3f} → {best['held_out']['accuracy']:.3f} "
          f"({result['held_out_tasks']} problems); written to {cfg.run_path}")


if __name__ == "__main__":
    main()
