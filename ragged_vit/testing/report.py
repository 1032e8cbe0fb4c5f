"""What a conformance check reports, and which level of cases it runs."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

LEVELS = ("quick", "full")
ENV = "RAGGED_VIT_CONFORMANCE"


def level(requested: str | None = None) -> str:
    """The case level: ``requested``, else ``$RAGGED_VIT_CONFORMANCE``, else ``quick``."""
    chosen = requested or os.environ.get(ENV) or "quick"
    if chosen not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS} (argument or ${ENV}), got {chosen!r}")
    return chosen


@dataclass(frozen=True)
class Failure:
    """One failed case: which case, which rule, what was observed against what was allowed."""

    case: str
    rule: str
    observed: str
    allowed: str

    def __str__(self) -> str:
        return f"{self.case}: {self.rule}: observed {self.observed}, allowed {self.allowed}"


class ConformanceError(AssertionError):
    """An implementation broke its contract: every failed case, one per line."""

    def __init__(self, contract: str, failures: list[Failure]) -> None:
        self.contract = contract
        self.failures = list(failures)
        lines = "\n".join(f"  - {f}" for f in self.failures)
        super().__init__(f"{contract}: {len(self.failures)} case(s) failed\n{lines}")


def raise_failures(contract: str, failures: list[Failure]) -> None:
    if failures:
        raise ConformanceError(contract, failures)


def bad_call_failures(calls: Iterable[tuple[str, str | None, Callable[[], object]]]) -> list[Failure]:
    """The failures of ``(what is wrong, the argument the error must name or None, the call)``: each call must raise
    ``TypeError`` or ``ValueError`` (checked before any launch, by contract), naming the argument where one is given."""
    failures = []
    for what, argument, call in calls:
        try:
            call()
        except (TypeError, ValueError) as exc:
            if argument is None or argument in str(exc):
                continue
            observed = f"{type(exc).__name__} not naming it: {exc}"
        except Exception as exc:  # noqa: BLE001 - any other exception is the finding
            observed = f"{type(exc).__name__}: {exc}"
        else:
            observed = "no error"
        rule = "a bad argument raises" + ("" if argument is None else f" an error naming {argument!r}")
        failures.append(Failure(f"bad_inputs[{what}]", rule, observed, "TypeError or ValueError"))
    return failures
