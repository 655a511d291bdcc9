"""Small validators for configuration values, shared by every package.

Each raises `ValueError` naming the field and the bad value, and returns the value, so a
``__post_init__`` reads as a list of checks. ``bool`` is never accepted as a number (it is
an ``int`` subclass, and ``True`` as a step count is always a mistake); integers of
other kinds (``numpy.int64``, any ``numbers.Integral``) are, as data coordinates often
come from arrays.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "check_fraction",
    "check_index",
    "check_int",
    "check_number",
    "check_positive_int",
]


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(
    name: str, value: object, *, minimum: int | None = None, optional: bool = False
) -> int:
    """``value`` as an int of at least ``minimum`` (None allowed when ``optional``).

    Raises:
        ValueError: naming ``name`` and ``value``.
    """
    if optional and value is None:
        return value  # type: ignore[return-value]
    if not _is_int(value) or (minimum is not None and value < minimum):  # type: ignore[operator]
        bound = f" >= {minimum}" if minimum is not None else ""
        what = f"an integer{bound}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value  # type: ignore[return-value]


def check_positive_int(name: str, value: object, *, optional: bool = False) -> int:
    """``value`` as an int >= 1 (None allowed when ``optional``).

    Raises:
        ValueError: naming ``name`` and ``value``.
    """
    if optional and value is None:
        return value  # type: ignore[return-value]
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        what = "a positive integer" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value  # type: ignore[return-value]


def check_index(name: str, value: object, bound: int | None = None) -> int:
    """``value`` as an int in ``[0, bound)`` (``[0, inf)`` without a bound).

    Raises:
        ValueError: naming ``name``, ``value`` and the bound.
    """
    if not _is_int(value) or value < 0 or (bound is not None and value >= bound):  # type: ignore[operator]
        where = f" in [0, {bound})" if bound is not None else " >= 0"
        raise ValueError(f"{name} must be an integer{where}, got {value!r}")
    return value  # type: ignore[return-value]


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    positive: bool = False,
    allow_inf: bool = False,
    optional: bool = False,
) -> float:
    """``value`` as a real number (not NaN; finite unless ``allow_inf``), ``> 0`` if
    ``positive``, ``>= minimum`` if given.

    Raises:
        ValueError: naming ``name`` and ``value``.
    """
    if optional and value is None:
        return value  # type: ignore[return-value]
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (allow_inf or math.isfinite(number)) and not (positive and number <= 0)
        ok = ok and not (minimum is not None and number < minimum)
    if not ok:
        parts = ["a positive number" if positive else "a number"]
        if minimum is not None:
            parts.append(f">= {minimum}")
        if optional:
            parts.append("or None")
        raise ValueError(f"{name} must be {' '.join(parts)}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_fraction(
    name: str, value: object, *, open_low: bool = False, open_high: bool = False
) -> float:
    """``value`` as a number in ``[0, 1]`` (ends excluded where ``open_*``).

    Raises:
        ValueError: naming ``name`` and ``value``.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > 0 if open_low else v >= 0) and (v < 1 if open_high else v <= 1)
    if not ok:
        lo, hi = "(" if open_low else "[", ")" if open_high else "]"
        raise ValueError(f"{name} must be in {lo}0, 1{hi}, got {value!r}")
    return float(value)  # type: ignore[arg-type]
