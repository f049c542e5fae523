"""Held-out evaluation: python jobs/eval.py model.path=<model dir or checkpoint> [eval.pass_k=4] [key=value ...]

The same configuration as training (configs/train.yaml): the task's held-out split goes through the same policy
server and the same agent. Prints greedy accuracy (and pass@k) and writes it to <run_dir>/eval.json.
The same as `lightning-ray eval [key=value ...]` (lightning_ray/cli/eval.py)."""

from lightning_ray.cli.eval import main

if __name__ == "__main__":
    main()
