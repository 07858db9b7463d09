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


AMOUNT_MIN, AMOUNT_MAX = -(2**63), 2**63 - 1  # a counter is a signed 64-bit int (as torch's)


def check_amount(amount: int) -> int:
    """``add`` amounts are ints of 64 bits (bool is refused: it is almost always a bug); anything
    else is a TypeError, as torch's stores raise."""
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"add amount must be an int, got {type(amount).__name__}")
    if not AMOUNT_MIN <= amount <= AMOUNT_MAX:
        raise TypeError(f"add amount must be a 64-bit signed int, from {AMOUNT_MIN} to "
                        f"{AMOUNT_MAX}, got {amount}")
    return amount
