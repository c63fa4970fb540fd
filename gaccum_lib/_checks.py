"""Argument checks shared by the whole library.

Every public function validates its inputs with these helpers so that a bad value
fails loudly, names the argument and says what would have been accepted, instead
of quietly producing a wrong number.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int within ``[minimum, maximum]``; raise otherwise."""
    # bool is an int subclass: True would silently mean 1 accumulation step.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be in {_range_text(minimum, maximum)}, got {value}")
    return value


def check_float(
    name: str,
    value,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
) -> float:
    """Return ``value`` as a float if it is a finite real number within the range; raise otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {value}")
    too_small = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    too_large = maximum is not None and value > maximum
    if too_small or too_large:
        low = "(" if exclusive_minimum else "["
        raise ValueError(f"{name} must be in {_range_text(minimum, maximum, low)}, got {value}")
    return value


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``; raise a message listing them otherwise."""
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {', '.join(choices)}; got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _range_text(minimum, maximum, low: str = "[") -> str:
    lo = "-inf" if minimum is None else f"{minimum}"
    hi = "inf" if maximum is None else f"{maximum}"
    high = ")" if maximum is None else "]"
    if minimum is None:
        low = "("
    return f"{low}{lo}, {hi}{high}"
