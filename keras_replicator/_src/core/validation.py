"""Argument checks shared by the package, with one wording for each."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


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
        allowed = (
            "a positive integer or None"
            if allow_none
            else ("a positive integer")
        )
        raise ValueError(
            f"`{name}` must be {allowed}. Received: {name}={value!r}"
        )
