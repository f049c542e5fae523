"""Which policy versions were updates. After a restart the learner's ranks go on from the run's latest checkpoint and
rank 0 publishes those weights again as the next version (learner/driver.py): that version is no update, and the
updates published after the checkpoint are lost, no longer the learner's past. Staleness (trainer/update.py,
algorithm.max_staleness) counts updates, not versions: a batch sampled just before a restart is not dropped for a
version number that changed no weight, and a sample of lost weights is never trained as if they were the learner's."""

from __future__ import annotations


class Lineage:
    def __init__(self):
        self.same_as: dict[int, int] = {}  # a version published again -> the update (or initial) version it repeats
        self.lost: set[int] = set()  # updates the learner gave up, going back to a checkpoint before them

    def republished(self, version: int, kept: int, latest: int) -> None:
        """`version` holds `kept`'s weights (the checkpoint's) again; the updates after `kept`, up to the `latest`
        version published, are lost."""
        self.lost |= {v for v in range(kept + 1, latest + 1) if v not in self.same_as}
        self.same_as[version] = self.same_as.get(kept, kept)

    def behind(self, sampled: int, current: int) -> int | None:
        """The updates from `sampled`'s weights to `current`'s; None when `sampled`'s were lost."""
        sampled = self.same_as.get(sampled, sampled)
        if sampled in self.lost:
            return None
        return sum(v not in self.same_as and v not in self.lost for v in range(sampled + 1, current + 1))
