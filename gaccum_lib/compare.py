"""A tiny comparison helper for notebooks: exact? close? by how much?"""

from __future__ import annotations

import numpy as np
import torch


def _as_array(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


def max_diff(a, b) -> float:
    """Largest absolute elementwise difference between two arrays or tensors of the same shape."""
    a, b = _as_array(a), _as_array(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def cmp(label: str, got, expected, *, tol: float = 1e-6, quiet: bool = False) -> bool:
    """Print whether ``got`` equals ``expected`` exactly, within ``tol``, and the largest difference.

    Returns True when they agree within ``tol`` so a cell can ``assert cmp(...)``.
    """
    diff = max_diff(got, expected)
    exact = diff == 0.0
    close = diff <= tol
    if not quiet:
        print(f"{label:<44} exact: {str(exact):<5} | within {tol:g}: {str(close):<5} | max diff: {diff:.2e}")
    return close


def fmt_weights(weights, decimals: int = 4) -> str:
    """Weights as the seed document prints them: ``[0.0953, 0.4337]``."""
    values = _as_array(weights).ravel()
    return "[" + ", ".join(f"{v:.{decimals}f}" for v in values) + "]"
