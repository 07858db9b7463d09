"""What the live page shows, gathered by one thread: the world's members and history from the
store, this node's workers from the agent, the store's load from the server this agent hosts.

The thread polls every ``interval`` seconds and replaces :attr:`Watch.snapshot` whole (a dict
ready for JSON), so a reader never sees half an update. Times are when the watch saw a record
(the death log's records carry none), so they are right to within the interval. A world
change's pause comes from the ranks: how much longer the first step committed in the new epoch
took than the step before it.

Everything it reads is under the round's world root (``worker_round_root``): the death log,
``plugdist/epoch/current`` and each epoch's members, and what each rank reports for the page
(``page_status_key``, :mod:`plugdist._observability.page_reporter`). A store that does not
answer leaves the last snapshot in place, marked ``store_error``.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from datetime import timedelta
from typing import Any

from plugdist.errors import DistError, DistTimeoutError
from plugdist.store import PrefixStore, Store
from plugdist.store._worldkeys import (
    CURRENT,
    DEATHS,
    PAGE_DUMP,
    members_key,
    page_ops_key,
    page_status_key,
    worker_round_root,
)

__all__ = ["Watch", "exit_text"]

_DEATHS = {"died", "hung", "reported", "left"}   # "excluded" is its own kind
_SILENT_AFTER = 5.0   # a running rank whose status is older than this is shown as silent
_HISTORY = 500        # events kept


def exit_text(returncode: int) -> str:
    """A worker's end in words: "killed by SIGKILL" or "exit code 1"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Watch:
    """The page's view of one run. ``agent``: the agent (its ``workers``, ``host``, ``cfg``);
    ``store``: the rendezvous store (its worlds live under a prefix per round)."""

    def __init__(self, agent: Any, store: Store, interval: float = 0.5) -> None:
        self.agent = agent
        self.store = store
        self.interval = interval
        self.started = time.time()
        self.history: list[dict[str, Any]] = []
        self.snapshot: dict[str, Any] = {}
        self.ended: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round: Any = None
        self._root: Store | None = None
        self._lock = threading.Lock()   # the round's fields: set by the agent, read by polls
        self._requests: tuple[float, int] | None = None
        self._rate = 0.0
        self._load: dict[str, Any] | None = None
        self._workers_seen: set[int] = set()   # pids whose exit is in the history
        self._reset_world(0)

    # -- driven by the agent -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="plugdist-run-page-watch",
                                        daemon=True)
        self._thread.start()

    def new_round(self, a: Any) -> None:
        """A round started: a new world of ``a.world_size`` under the round's root."""
        with self._lock:
            self._round = a
            self._root = PrefixStore(worker_round_root(a.round), self.store)
            self._reset_world(a.world_size)
        self._event("round", f"round {a.round} started: a world of {a.world_size} "
                             f"(restart {a.restart_count})", size=a.world_size)

    def finish(self, exit_code: int, reason: str = "") -> None:
        """The run ended: one last poll, then the snapshot stays as it is."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._poll()
        text = "the run succeeded" if exit_code == 0 else f"the run failed (exit code " \
                                                          f"{exit_code})"
        self._event("end", text + (f": {reason}" if reason else ""))
        self.ended = {"exit_code": exit_code, "time": time.time()}
        self._publish()

    def ask_ops(self) -> int:
        """Ask every rank for its recent ops (they answer within about a second); the request's
        number."""
        root = self._root
        if root is None:
            return 0
        return int(root.add(PAGE_DUMP, 1))

    def ops(self) -> dict[str, Any]:
        """The ranks' answers to the last request for their recent ops."""
        root = self._root
        if root is None:
            return {"request": 0, "ranks": []}
        asked = int(root.add(PAGE_DUMP, 0))
        ranks = []
        for uid in sorted(self._uids, key=_uid_order):
            key = page_ops_key(uid)
            if root.check([key]):
                answer = json.loads(root.get(key))
                ranks.append(dict(answer, uid=uid, state=self._member_state(uid)))
        return {"request": asked, "ranks": ranks}

    # -- polling -------------------------------------------------------------------------------
    def _reset_world(self, size: int) -> None:
        self._uids: list[str] = [str(r) for r in range(size)]
        self._members: list[str] = list(self._uids)
        self._epoch = 0
        self._seen_log = 0
        self._dead: dict[str, str] = {}       # uid -> cause
        self._joining: set[str] = set()
        self._status: dict[str, dict[str, Any]] = {}
        self._store_error = ""

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._poll()

    def _poll(self) -> None:
        with self._lock:
            try:
                if self._root is not None:
                    self._read_log(self._root)
                    self._read_epochs(self._root)
                    self._read_status(self._root)
                self._store_error = ""
            except DistError as err:
                self._store_error = str(err)
            self._read_workers()
            self._read_load()
            self._publish()

    def _read_log(self, root: Store) -> None:
        try:
            entries = root.read_log(DEATHS, self._seen_log + 1, timedelta(0))
        except DistTimeoutError:
            return
        for raw in entries:
            self._seen_log += 1
            try:
                record = json.loads(raw)
                cause, uid = record.get("cause"), str(record.get("uid"))
            except (ValueError, AttributeError):
                continue
            if cause == "joining":
                self._joining.add(uid)
                if uid not in self._uids:
                    self._uids.append(uid)
                self._event("join", f"a process asks to join (member id {uid})", uid=uid)
            elif cause in _DEATHS or cause == "excluded":
                how = record.get("how") or record.get("after")
                text = cause + (f" ({how})" if how else "")
                self._dead[uid] = text
                kind = "exclusion" if cause == "excluded" else "death"
                self._event(kind, f"rank {self._rank_of(uid)} (member {uid}) {text}",
                            uid=uid, cause=cause, rank=self._rank_of(uid))

    def _read_epochs(self, root: Store) -> None:
        if not root.check([CURRENT]):
            return
        current = int(root.get(CURRENT) or 0)
        while self._epoch < current:
            nxt = self._epoch + 1
            before = self._members
            key = members_key(nxt)
            after = json.loads(root.get(key)) if root.check([key]) else before
            self._epoch, self._members = nxt, [str(u) for u in after]
            for uid in self._members:
                self._joining.discard(uid)
                if uid not in self._uids:
                    self._uids.append(uid)
            gone = [u for u in before if u not in self._members]
            came = [u for u in self._members if u not in before]
            kind = "grow" if came and not gone else "shrink" if gone and not came else "reshape"
            what = ", ".join(p for p in (
                f"without {', '.join(gone)}" if gone else "",
                f"with {', '.join(came)}" if came else "") if p)
            self._event(kind, f"epoch {nxt}: the world {kind}s from {len(before)} to "
                              f"{len(self._members)} ({what})",
                        epoch=nxt, size=len(self._members), before=len(before), pause_s=None,
                        left=gone, joined=came)

    def _read_status(self, root: Store) -> None:
        # a rank's status key stays once written: those seen are read in one request, the
        # others looked for one by one (only until each rank's first report)
        seen = [u for u in self._members if u in self._status]
        if seen:
            values = root.multi_get([page_status_key(u) for u in seen])
            self._status.update((u, json.loads(v)) for u, v in zip(seen, values, strict=True))
        for uid in self._members:
            key = page_status_key(uid)
            if uid not in self._status and root.check([key]):
                self._status[uid] = json.loads(root.get(key))
        self._read_pauses()

    def _read_pauses(self) -> None:
        """A world change's pause, once the ranks committed a step in the new epoch: how much
        longer that first step took than the one before it (ResilientTraining's steps only)."""
        for event in reversed(self.history):
            if event["kind"] == "round":
                break   # an earlier round's epochs are another world's
            if "epoch" not in event or event["pause_s"] is not None:
                continue
            starts = [s["epoch_starts"][str(event["epoch"])] for s in self._status.values()
                      if str(event["epoch"]) in s.get("epoch_starts", {})]
            if starts:
                pause = max(max(first - prior, 0.0) for first, prior in starts)
                event["pause_s"] = round(pause, 3)
                event["text"] += f"; training paused {pause:.2f}s"

    def _read_workers(self) -> None:
        for w in list(self.agent.workers):
            if w.returncode is None or w.proc.pid in self._workers_seen:
                continue
            self._workers_seen.add(w.proc.pid)
            if w.returncode != 0:
                self._event("exit", f"rank {w.rank} (pid {w.proc.pid}) on {self.agent.host} "
                                    f"{exit_text(w.returncode)}", rank=w.rank,
                            pid=w.proc.pid, returncode=w.returncode)

    def _read_load(self) -> None:
        stats_of = getattr(self.store, "server_stats", None)
        stats = stats_of() if stats_of is not None else None
        if stats is None:
            self._load = None
            return
        now = time.monotonic()
        if self._requests is not None and now > self._requests[0]:
            self._rate = (stats["requests"] - self._requests[1]) / (now - self._requests[0])
        self._requests = (now, stats["requests"])
        self._load = dict(stats, requests_per_s=round(self._rate, 1))

    # -- the snapshot --------------------------------------------------------------------------
    def _rank_of(self, uid: str) -> int | None:
        if uid in self._members:
            return self._members.index(uid)
        status = self._status.get(uid)
        if status is not None:
            return int(status["rank"])
        return int(uid) if uid.isdigit() else None

    def _member_state(self, uid: str) -> str:
        if uid in self._dead:
            return "excluded" if self._dead[uid].startswith("excluded") else "dead"
        if uid in self._members:
            status = self._status.get(uid)
            if status is not None and time.time() - float(status["time"]) > _SILENT_AFTER:
                return "silent"
            return "running"
        if uid in self._joining:
            return "joining"
        return "gone"

    def _member_rows(self) -> list[dict[str, Any]]:
        local = {w.rank: w for w in list(self.agent.workers) if not w.replacement}
        rows = []
        for uid in sorted(self._uids, key=_uid_order):
            status = self._status.get(uid, {})
            rank = self._rank_of(uid)
            worker = local.get(rank) if uid.isdigit() else None
            rows.append({
                "uid": uid, "rank": rank if uid in self._members else None,
                "host": status.get("host") or (self.agent.host if worker else None),
                "pid": status.get("pid") or (worker.proc.pid if worker else None),
                "state": self._member_state(uid), "cause": self._dead.get(uid),
                "step": status.get("step"), "step_time": status.get("step_time"),
                "updated": status.get("time")})
        return rows

    def _publish(self) -> None:
        a = self._round
        self.snapshot = {
            "run_id": self.agent.cfg.run_id, "host": self.agent.host,
            "started": self.started, "now": time.time(),
            "state": "ended" if self.ended else "running" if a is not None else "starting",
            "exit_code": self.ended["exit_code"] if self.ended else None,
            "round": a.round if a is not None else None,
            "restarts": a.restart_count if a is not None else 0,
            "world": {"epoch": self._epoch, "size": len(self._members),
                      "members": list(self._members)},
            "members": self._member_rows(), "history": list(self.history),
            "store": self._load, "store_error": self._store_error}

    def _event(self, kind: str, text: str, **fields: Any) -> None:
        self.history.append(dict(fields, time=time.time(), kind=kind, text=text))
        del self.history[:-_HISTORY]


def _uid_order(uid: str) -> tuple[int, int]:
    """Ranks of the first epoch first (0, 1, ...), then joiners by ticket (j1, j2, ...)."""
    return (0, int(uid)) if uid.isdigit() else (1, int(uid[1:]) if uid[1:].isdigit() else 0)
