"""A ``torch.distributed.Store`` behind plugdist's Store API: torchrun's agent store for the
env:// rendezvous, and the store torch hands a ``plugdist_*`` group it builds.

Imports nothing of torch: it only calls the wrapped object. Thread safety and blocking are the
wrapped store's; ``get`` and ``wait`` are bounded by this store's timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from plugdist.errors import DistError, DistStoreError, DistTimeoutError
from plugdist.store.api import Store, to_bytes

__all__ = ["TorchStoreAdapter"]


class TorchStoreAdapter(Store):
    """``store`` (a ``torch.distributed.Store``) as a plugdist :class:`Store`. torch's timeout
    errors become ``DistTimeoutError``, its other store errors ``DistStoreError``. ``timeout``
    defaults to the torch store's; ``close`` drops the reference, the torch store stays open."""

    def __init__(self, store: Any, timeout: timedelta | None = None) -> None:
        super().__init__(timeout if timeout is not None else store.timeout)
        self.torch_store = store

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.torch_store.set_timeout(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        with _torch_errors(key):
            self.torch_store.set(key, to_bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        with _torch_errors(key):
            return bytes(self.torch_store.get(key))

    def add(self, key: str, amount: int) -> int:
        with _torch_errors(key):
            return int(self.torch_store.add(key, int(amount)))

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        with _torch_errors(key):
            return bytes(self.torch_store.compare_set(key, to_bytes(expected_value),
                                                      to_bytes(desired_value)))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        with _torch_errors(", ".join(keys)):
            self.torch_store.wait(list(keys), timeout if timeout is not None else self.timeout)

    def check(self, keys: Sequence[str]) -> bool:
        with _torch_errors(", ".join(keys)):
            return bool(self.torch_store.check(list(keys)))

    def num_keys(self) -> int:
        with _torch_errors("*"):
            return int(self.torch_store.num_keys())

    def delete_key(self, key: str) -> bool:
        with _torch_errors(key):
            return bool(self.torch_store.delete_key(key))

    def clone(self) -> TorchStoreAdapter:
        """A new handle on the same data through torch's ``clone`` (its own connection: a
        TCPStore serves one request of a handle at a time, so a long wait on it would hold
        up every other request)."""
        clone = getattr(self.torch_store, "clone", None)
        if clone is None:
            raise self._not_implemented("clone")
        with _torch_errors("*"):
            return TorchStoreAdapter(clone(), self.timeout)

    def close(self) -> None:
        self.torch_store = None


@contextlib.contextmanager
def _torch_errors(keys: str) -> Iterator[None]:
    try:
        yield
    except DistError:
        raise
    except RuntimeError as err:  # torch's DistStoreError and its timeouts are RuntimeErrors
        text = str(err)
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        cls = DistTimeoutError if timed_out else DistStoreError
        raise cls(f"torch store, keys {keys}: {text}") from err
