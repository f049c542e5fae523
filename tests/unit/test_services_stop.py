"""Services stops every part it started even when one part's stop fails (a learner whose node is gone, a store that
died): the rest still stop, and the first failure is raised after. The parts here are stand-ins whose stop fails on
demand, which real ones cannot be made to do; tests/integration/rollout/test_rollout_agents.py stops a real run that
failed to start."""

from __future__ import annotations


from lightning_ray.services import Services


class Part:
    def __init__(self, log: list, name: str, fails: bool = False):
        self.log, self.name, self.fails = log, name, fails

    def stop(self):
        self.log.append(f"{self.name}.stop")
        if self.fails:
            raise RuntimeError(f"{self.name} is gone")

    def close(self, timeout: float | None = None):
        self.log.append(f"{self.name}.close")


def stopped(learner_fails: bool) -> tuple[list, Exception | None]:
    log: list = []
    services = Services.__new__(Services)  # its parts set by hand: no Ray started
    services.learner, services.store = Part(log, "learner", fails=learner_fails), Part(log, "store")
    services.apps, services.workers, services.registry, services.owns_ray = [], [], None, False
    services.signals, services.lock = {}, Part(log, "run_dir lock")
    try:
        services.__exit__(None, None, None)
    except RuntimeError as e:
        return log, e
    return log, None


def test_a_part_that_fails_to_stop_does_not_leave_the_others_running():
    log, error = stopped(learner_fails=True)
    assert log == ["learner.stop", "learner.close", "store.close", "run_dir lock.close"]  # before: the store was
    # never closed
    assert str(error) == "learner is gone"


def test_parts_stop_in_order_and_nothing_is_raised_when_all_stop():
    assert stopped(learner_fails=False) == (["learner.stop", "learner.close", "store.close", "run_dir lock.close"],
                                            None)
