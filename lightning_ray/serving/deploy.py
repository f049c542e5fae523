"""Starting Serve apps on the proxy at host:port, waiting until each one serves, and deleting them.

Both waits ask Serve's controller app by app, every 0.25 s. serve.status() would build every deployment's details,
pickling its request router by value on every call (~0.1 s of the caller's CPU on 2 busy cores), and serve.run's and
serve.delete's own waits poll once a second: each start and each delete would wait half a second more on average."""

from __future__ import annotations

import time

from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ApplicationStatus

from lightning_ray.terminal import console


def start_apps(targets: list[serve.RunTarget], host: str, port: int) -> list[str]:
    """Deploy the apps without waiting for them (wait_running: meanwhile, start what else a run needs); their
    names."""
    serve.start(http_options={"host": host, "port": port})
    serve.run_many(targets, wait_for_applications_running=False)
    return [target.name for target in targets]


def wait_running(apps: list[str]) -> None:
    """Until every app is RUNNING; one whose deploy failed raises with Serve's message (as serve.run would)."""
    _wait(apps, ApplicationStatus.RUNNING)


def delete_apps(apps: list[str], timeout_s: float = 60.0) -> None:
    """Delete the apps together and wait until they are gone, their replicas stopped (as serve.delete would)."""
    _get_global_client().delete_apps(apps, blocking=False)
    _wait(apps, ApplicationStatus.NOT_STARTED, time.monotonic() + timeout_s)


def _wait(apps: list[str], status: ApplicationStatus, deadline: float = float("inf")) -> None:
    client, waiting, told = _get_global_client(), list(apps), set()
    while waiting:
        for name in list(waiting):
            serve_status = client.get_serve_status(name)
            state = serve_status.app_status
            if state.status == status:
                waiting.remove(name)
            elif state.status == ApplicationStatus.DEPLOY_FAILED and status == ApplicationStatus.RUNNING:
                raise RuntimeError(f"deploying {name}: {state.message}")
            elif status == ApplicationStatus.RUNNING:
                # a replica the cluster has no room for waits with no end (an autoscaler may yet add a node):
                # Serve's reason, with the resources asked and available, told once (not its slow-start notes)
                for message in {d.message for d in serve_status.deployment_statuses if "scheduled" in d.message} - told:
                    told.add(message)
                    console.print(f"still deploying {name}: {message}")
        if waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Serve apps {', '.join(waiting)} did not reach {status.value} in time")
            time.sleep(0.25)
