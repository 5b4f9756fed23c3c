"""The corpus: (shape, fault, fault rank, ranks, recorder) -> the verdict it must get."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    id: str
    shape: str
    fault: str
    fault_rank: int | None
    ranks: int
    recorder: str  # "fr" (PyTorch's Flight Recorder, in-process dumps) or "frtools"
    kind: str  # the expected verdict kind
    guilty: tuple[int, ...]  # the exact guilty rank set
    why: str = ""  # what happens, and why this verdict is the right one
    group: tuple[int, ...] | None = None  # the process group's members, where it matters
    steps: int = 5
    fault_step: int = 3

    @property
    def exit_code(self) -> int:
        return 0 if self.kind == "healthy" else 1


CASES: tuple[Case, ...] = ()
BY_ID = {c.id: c for c in CASES}
