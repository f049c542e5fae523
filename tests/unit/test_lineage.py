"""Staleness in updates across learner restarts (learner/lineage.py): a version published again after a restart is
no update, and a sample of an update the restart gave up is never counted as fresh."""

from lightning_ray.learner.lineage import Lineage


def test_no_restart_counts_every_version_as_an_update():
    assert [Lineage().behind(v, 5) for v in (5, 4, 2)] == [0, 1, 3]


def test_a_restart_from_the_latest_checkpoint_republishes_without_an_update():
    """Checkpoint at 91 (checkpoint_every=1), a rank lost: 92 repeats 91's weights, 93 is the next step. The batch
    sampled by 91 while 93 trained is one update behind, not two: max_staleness=1 keeps it."""
    lineage = Lineage()
    lineage.republished(92, kept=91, latest=91)
    assert [lineage.behind(v, 93) for v in (93, 92, 91, 90)] == [0, 1, 1, 2]


def test_the_updates_after_the_checkpoint_are_lost():
    """Checkpoint at 10, updates 11 and 12 published, then a restart: 13 repeats 10, 14 steps from it. 11's and 12's
    samples are of weights the learner no longer descends from; 9's are two updates behind (10, 14)."""
    lineage = Lineage()
    lineage.republished(13, kept=10, latest=12)
    assert [lineage.behind(v, 14) for v in (14, 13, 12, 11, 10, 9)] == [0, 1, None, None, 1, 2]


def test_a_second_restart_before_any_update_keeps_the_first_republish_as_the_checkpoint():
    """Two restarts in a row from checkpoint 91: 92 and 93 both repeat 91 (92 was no update, so it is not lost)."""
    lineage = Lineage()
    lineage.republished(92, kept=91, latest=91)
    lineage.republished(93, kept=91, latest=92)
    assert [lineage.behind(v, 94) for v in (94, 93, 92, 91)] == [0, 1, 1, 1]


def test_an_update_whose_every_signal_is_stale_is_skipped_not_failed():
    """rollout.mode=async: the transitions with a learning signal all sampled too many updates behind, those left
    have none; the learner would refuse them ("no transition with a learning signal") and end the run. A stand-in
    learner gives each version's distance (Lineage's arithmetic), and the update returns before any service is used
    (run.services is None)."""
    from types import SimpleNamespace

    from lightning_ray.config import compose
    from lightning_ray.trainer.collect import Batch
    from lightning_ray.trainer.update import update
    from lightning_ray.types import Transition

    def sampled(version: int, advantage: float) -> Transition:
        return Transition(rollout_id=f"r{version}", group_id="g", span_id=f"s{version}", prompt_ids=[1],
                          response_ids=[2], logprobs=[-1.0], reward=advantage, advantage=advantage,
                          policy_version=version)

    cfg = compose(["run_dir=x", "rollout.mode=async", "algorithm.max_staleness=1"])
    run = SimpleNamespace(cfg=cfg, learner=SimpleNamespace(behind=lambda v: Lineage().behind(v, 5)), services=None)
    batch = Batch(iteration=3, transitions=[sampled(2, 1.0), sampled(1, -1.0), sampled(5, 0.0)],
                  sampling={"groups_with_signal": 1})
    out = update(run, batch)
    assert out.results == [] and out.stale_dropped == 2 and out.staleness == {3: 1, 4: 1, 0: 1}
