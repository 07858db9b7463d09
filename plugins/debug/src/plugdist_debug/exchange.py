"""The cross-rank fingerprint check, carried by the group's private store (never the backend).

For collective number ``seq`` each rank writes its fingerprint under ``fp/<seq>/<group rank>``,
waits for every rank's key, and compares. Going through the store rather than the wrapped
backend means the check works the same for every backend, and a backend that is wedged or
mismatched cannot hide the report.

* Every rank compares the same fingerprints, so on a mismatch every rank raises
  :class:`CollectiveMismatchError` with the same verdict, before the real collective runs.
* A rank that does not arrive within the group's timeout is named in a ``DistTimeoutError`` on
  the ranks that did. They then overwrite their key with a "gave up" marker, so a rank that
  arrives late raises at once instead of running a collective nobody else will join.
* Keys are deleted one collective later (:meth:`FingerprintExchange.forget`): once every rank
  has written ``seq``, all of them have read ``seq - 1``.
* Before raising a report, a rank acknowledges under ``fp/<seq>/ack/<group rank>`` that it has
  read the fingerprints, and waits (bounded by the group's timeout) for the acknowledgements of
  the ranks its report is shared with: all of them on a mismatch, the ones that arrived on a
  timeout. A rank whose process serves the store may exit right after raising; without the
  wait, a peer still reading would see "connection lost" instead of the report. The missing
  ranks of a timeout are not waited for (a dead one would double the time to the report); a
  late rank reads the "gave up" markers if the store still runs. Only failures pay for this.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

from plugdist import DistError, DistTimeoutError, Store
from plugdist.errors import where

from .fingerprint import Fingerprint, describe, differences, rank_list

__all__ = ["FingerprintExchange", "CollectiveMismatchError", "GroupIdentity"]

_GAVE_UP = "gave_up"


class CollectiveMismatchError(DistError, ValueError):
    """The ranks of a group called different collectives (or the same with different
    arguments). Raised on every rank, before anything was sent. ``differences`` lists the
    fields that differ, one line each."""

    def __init__(self, message: str, differences: Sequence[str]) -> None:
        super().__init__(message)
        self.differences = list(differences)


@dataclass(frozen=True)
class GroupIdentity:
    """What messages say about the group: its name, backend, size and global ranks."""

    name: str
    backend: str
    rank: int
    global_ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.global_ranks)

    def is_world_like(self) -> bool:
        return self.global_ranks == tuple(range(self.size))

    def label(self, group_rank: int) -> str:
        if self.is_world_like():
            return f"rank {group_rank}"
        return f"rank {group_rank} (global {self.global_ranks[group_rank]})"

    def where(self, op: str) -> str:
        return where(rank=self.rank, group=self.name, backend=self.backend, op=op)


class FingerprintExchange:
    """Compares each collective's fingerprint across the group. Blocking; not thread-safe (the
    wrapper calls it under its lock, in issue order)."""

    def __init__(self, store: Store, ident: GroupIdentity, timeout: timedelta,
                 on_failure: Callable[[str, str], str | None]) -> None:
        """``on_failure(reason, error)`` runs before an error is raised (the wrapper records the
        error and dumps the flight recorder there) and may return the dump's path."""
        self._store = store
        self._ident = ident
        self._timeout = timeout
        self._on_failure = on_failure

    def _key(self, seq: int, rank: int) -> str:
        return f"fp/{seq}/{rank}"

    def _acknowledge(self, seq: int, peers: Sequence[int]) -> None:
        """Say this rank has read collective ``seq``'s fingerprints, then wait until ``peers``
        said so too (bounded by the group's timeout). Errors end the wait quietly: the store or
        a peer is gone, and this rank already holds what it will raise."""
        me = self._ident.rank
        try:
            self._store.set(f"fp/{seq}/ack/{me}", b"")
            others = [f"fp/{seq}/ack/{r}" for r in peers if r != me]
            if others:
                self._store.wait(others, self._timeout)
        except DistError:
            pass

    def check(self, fp: Fingerprint, doc: dict[str, Any] | None = None) -> None:
        """Block until every rank posted its fingerprint for ``fp.seq`` (bounded by the group's
        timeout), then compare. ``doc``: ``fp.to_json()`` when the caller already has it.
        Raises CollectiveMismatchError or DistTimeoutError."""
        ident, seq, me = self._ident, fp.seq, self._ident.rank
        keys = [self._key(seq, r) for r in range(ident.size)]
        self._store.set(keys[me], fp.encode(doc))
        try:
            if self._store.timeout != self._timeout:
                self._store.wait(keys, self._timeout)
            # blocks with the store's timeout, now known to be the group's: one round trip
            raw = self._store.multi_get(keys)
        except DistTimeoutError as err:
            missing = [r for r in range(ident.size) if not self._store.check([keys[r]])]
            if missing:
                self._raise_missing(fp, keys, missing, err)
            raw = self._store.multi_get(keys)  # the last ones arrived as the wait gave up
        docs = [json.loads(v) for v in raw]
        gave_up = [r for r, d in enumerate(docs) if _GAVE_UP in d]
        if gave_up:
            self._raise_late(fp, gave_up)
        fps = [Fingerprint.from_json(d) for d in docs]
        diffs = differences(fps)
        if diffs:
            self._raise_mismatch(fp, fps, diffs)

    def forget(self, seq: int) -> None:
        """Delete this rank's key of collective ``seq - 1``: every rank has read it once all of
        them posted ``seq``. Call after a successful :meth:`check` of ``seq``; the wrapper does
        so once the real collective was issued, keeping the round trip off the critical path."""
        if seq > 1:
            self._store.delete_key(self._key(seq - 1, self._ident.rank))

    # -- failures --------------------------------------------------------------------------------
    def _note(self, reason: str, error: str) -> str:
        path = self._on_failure(reason, error)
        return f"\nFlight recorder of this rank dumped to {path}" if path else ""

    def _raise_missing(self, fp: Fingerprint, keys: list[str], missing: list[int],
                       err: DistTimeoutError) -> NoReturn:
        ident = self._ident
        globals_ = [ident.global_ranks[r] for r in missing]
        # torch's words for its DETAIL check (a monitored barrier before each collective) first
        ms = round(self._timeout.total_seconds() * 1000)
        msg = (f"{ident.where(fp.op)} {rank_list(missing).capitalize()} failed to pass "
               f"monitoredBarrier in {ms} ms: {fp.op} #{fp.seq}: group "
               f"{rank_list(missing)} (global {globals_}) never reached it: stuck, dead, or on "
               f"another path through the program (TORCH_DISTRIBUTED_DEBUG=DETAIL check, nothing "
               f"was sent)")
        # tell a late rank not to run a collective nobody will join
        self._store.set(keys[ident.rank], json.dumps({_GAVE_UP: msg, "seq": fp.seq}).encode())
        self._acknowledge(fp.seq, [r for r in range(ident.size) if r not in missing])
        reason = f"timeout at {fp.op} #{fp.seq}, missing {rank_list(missing)}"
        raise DistTimeoutError(msg + self._note(reason, f"DistTimeoutError: {msg}")) from err

    def _raise_late(self, fp: Fingerprint, gave_up: list[int]) -> NoReturn:
        ident = self._ident
        msg = (f"{ident.where(fp.op)} {fp.op} #{fp.seq}: group "
               f"{rank_list(gave_up)} gave up waiting for this rank after "
               f"{self._timeout.total_seconds():.1f}s and will not join it; this rank arrived "
               f"too late; the group is out of step, restart the job")
        self._acknowledge(fp.seq, [])  # a rank that took this one for present waits for it
        reason = f"arrived late at {fp.op} #{fp.seq}"
        raise DistTimeoutError(msg + self._note(reason, f"DistTimeoutError: {msg}"))

    def _raise_mismatch(self, fp: Fingerprint, fps: list[Fingerprint],
                        diffs: list[str]) -> NoReturn:
        ident = self._ident
        ranks_note = "" if ident.is_world_like() else " (group ranks)"
        lines = [f"{ident.where(fp.op)} collective #{fp.seq} does not match across the "
                 f"{ident.size} ranks of group {ident.name!r}; nothing was sent "
                 f"(TORCH_DISTRIBUTED_DEBUG=DETAIL check). Differences{ranks_note}:"]
        lines += [f"  {d}" for d in diffs]
        lines.append("Fingerprints:")
        lines += [f"  {d}" for d in describe(fps, [ident.label(r) for r in range(ident.size)])]
        msg = "\n".join(lines)
        self._acknowledge(fp.seq, range(ident.size))
        reason = f"mismatch at collective #{fp.seq}: " + "; ".join(diffs)
        raise CollectiveMismatchError(
            msg + self._note(reason, f"CollectiveMismatchError: {msg}"), diffs)
