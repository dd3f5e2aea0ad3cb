"""Which adapter version each turn of a multi-turn rollout decodes with.

TRL 1.16 names the adapter afresh on every turn (`trl-policy-v{model_version}`), so an episode running across a
weight sync decodes its later turns with a newer policy than its first, silently: its sample then trains on a
conversation no single policy produced. With TRAINER_PIN_EPISODES (the default) every turn uses the version the
first turn used, for as long as the fleet still serves it: TRL unloads version v - (max_staleness + 1) when it
publishes v, a moment before the rollout process learns v, so a pin is kept while at most max_staleness - 1 newer
versions exist and moves to the newest after that (counted as mixed). `episodes/mixed_versions_frac` in the
metrics is the share of multi-turn episodes whose turns used more than one version, pinned or not.

An episode also keeps who answered each turn (provenance.Answer, noted by FleetRolloutLoop): its sample carries them.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

from lorafleet_trainer.provenance import Answer

MIXED_METRIC = "episodes/mixed_versions_frac"


@dataclass
class Episode:
    """The adapter versions one rollout's turns asked for, and who answered them."""

    pinned: int | None = None
    versions: list[int] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def version_for(self, newest: int, *, pin: bool, max_staleness: int) -> int:
        """The version this turn decodes with, given the newest published one."""
        if self.pinned is None or not pin or newest - self.pinned > max_staleness - 1:
            self.pinned = newest
        self.versions.append(self.pinned)
        return self.pinned

    @property
    def multi_turn(self) -> bool:
        return len(self.versions) > 1

    @property
    def mixed(self) -> bool:
        return len(set(self.versions)) > 1


CURRENT: ContextVar[Episode | None] = ContextVar("lorafleet_episode", default=None)
