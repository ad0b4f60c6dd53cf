"""The gate's verdict: pass, fail or invalid, each reason named with its evidence and a
replay command, the worst error against its bound, the timing, the seconds the verdict
took, and what was not checked (never folded into a pass)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Every reason the gate gives, and what it means. "invalid": the candidate could not be
# judged (it does not load or does not return the task's output); "fail": judged, wrong.
REASONS: dict[str, tuple[str, str]] = {
    "not_loadable": ("invalid", "the candidate does not import, or names no callable"),
    "wrong_signature": ("invalid", "the candidate does not return one array of the reference's shape and dtype"),
    "no_pallas_call": ("fail", "the candidate's jaxpr holds no Pallas kernel: the work is not done in Pallas"),
    "no_pallas_call_in_vjp": ("fail", "the candidate's backward pass holds no Pallas kernel"),
    "work_outside_pallas": ("fail", "costly primitives outside pallas_call exceed the stated share of the op's cost"),
    "host_callback": ("fail", "the jaxpr calls back to the host or to foreign code (io/pure callback, FFI)"),
    "hidden_state": ("fail", "a call's result depends on earlier calls: right first, wrong after another input"),
    "nondeterministic": ("fail", "two runs on the same input differ in their bits"),
    "poisoned_output": ("fail", "the output holds the poison value (NaN) where the oracle is finite: unwritten tiles"),
    "lower_precision": ("fail", "the error exceeds the declared precision's bound but fits a lower precision's"),
    "wrong_values": ("fail", "the output is outside its derived bound at the shown shapes"),
    "wrong_beyond_shown_shapes": ("fail", "right at the shown shapes, outside the bound at drawn ones"),
    "wrong_under_option": ("fail", "right with the default options, outside the bound with another option"),
    "wrong_gradients": ("fail", "the VJP is outside its derived gradient bound"),
    "wrong_when_timed": ("fail", "the outputs of the timed calls (fresh inputs, L2 flushed) are outside the bound"),
    "crash": ("fail", "the candidate raised on an input of the task's domain"),
}


@dataclasses.dataclass(frozen=True)
class Reason:
    name: str  # a key of REASONS
    summary: str  # one line: what was seen
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    replay: str = ""

    def __post_init__(self) -> None:
        if self.name not in REASONS:
            raise ValueError(f"reason: {self.name!r} is not one of {sorted(REASONS)}")


@dataclasses.dataclass
class Verdict:
    task: str
    candidate: str
    backend: str
    seed: int
    reasons: list[Reason] = dataclasses.field(default_factory=list)
    checked: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # each check run: name, unit, result
    worst: dict[str, Any] | None = None  # the worst budget used: error, bound, where
    timing: dict[str, Any] = dataclasses.field(default_factory=dict)
    not_checked: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    environment: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def status(self) -> str:
        """invalid where any reason is, else fail where any reason is, else pass."""
        kinds = {REASONS[r.name][0] for r in self.reasons}
        return "invalid" if "invalid" in kinds else "fail" if kinds else "pass"

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def reason_names(self) -> list[str]:
        return [r.name for r in self.reasons]

    def reward(self) -> float:
        """1.0 for a pass, else 0.0: what a search loop needs of the verdict (the
        reasons say why; a speedup only counts once the kernel passed)."""
        return 1.0 if self.passed else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "task": self.task,
            "candidate": self.candidate,
            "backend": self.backend,
            "seed": self.seed,
            "reasons": [
                {**dataclasses.asdict(r), "meaning": REASONS[r.name][1], "kind": REASONS[r.name][0]}
                for r in self.reasons
            ],
            "worst": self.worst,
            "checked": self.checked,
            "timing": self.timing,
            "not_checked": self.not_checked,
            "seconds": round(self.seconds, 3),
            "environment": self.environment,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, default=str)

    def summary(self) -> str:
        """A few lines for a terminal."""
        lines = [
            f"{self.status.upper()}: {self.candidate} for task {self.task} on {self.backend} ({self.seconds:.1f} s)"
        ]
        for r in self.reasons:
            lines.append(f"  [{r.name}] {r.summary}")
            if r.replay:
                lines.append(f"    replay: {r.replay}")
        if self.worst is not None:
            lines.append(
                f"  worst: error {self.worst['error']:.3g} / bound {self.worst['bound']:.3g} "
                f"(budget used {self.worst['budget_used']:.3g}) at {self.worst['where']}"
            )
        lines.append(f"  timing: {self.timing.get('summary', 'not timed')}")
        for item in self.not_checked:
            lines.append(f"  NOT CHECKED: {item}")
        return "\n".join(lines)
