"""`lightning-ray`: train, serve and evaluate a policy, look into a run's store, report on a run."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
store = typer.Typer(help="A run's trace store, read from its SQLite files (no Ray needed).", no_args_is_help=True)
app.add_typer(store, name="store")

# Hydra's command line passes through as it is: key=value overrides, and its own flags (--cfg job, --hydra-help, -m)
HYDRA = {"allow_extra_args": True, "ignore_unknown_options": True}
Overrides = Annotated[list[str] | None, typer.Argument(
    help="Hydra overrides of configs/train.yaml, e.g. task=sql trainer.iterations=2; --cfg job prints the config",
    show_default=False)]
RunDir = Annotated[Path, typer.Argument(help="a run directory, e.g. runs/2026-11-23_09-12-50", show_default=False)]


class What(str, Enum):
    rollouts = "rollouts"
    spans = "spans"
    transitions = "transitions"


class Format(str, Enum):
    md = "md"
    html = "html"


@app.command(context_settings=HYDRA)
def train(overrides: Overrides = None) -> None:
    """Train the policy behind the task's agent (jobs/train.py); writes metrics, curve and checkpoint to the run dir."""
    from lightning_ray.cli import train as job
    from lightning_ray.cli.common import run

    run(job.main, overrides or [])


@app.command(context_settings=HYDRA)
def imitate(overrides: Overrides = None) -> None:
    """Warm start before RL: fine-tune on the agent's episodes with a teacher behind the endpoint (jobs/imitate.py)."""
    from lightning_ray.cli import imitate as job
    from lightning_ray.cli.common import run

    run(job.main, overrides or [])


@app.command(name="eval", context_settings=HYDRA)
def evaluate(overrides: Overrides = None) -> None:
    """Held-out accuracy of model.path (e.g. model.path=runs/<run>/checkpoint eval.pass_k=4) (jobs/eval.py)."""
    from lightning_ray.cli import eval as job
    from lightning_ray.cli.common import run

    run(job.main, overrides or [])


@app.command(context_settings=HYDRA)
def serve(overrides: Overrides = None) -> None:
    """Serve model.path (e.g. model.path=runs/<run>/checkpoint) on the OpenAI API, with the store API, until Ctrl-C."""
    from lightning_ray.cli import serve as job
    from lightning_ray.cli.common import run

    run(job.main, overrides or [])


@store.command()
def inspect(run_dir: RunDir,
            as_json: Annotated[bool, typer.Option("--json", help="print the summary as one JSON object")] = False):
    """Rollouts by status, rewards, spans by name, policy calls, transitions and iterations of a run's store."""
    from lightning_ray.store.files import summary

    s = summary(run_dir)
    if as_json:
        print(json.dumps(s))
        return
    rewards = s["rewards"]
    print(f"{s['run_dir']}")
    print(f"iterations   {s['iterations']}")
    print(f"rollouts     {s['rollouts']}  " + "  ".join(f"{k} {v}" for k, v in s["rollouts_by_status"].items()))
    if rewards["scored"]:
        print(f"rewards      {rewards['scored']} scored  mean {rewards['mean']:.3f}  min {rewards['min']:g}  "
              f"max {rewards['max']:g}")
    print(f"spans        {s['spans']}  " + "  ".join(f"{k} {v}" for k, v in s["spans_by_name"].items()))
    print(f"transitions  {s['transitions']} from {s['policy_calls']} policy calls")


@store.command()
def export(run_dir: RunDir,
           what: Annotated[What, typer.Option(help="which records, one JSON object a line")] = What.rollouts,
           out: Annotated[Path | None, typer.Option("--out", "-o", help="the JSONL file; default: stdout",
                                                    show_default=False)] = None):
    """A run's rollouts, spans or transitions (as LightningRL makes them, before credit assignment; of training
    rollouts only, never held-out evaluation's) as JSONL."""
    from lightning_ray.store.files import records, shard_files

    shard_files(run_dir)  # not a run directory: fail before -o makes an empty file
    with out.open("w") if out else nullcontext(sys.stdout) as f:
        n = 0
        for n, record in enumerate(records(run_dir, what.value), 1):
            f.write(json.dumps(record) + "\n")
    if out:
        print(f"{n} {what.value} written to {out}", file=sys.stderr)


@app.command()
def report(run_dir: RunDir,
           fmt: Annotated[Format, typer.Option("--format", help="the page's format")] = Format.md,
           out: Annotated[Path | None, typer.Option("--out", "-o", help="its folder; default: RUN_DIR/report",
                                                    show_default=False)] = None):
    """A page with the reward, loss, response-length and held-out accuracy curves (PNG) and a summary table."""
    from lightning_ray.report import write_report

    print(f"written to {write_report(run_dir, fmt.value, out)}")


def main(args: list[str] | None = None) -> int:
    """The console script: bad input (a usage error, a missing run directory) is one line on stderr and exit 2."""
    command = typer.main.get_command(app)
    try:
        return command.main(args, prog_name="lightning-ray", standalone_mode=False) or 0
    except typer.Abort:
        return 130
    except typer.TyperException as e:  # a usage error: typer's own click
        print(f"lightning-ray: error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except (OSError, ValueError) as e:  # store.files.NoStore, report's missing metrics.jsonl, an -o that is a
        # folder or a file, a record that does not read (a truncated metrics.jsonl; a run's config.yaml: ConfigError)
        print(f"lightning-ray: error: {e}", file=sys.stderr)
        return 2
