"""What a run reports at its end: the mean reward of every training step, and the line that sums it up; the
share of each phase of a step that waited on the service, where the backend reports its waits."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["REWARD_METRIC", "RunSummary"]

#: verl's mean reward of a step's batch, the metric the summary and the console's reward column read.
REWARD_METRIC = "critic/score/mean"


@dataclass
class RunSummary:
    """What the TaskRunner reports back: the mean reward of every training step, in order."""

    rewards: list[float] = field(default_factory=list)
    first_step: int = 1
    shares: dict[str, list[float]] = field(default_factory=dict)  # phase -> each step's waited share of it
    restarts: int = 0  # how often the run was restarted after a transient fault (verl_remote.runtime.restarts)

    def take(self, other: RunSummary) -> None:
        """Become ``other`` (what the run's TaskRunner returned, or had so far when the run stopped)."""
        self.rewards[:] = other.rewards
        self.first_step = other.first_step
        self.shares = {phase: list(shares) for phase, shares in other.shares.items()}

    def extend(self, later: RunSummary) -> None:
        """Add what a later attempt of the run trained (a restart, resumed from a checkpoint): its steps replace
        those of this summary from its first step on, which the attempt trained again."""
        if later.rewards:
            if not self.rewards:
                self.first_step = later.first_step
            kept = max(0, min(len(self.rewards), later.first_step - self.first_step))
            self.rewards[kept:] = later.rewards
        for phase, shares in later.shares.items():
            self.shares.setdefault(phase, []).extend(shares)

    def waits_line(self) -> str | None:
        """What the service's latency cost the run: per phase, the median share of verl's time it waited."""
        if not self.shares:
            return None
        names = {
            "gen": "generation",
            "old_log_prob": "the old log-probs",
            "ref": "the reference log-probs",
            "update_actor": "the update",
            "update_weights": "the weight sync",
            "save_checkpoint": "the checkpoint",
        }
        order = ["gen", "old_log_prob", "ref", "update_actor", "update_weights", "save_checkpoint"]
        phases = sorted(self.shares, key=lambda p: order.index(p) if p in order else len(order))
        parts = [f"{100 * statistics.median(self.shares[p]):.0f}% of {names.get(p, p)}" for p in phases]
        steps = max(len(v) for v in self.shares.values())
        return f"verl-remote: waiting on the service took {', '.join(parts)} (medians over {steps} steps)"

    def line(self, window: int = 3) -> str:
        if not self.rewards:
            return "verl-remote: no training step ran"
        head, tail = self.rewards[:window], self.rewards[-window:]
        last_step = self.first_step + len(self.rewards) - 1
        restarted = f"; restarted {self.restarts} {'time' if self.restarts == 1 else 'times'}" if self.restarts else ""
        return (
            f"verl-remote: {len(self.rewards)} steps ({self.first_step}-{last_step}); mean reward "
            f"{sum(head) / len(head):.3f} over the first {len(head)}, "
            f"{sum(tail) / len(tail):.3f} over the last {len(tail)}{restarted}"
        )
