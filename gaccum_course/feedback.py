"""What an exercise check answers: right or not, and a message that helps without giving the answer away."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feedback:
    correct: bool
    message: str

    def __bool__(self) -> bool:
        return self.correct
