"""`VerifyReport`: what one check found, and the text `ddpkit verify` prints for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ddpkit.verification.runs import resume_cut


@dataclass
class VerifyReport:
    """The outcome of one check; `str(report)` is the text `ddpkit verify` prints."""

    check: str  # "equivalence" or "resume"
    passed: bool
    nproc: int
    steps: int
    batch_size: int  # per rank
    dtype: str | None = None
    atol: float | None = None
    rtol: float | None = None
    # equivalence: the first (step, tensor) out of tolerance, and the worst per step
    first_divergence: dict[str, Any] | None = None
    max_abs_diff: list[float] = field(default_factory=list)
    tolerance_used: list[float] = field(default_factory=list)  # max |a-b| / (atol+rtol|b|)
    # resume: what differs between the straight and the resumed run
    differences: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # equivalence: whether any parameter changed in the N-rank run (None: not asked)
    trained: bool | None = None

    @property
    def proved_nothing(self) -> bool:
        """The runs agree, but no parameter changed: agreement proves nothing then."""
        return self.trained is False and self.first_divergence is None and not self.causes

    def to_dict(self) -> dict[str, Any]:
        """The report's fields, as `ddpkit verify --json` prints them."""
        return dict(self.__dict__)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "NO PROOF" if self.proved_nothing else "FAIL"
        if self.check == "equivalence":
            what = (
                f"{self.nproc} processes x batch {self.batch_size} vs 1 process x batch "
                f"{self.nproc * self.batch_size}, {self.steps} steps, "
                f"{self.dtype}, atol {self.atol:g}, rtol {self.rtol:g}"
            )
        else:
            what = (
                f"{self.steps} steps straight vs {resume_cut(self.steps)} + resume + "
                f"{self.steps - resume_cut(self.steps)}, {self.nproc} processes, bit for bit"
            )
        lines = [f"{verdict}  {self.check}: {what}"]
        if self.max_abs_diff:
            lines.append(f"  {self._largest_difference(verdict)}")
        if self.first_divergence:
            d = self.first_divergence
            lines.append(
                f"  first divergence: step {d['step']}, {d['tensor']}: max abs diff "
                f"{d['max_abs']:.3g}, max rel diff {d['max_rel']:.3g}"
            )
        if self.proved_nothing:
            lines.append(
                f"  nothing trained: no parameter changed in {self.steps} steps, so the runs "
                "agree whatever the job does wrong: check that the loss depends on the model "
                "(cross_entropy over a single logit is always 0), the learning rate is not 0 "
                "and the parameters are not frozen"
            )
        lines += [f"  differs: {d}" for d in self.differences]
        lines += [f"  likely cause: {c}" for c in self.causes]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _largest_difference(self, verdict: str) -> str:
        """The largest difference, and how it stands to the tolerance in words that a
        FAIL cannot be read as a pass by."""
        step = max(range(len(self.max_abs_diff)), key=self.max_abs_diff.__getitem__)
        used = max(self.tolerance_used)
        size = f"largest difference: {self.max_abs_diff[step]:.2g} after step {step}"
        share = "under 1% of" if used < 0.01 else f"{used:.0%} of"
        if math.isinf(used):  # an integer buffer (a counter) differs
            return f"{size}, and an integer buffer differs"
        if used > 1:
            return f"{size}, {used:.2g}x the tolerance"
        if verdict != "FAIL":
            return f"{size} ({share} the tolerance)"
        # Within the tolerance, yet FAIL: a difference that is not a number (it compares
        # as neither close nor large), or a cause found apart from the numbers.
        why = (
            "a difference that is not a number (NaN)"
            if self.first_divergence
            else "the cause below"
        )
        return f"{size}, within the tolerance ({share} it), but FAIL on {why}"
