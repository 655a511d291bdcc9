"""Small validators for configuration values, shared by every package.

Each raises `ValueError` naming the field and the bad value, and returns the value, so a
``__post_init__`` reads as a list of checks. ``bool`` is never accepted as a number (it is
an ``int`` subclass, and ``True`` as a step count is always a mistake); integers of
other kinds (``numpy.int64``, any ``numbers.Integral``) are, as data coordinates often
come from arrays. Nor is anything but ``True`` or ``False`` a flag (`check_bool`): a string
``"no"`` or ``"false"`` from a file or a flag is truthy. A choice is one of a fixed set of
strings (`check_choice`, the runtime side of a ``Literal`` annotation), and a setting by a
name it no longer has is refused with its new name (`check_renamed`), so that a user's
code, TOML table or flag never silently loses a value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

__all__ = [
    "check_bool",
    "check_choice",
    "check_fraction",
    "check_index",
    "check_int",
    "check_number",
    "check_positive_int",
    "check_renamed",
    "check_replica_share",
]

_T = TypeVar("_T")


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


def check_bool(name: str, value: object) -> bool:
    """``value`` as a flag: ``True`` or ``False`` only (not ``"no"``, ``"false"``, 0 or 1).

    Raises:
        ValueError: naming ``name`` and ``value``.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[_T], *, optional: bool = False) -> _T:
    """``value`` as one of ``choices`` (None allowed when ``optional``): the runtime check
    of a field annotated with a ``Literal`` (``typing.get_args`` gives its choices) or an
    enum (its members, which compare equal to their values when they are strings).

    Raises:
        ValueError: naming ``name``, ``value`` and every allowed value.
    """
    allowed = tuple(choices)
    if optional and value is None:
        return value  # type: ignore[return-value]
    if isinstance(value, str | int | float | bool | None) and value in allowed:
        return value
    spelled = ", ".join(repr(getattr(c, "value", c)) for c in allowed)
    extra = " or None" if optional else ""
    raise ValueError(f"{name} must be one of {spelled}{extra}; got {value!r}")


def check_renamed(
    keys: Iterable[str],
    where: str,
    renamed: Mapping[str, str],
    *,
    spell: Callable[[str], str] | None = None,
) -> None:
    """Refuse settings by their old names: a keyword argument, or a key of a user's TOML or
    JSON file. ``renamed`` maps each old name to its new one; ``spell(new)``, if given,
    says how to write the new one where ``where`` is read.

    Raises:
        ValueError: naming each old key, its new name, and ``where`` it was found.
    """
    old = [key for key in keys if key in renamed]
    if old:
        renames = ", ".join(
            f"{key!r} is now {renamed[key]!r}" + (f" ({spell(renamed[key])})" if spell else "")
            for key in old
        )
        raise ValueError(f"renamed key(s) in {where}: {renames}")


def check_replica_share(global_batch_size: int, num_replicas: int) -> int:
    """The samples each of ``num_replicas`` replicas reads of a step's global batch.

    Raises:
        ValueError: if ``num_replicas`` does not divide ``global_batch_size``, naming both.
    """
    check_positive_int("num_replicas", num_replicas)
    per, rest = divmod(global_batch_size, num_replicas)
    if rest or not per:
        raise ValueError(
            f"a global batch of {global_batch_size} samples does not divide among "
            f"{num_replicas} replicas: use a replica count that divides "
            f"{global_batch_size}, or another global_batch_size"
        )
    return per
