"""A tiny comparison helper for notebooks: exact? close? by how much?"""

from __future__ import annotations

import numpy as np
import torch

from ._checks import check_float


def _as_array(value, name: str = "value") -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().double().numpy()
    if isinstance(value, str | bytes):  # numpy would read "1.0" as a number
        raise TypeError(_not_numbers(name, value))
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:  # None, a ragged list ...
        raise TypeError(_not_numbers(name, value)) from exc


def _not_numbers(name: str, value) -> str:
    return f"{name} must be a number, a tensor or an array of numbers, got {type(value).__name__} ({value!r})"


def _difference(a, b, names: tuple[str, str]) -> float:
    first, second = names
    a, b = _as_array(a, first), _as_array(b, second)
    # No broadcasting: comparing weights of different shapes is a mistake, not a comparison.
    if a.shape != b.shape:
        raise ValueError(f"{first} and {second} must have the same shape, got {a.shape} and {b.shape}")
    # Two empty arrays would "agree" exactly, whatever was meant to be in them.
    if a.size == 0:
        raise ValueError(f"{first} and {second} are empty (shape {a.shape}); they need at least 1 value to compare")
    return float(np.max(np.abs(a - b)))


def max_diff(a, b) -> float:
    """Largest absolute elementwise difference between two non-empty arrays or tensors of the same shape."""
    return _difference(a, b, ("a", "b"))


def cmp(label: str, got, expected, *, tol: float = 1e-6, quiet: bool = False) -> bool:
    """Print whether ``got`` equals ``expected`` exactly, within ``tol``, and the largest difference.

    Returns True when they agree within ``tol`` (a finite number >= 0) so a cell can ``assert cmp(...)``.
    """
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}")
    tol = check_float("tol", tol, minimum=0.0)
    diff = _difference(got, expected, ("got", "expected"))
    exact = diff == 0.0
    close = diff <= tol
    if not quiet:
        print(f"{label:<44} exact: {str(exact):<5} | within {tol:g}: {str(close):<5} | max diff: {diff:.2e}")
    return close


def fmt_weights(weights, decimals: int = 4) -> str:
    """Weights as the seed document prints them: ``[0.0953, 0.4337]``."""
    values = _as_array(weights, "weights").ravel()
    return "[" + ", ".join(f"{v:.{decimals}f}" for v in values) + "]"
