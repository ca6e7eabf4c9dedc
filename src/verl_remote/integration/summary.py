"""What a run reports at its end: the mean reward of every training step, and the line that sums it up."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunSummary"]


@dataclass
class RunSummary:
    """What the TaskRunner reports back: the mean reward of every training step, in order."""

    rewards: list[float] = field(default_factory=list)
    first_step: int = 1

    def line(self, window: int = 3) -> str:
        if not self.rewards:
            return "verl-remote: no training step ran"
        head, tail = self.rewards[:window], self.rewards[-window:]
        last_step = self.first_step + len(self.rewards) - 1
        return (
            f"verl-remote: {len(self.rewards)} steps ({self.first_step}-{last_step}); mean reward "
            f"{sum(head) / len(head):.3f} over the first {len(head)}, "
            f"{sum(tail) / len(tail):.3f} over the last {len(tail)}"
        )
