"""Argument checks shared by the store implementations (so every store rejects the same inputs)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_key", "check_keys", "check_amount"]


def check_key(key: str) -> str:
    """Keys are ``str``; anything else is a TypeError."""
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, got {type(key).__name__}")
    return key


def check_keys(keys: Sequence[str]) -> list[str]:
    """A list of keys; a bare string (a common slip for ``[key]``) is refused."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be a list of str, not a single string; "
                        f"did you mean [{keys!r}]?")
    return [check_key(k) for k in keys]


def check_amount(amount: int) -> int:
    """``add`` amounts are ints (bool is refused: it is almost always a bug)."""
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"add amount must be an int, got {type(amount).__name__}")
    return amount
