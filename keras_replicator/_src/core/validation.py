"""Argument checks shared by the package, with one wording for each."""

from __future__ import annotations

import math


def is_int(value: object) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """True for a Python int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_int(
    name: str, value: object, *, allow_none: bool = False
) -> None:
    """Raises unless `value` is an int >= 1 (or None, if allowed).

    Args:
        name: The argument's name, for the message.
        value: The value to check.
        allow_none: Whether None is accepted.

    Raises:
        ValueError: Naming the argument and the value received.
    """
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        allowed = "a positive integer" + (" or None" if allow_none else "")
        raise ValueError(
            f"`{name}` must be {allowed}. Received: {name}={value!r}"
        )


def check_non_negative_int(name: str, value: object) -> None:
    """Raises unless `value` is an int >= 0.

    Args:
        name: The argument's name, for the message.
        value: The value to check.

    Raises:
        ValueError: Naming the argument and the value received.
    """
    if not is_int(value) or value < 0:
        raise ValueError(
            f"`{name}` must be a non-negative integer. "
            f"Received: {name}={value!r}"
        )


def check_positive_number(
    name: str, value: object, *, allow_none: bool = False, finite: bool = False
) -> None:
    """Raises unless `value` is a number > 0 (finite, or None, if asked).

    Args:
        name: The argument's name, for the message.
        value: The value to check.
        allow_none: Whether None is accepted.
        finite: Whether infinity is refused (NaN always is).

    Raises:
        ValueError: Naming the argument and the value received.
    """
    if value is None and allow_none:
        return
    # NaN fails `value > 0`.
    ok = is_number(value) and value > 0 and not (finite and value == math.inf)
    if not ok:
        allowed = "a positive, finite number" if finite else "a positive number"
        if allow_none:
            allowed += " or None"
        raise ValueError(
            f"`{name}` must be {allowed}. Received: {name}={value!r}"
        )
