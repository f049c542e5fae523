"""Staleness in updates across learner restarts (learner/lineage.py): a version published again after a restart is
no update, and a sample of an update the restart gave up is never counted as fresh; which of a batch's transitions
the learner then trains on (trainer/update.py to_train)."""

from lightning_ray.config import AlgorithmConfig
from lightning_ray.learner.lineage import Lineage
from lightning_ray.trainer.update import to_train
from lightning_ray.types import Transition


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



def sampled(group: str, advantage: float, i: int = 0) -> Transition:
    return Transition(rollout_id=f"{group}{i}", group_id=group, span_id=f"{group}{i}", prompt_ids=[1],
                      response_ids=[2], logprobs=[-1.0], reward=advantage, advantage=advantage, policy_version=0)


def test_an_update_whose_every_signal_is_stale_trains_nothing():
    """rollout.mode=async: the transitions with a learning signal all sampled too many updates behind; those left
    have none, which the learner would refuse ("no transition with a learning signal"), ending the run."""
    batch = [sampled("a", 1.0), sampled("a", -1.0, 1), sampled("b", 0.0)]
    assert to_train(batch, [3, 2, 0], AlgorithmConfig(max_staleness=1)) == ([], 2)
    assert to_train(batch, [1, None, 0], AlgorithmConfig(max_staleness=1)) == ([0, 2], 1)  # None: lost in a restart


def test_dynamic_samplings_dropped_groups_stay_out_with_a_kl_term():
    """The learner keeps a group without a signal when a KL or entropy term is in the loss: dynamic sampling's
    dropped groups were trained, diluting the token mean of the groups it sampled for."""
    batch = [sampled("signal", 1.0), sampled("signal", -1.0, 1), sampled("alike", 0.0), sampled("alike", 0.0, 1)]
    kl = {"kl_coef": 0.1}
    assert to_train(batch, [0] * 4, AlgorithmConfig(**kl, dynamic_sampling=True)) == ([0, 1], 0)
    assert to_train(batch, [0] * 4, AlgorithmConfig(**kl)) == ([0, 1, 2, 3], 0)  # without it: the learner decides
