"""Checks of arguments at the public API, each a ConfigError naming the argument. Arrays: numpy
accepts what a search cannot use (text as a bare ValueError, complex numbers with their imaginary
part dropped, booleans as 0/1, several rows flattened into one long vector)."""

from __future__ import annotations

from typing import Any

import numpy as np

from drift_lance.errors import ConfigError


def real_array(value: Any, argument: str) -> np.ndarray:
    """`value` as an array of real numbers (float or integer dtype)."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged nested sequences
        raise ConfigError(f"{argument}: not an array of numbers ({exc})") from None
    if array.dtype.kind not in "fiu":
        raise ConfigError(f"{argument}: must hold real numbers, got dtype {array.dtype}")
    return array


def one_vector(value: Any, argument: str, *, several: str = "") -> np.ndarray:
    """`value` as one flat vector of real numbers; a one-row matrix (an embedder's output) is one.
    `several`: where several vectors go instead, for the error."""
    array = real_array(value, argument)
    if array.ndim != 1 and array.shape[:-1] != (1,):
        instead = f" ({several} takes several)" if several else ""
        raise ConfigError(f"{argument}: must be one vector, got an array of shape {array.shape}{instead}")
    return array.reshape(-1)


def check_open_store(store: object) -> None:
    """A store that is not open (None, a config, anything without a manifest) would fail at the
    first search as an AttributeError, or fail every DRIFT follow-up."""
    if getattr(store, "manifest", None) is None:
        raise ConfigError(f"store: expected an open store (`await open_store(uri)`), got {type(store).__name__}")
