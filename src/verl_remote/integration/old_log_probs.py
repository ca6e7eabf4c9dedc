"""Where a step's old log-probs (PPO's ratio anchor) come from: verl's second forward pass, or the sampler's own.

verl computes the old log-probs with a forward pass of the trainer over every sampled response
(``compute_log_prob``), although in a synchronous run the sampler drew those tokens from the same weights a moment
before and returned their log-probs (``rollout_log_probs``, as verl asks by default:
``actor_rollout_ref.rollout.calculate_log_probs``). Where the two are the same numbers, the pass is work for
nothing: on a remote backend a round trip to the service per step (docs/measurements.md).

``remote_old_log_probs.source=auto`` (the default) checks: at the first two steps of a run (the second samples the
first trained weights, so it checks the weight sync too) and at every ``check_every``-th step, verl's pass runs as
usual and the sampler's log-probs are compared with it over every response token. While every check found them
within ``tolerance``, the other steps take the sampler's as the old log-probs and skip the pass; from a check that
did not, every step runs it, as verl does. The run says which in one line and logs
``verl_remote/old_log_probs_from_sampler`` at every step (1 or 0) and each check's largest difference
(``verl_remote/sampler_log_prob_diff_max``). ``source=recompute`` runs verl's pass at every step.

Only a synchronous run's sampler samples the weights that train (an overlapped one samples the next step on the
weights before): anything else recomputes, as does a run that asks verl to correct for the sampler
(``algorithm.rollout_correction.rollout_is`` or ``rollout_rs``, whose point is that the two differ) or one in
verl's own bypass mode (verl then takes the sampler's itself, unchecked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

__all__ = ["SOURCES", "OldLogProbs", "max_difference", "old_log_probs_problem"]

#: ``remote_old_log_probs.source``'s values.
SOURCES = ("auto", "recompute")
SECTION = "remote_old_log_probs"
#: The defaults (verl_remote.yaml's) of a config without the section.
TOLERANCE = 1e-4
CHECK_EVERY = 10
#: The checks a run makes before it takes the sampler's: its first step's, and its second's (the first trained
#: weights, synced to the sampler).
FIRST_CHECKS = 2


def old_log_probs_problem(config: Any) -> str | None:
    """What is wrong with the run's ``remote_old_log_probs`` section, in one line; None when nothing is."""
    source = OmegaConf.select(config, f"{SECTION}.source", default="auto")
    if source not in SOURCES:
        return f"{SECTION}.source={source}: expected one of {', '.join(SOURCES)}"
    tolerance = OmegaConf.select(config, f"{SECTION}.tolerance", default=TOLERANCE)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 <= tolerance < float("inf"):
        return f"{SECTION}.tolerance={tolerance}: expected a number >= 0 (the largest log-prob difference accepted)"
    every = OmegaConf.select(config, f"{SECTION}.check_every", default=CHECK_EVERY)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        return f"{SECTION}.check_every={every}: expected an integer >= 0 (steps between checks; 0: the first two only)"
    return None


@dataclass
class OldLogProbs:
    """One run's choice, step by step: :meth:`plan` says what a step does, :meth:`checked` takes a check's result."""

    tolerance: float
    check_every: int = 0
    #: Why the run never takes the sampler's (said in the run's log); empty when it may.
    reason: str = ""
    #: ``algorithm.rollout_correction.bypass_mode``: verl's pass then puts the sampler's, unchecked.
    bypass: bool = False
    checks: int = 0
    failed: bool = False

    @classmethod
    def of(cls, config: Any, *, overlap: bool) -> OldLogProbs:
        source = str(OmegaConf.select(config, f"{SECTION}.source", default="auto"))
        tolerance = float(OmegaConf.select(config, f"{SECTION}.tolerance", default=TOLERANCE))
        every = int(OmegaConf.select(config, f"{SECTION}.check_every", default=CHECK_EVERY))
        correction = OmegaConf.select(config, "algorithm.rollout_correction", default=None) or {}
        reason = ""
        if source == "recompute":
            reason = f"{SECTION}.source=recompute"
        elif overlap:
            reason = "the run samples while it trains: its samples are of the weights before"
        elif not bool(OmegaConf.select(config, "actor_rollout_ref.rollout.calculate_log_probs", default=False)):
            reason = "actor_rollout_ref.rollout.calculate_log_probs=false: the sampler returns none"
        elif correction.get("bypass_mode"):
            reason = "algorithm.rollout_correction.bypass_mode=true: verl takes the sampler's itself"
        elif correction.get("rollout_is") or correction.get("rollout_rs"):
            reason = "algorithm.rollout_correction corrects for the sampler: verl's pass is its reference"
        return cls(tolerance=tolerance, check_every=every, reason=reason, bypass=bool(correction.get("bypass_mode")))

    def plan(self, step: int) -> str:
        """What ``step`` does: ``"sampler"`` (the sampler's, no pass), ``"check"`` (the pass, then compare) or
        ``"recompute"`` (the pass)."""
        if self.reason or self.failed:
            return "recompute"
        if self.checks < FIRST_CHECKS or (self.check_every and step % self.check_every == 0):
            return "check"
        return "sampler"

    def current(self, plan: str) -> bool:
        """Whether a step that did ``plan`` has the old log-probs of the weights as they are: the sampler's found
        the same, or verl's pass at these weights (not in verl's bypass mode)."""
        return plan == "sampler" or not self.bypass

    def checked(self, difference: float, step: int) -> str | None:
        """Take ``step``'s check; the line that says what the run does from then on, when that changed."""
        self.checks += 1
        if not difference <= self.tolerance:  # NaN included
            self.failed = True
            return (
                f"verl-remote: the sampler's log-probs differ from the trainer's by up to {difference:.3g} at step "
                f"{step}, more than {SECTION}.tolerance={self.tolerance:g}: verl's forward pass computes the old "
                "log-probs at every step"
            )
        if self.checks != FIRST_CHECKS:
            return None
        again = f"every {self.check_every} steps" if self.check_every else "no more"
        return (
            f"verl-remote: from step {step + 1} the old log-probs are the sampler's, without verl's second forward "
            f"pass: they equal the trainer's within {self.tolerance:g} (checked {again}; "
            f"{SECTION}.source=recompute keeps the pass)"
        )


def max_difference(old_log_probs: Any, sampled_log_probs: Any, response_mask: Any) -> float:
    """The largest ``|old - sampled|`` over the response tokens (jagged or padded tensors of one layout)."""
    import torch

    def dense(value: Any) -> torch.Tensor:
        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        return torch.nested.to_padded_tensor(tensor, 0) if tensor.is_nested else tensor

    old, sampled, mask = dense(old_log_probs), dense(sampled_log_probs), dense(response_mask).bool()
    if old.shape != sampled.shape or old.shape != mask.shape:
        raise ValueError(
            f"the sampler's log-probs ({tuple(sampled.shape)}) and verl's ({tuple(old.shape)}) are not of the "
            f"response mask's layout ({tuple(mask.shape)})"
        )
    if not bool(mask.any()):
        return 0.0
    return float((old.double() - sampled.double()).abs()[mask].max())
