"""``DebugBackend``: the DETAIL wrapper around a group's backend.

It sees every public op of the group (its ``wrap_op``, called before the group validates the
op): a collective first records a flight-recorder entry, then checks its fingerprint across the
group (:mod:`plugdist_debug.exchange`), and only then hands the call, unchanged, on — so
argument validation, composition and the returned Work are the group's own. The fingerprint is
the **public op's** (what the user called: op, tensors, reduction, root, splits), not the ops a
composition issues underneath: those differ by backend and device (a send/recv backend composes
an all_reduce from point-to-point messages, which are not collective), while the public op is
what every rank must agree on. Point-to-point ops are recorded but not checked: they are not
collective. Everything else (hooks, class attributes, capabilities, a backend's own attributes)
is the wrapped backend's, forwarded by :class:`plugdist.backend.BackendWrapper`.

Thread-safety: collectives are serialised by a lock held from the check until the wrapped op
was issued, so sequence numbers follow issue order; point-to-point ops take a separate lock, so
a send from another thread never waits behind a collective that is waiting for its peers. A
collective blocks its caller until every rank of the group reached it (bounded by the group's
timeout), even with ``async_op=True``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from plugdist.backend import (
    BackendBase,
    BackendWrapper,
    ReduceOp,
    Store,
    Work,
    observing,
    run_observed,
)

from .exchange import FingerprintExchange, GroupIdentity
from .fingerprint import Fingerprint, TensorSpec, spec_of
from .flight_recorder import FAILED, Entry, FlightRecorder, recorders

__all__ = ["DebugBackend"]


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else -1


def _row_counts(t: Any, splits: Sequence[int] | None, size: int) -> tuple[int, ...] | None:
    """Elements per peer of an all_to_all_single buffer; None if the splits are invalid (the
    wrapped group's validation then reports it the same way on every rank)."""
    if not isinstance(t, torch.Tensor):
        return None
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if not splits:
        return None if rows % size else tuple([rows // size * per_row] * size)
    counts = [int(s) for s in splits]
    if len(counts) != size or sum(counts) != rows:
        return None
    return tuple(c * per_row for c in counts)


class DebugBackend(BackendWrapper):
    """Checks every collective across ranks before the wrapped backend runs it. See the module
    docstring. Built by the plugin's wrap hook; ``store`` must be private to the group."""

    def __init__(self, wrapped: BackendBase, store: Store) -> None:
        super().__init__(wrapped)
        global_ranks = tuple(self.options.global_ranks) or tuple(range(self.group_size))
        self._ident = GroupIdentity(self.group_name, self.backend_name, self.group_rank,
                                    global_ranks)
        self.recorder = FlightRecorder(group_name=self.group_name, group_rank=self.group_rank,
                                       global_ranks=global_ranks, backend=self.backend_name,
                                       timeout=self.timeout)
        recorders.add(self.recorder)
        self._exchange = FingerprintExchange(store, self._ident, self.timeout,
                                             on_failure=self._check_failed)
        self._checking: Entry | None = None
        self._lock = threading.RLock()
        # p2p has its own lock: a send must not wait behind a collective blocked in its check
        # (the peer may need that send before it can reach the collective)
        self._p2p_lock = threading.Lock()
        self._seq = 0
        self._p2p_seq = 0

    def shutdown(self) -> None:
        recorders.remove(self.recorder)
        self.wrapped.shutdown()

    def __repr__(self) -> str:
        return f"<DebugBackend wrapping {self.wrapped!r}>"

    def wrap_op(self, op: str, args: dict[str, Any], run: Callable[[], Work]) -> Work:
        """Every public op of the group: a collective checked across ranks first, a
        point-to-point op recorded; then the wrapped backend's ``wrap_op`` (``run``)."""
        def inner() -> Work:
            return self.wrapped.wrap_op(op, args, run)

        if op in ("send", "recv"):
            return self._p2p(op, inner, args.get("tensor"),
                             args.get("dst" if op == "send" else "src"))
        specs, check = _FINGERPRINTS[op](args, self.group_size)
        return self._collective(op, args, inner, specs, **check)

    # -- the check -------------------------------------------------------------------------------
    def _collective(self, op: str, args: dict[str, Any], run: Callable[[], Work],
                    tensors: Sequence[TensorSpec] = (), **check: Any) -> Work:
        """The op, checked first; one observed op of the core (profiler event, flight-recorder
        entry), marked started only when the wrapped group gets it."""
        if observing():
            return run_observed(self, op, args, lambda: self._checked(op, run, tensors, **check),
                               started=False)
        return self._checked(op, run, tensors, **check)

    def _checked(self, op: str, run: Callable[[], Work], tensors: Sequence[TensorSpec] = (),
                 *, reduce_op: ReduceOp | None = None, root: int | None = None,
                 sends: tuple[int, ...] | None = None,
                 recvs: tuple[int, ...] | None = None) -> Work:
        with self._lock:
            self._seq += 1  # numbered from 1, as the core's flight recorder numbers them
            seq = self._seq
            red = reduce_op.name if isinstance(reduce_op, ReduceOp) else \
                (None if reduce_op is None else str(reduce_op))
            fp = Fingerprint(seq=seq, op=op, reduce_op=red, root=root, tensors=tuple(tensors),
                             sends=sends, recvs=recvs)
            doc = fp.to_json()  # serialised once: for the recorder and the exchange
            entry = self.recorder.record(op, seq=seq, fingerprint=doc)
            if self.group_size == 1:
                return self._issue(entry, run)
            self._checking = entry
            try:
                self._exchange.check(fp, doc)
            except BaseException as err:
                if entry.state != FAILED:
                    self.recorder.complete(entry, err)
                raise
            finally:
                self._checking = None
            try:
                return self._issue(entry, run)
            finally:
                self._exchange.forget(seq)

    def _check_failed(self, reason: str, error: str) -> str | None:
        """The check is about to raise: record why, so the dump shows it, then dump."""
        if self._checking is not None:
            self.recorder.complete(self._checking, error)
        path = recorders.dump(reason)
        return None if path is None else str(path)

    def _issue(self, entry: Entry, run: Callable[[], Work]) -> Work:
        self.recorder.start(entry)
        try:
            work = run()
        except BaseException as err:
            self.recorder.complete(entry, err)
            raise
        recorder = self.recorder

        def done(fut: torch.futures.Future) -> None:
            try:
                fut.value()
            except BaseException as err:  # noqa: BLE001 - recorded; the caller's wait raises it
                recorder.complete(entry, err)
            else:
                recorder.complete(entry)

        work.get_future().add_done_callback(done)
        return work

    def _p2p(self, op: str, run: Callable[[], Work], tensor: Any, peer: int | None) -> Work:
        if observing():
            args = {"tensor": tensor, "dst" if op == "send" else "src": peer}
            return run_observed(self, op, args, lambda: self._recorded_p2p(op, run, tensor, peer),
                               started=False)
        return self._recorded_p2p(op, run, tensor, peer)

    def _recorded_p2p(self, op: str, run: Callable[[], Work], tensor: Any,
                      peer: int | None) -> Work:
        with self._p2p_lock:
            self._p2p_seq += 1
            fp = {"tensors": [spec_of("tensor", tensor).to_json()]}
            entry = self.recorder.record(op, p2p_seq=self._p2p_seq, peer=peer, fingerprint=fp)
            return self._issue(entry, run)


# -- what each collective's fingerprint holds, from the public op's arguments by name -------------
_Check = tuple[list[TensorSpec], dict[str, Any]]


def _fp_broadcast(a: dict[str, Any], size: int) -> _Check:
    return [spec_of("tensor", a["tensor"])], {"root": a["src"]}


def _fp_all_reduce(a: dict[str, Any], size: int) -> _Check:
    return [spec_of("tensor", a["tensor"])], {"reduce_op": a["op"]}


def _fp_reduce(a: dict[str, Any], size: int) -> _Check:
    return [spec_of("tensor", a["tensor"])], {"reduce_op": a["op"], "root": a["dst"]}


def _fp_all_gather(a: dict[str, Any], size: int) -> _Check:
    specs = [spec_of("tensor", a["tensor"])]
    specs += [spec_of(f"output_tensors[{i}]", t) for i, t in enumerate(a["output_tensors"])]
    return specs, {}


def _fp_all_gather_into_tensor(a: dict[str, Any], size: int) -> _Check:
    return [spec_of("tensor", a["tensor"]), spec_of("output", a["output"])], {}


def _fp_gather(a: dict[str, Any], size: int) -> _Check:
    # gather_list exists on dst only: not part of what every rank must agree on
    return [spec_of("tensor", a["tensor"])], {"root": a["dst"]}


def _fp_scatter(a: dict[str, Any], size: int) -> _Check:
    return [spec_of("tensor", a["tensor"])], {"root": a["src"]}


def _fp_reduce_scatter(a: dict[str, Any], size: int) -> _Check:
    inputs = a["input_list"]
    specs = [spec_of(f"input_list[{i}]", t) for i, t in enumerate(inputs)]
    output = a["output"]
    if all(getattr(t, "shape", None) == getattr(output, "shape", None) for t in inputs):
        # entries of one size: every rank's output has it too (uneven ones are rank r's)
        specs.insert(0, spec_of("output", output))
    return specs, {"reduce_op": a["op"]}


def _fp_reduce_scatter_tensor(a: dict[str, Any], size: int) -> _Check:
    return [spec_of("output", a["output"]), spec_of("input", a["input"])], {"reduce_op": a["op"]}


def _fp_all_to_all(a: dict[str, Any], size: int) -> _Check:
    # shapes differ between ranks by design; dtypes must not, and sizes must pair up
    ins, outs = a["input_tensors"], a["output_tensors"]
    specs = [TensorSpec(f"input_tensors[{i}]", None, s.dtype, s.device)
             for i, s in enumerate(spec_of("", t) for t in ins)]
    specs += [TensorSpec(f"output_tensors[{i}]", None, s.dtype, s.device)
              for i, s in enumerate(spec_of("", t) for t in outs)]
    paired = len(ins) == len(outs) == size
    return specs, {"sends": tuple(_numel(t) for t in ins) if paired else None,
                   "recvs": tuple(_numel(t) for t in outs) if paired else None}


def _fp_all_to_all_single(a: dict[str, Any], size: int) -> _Check:
    output, input = a["output"], a["input"]
    # rows of different shapes are a local error: left to the group to report
    rows_match = (isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor)
                  and output.shape[1:] == input.shape[1:])
    specs = [spec_of("output", output, rows_vary=True), spec_of("input", input, rows_vary=True)]
    return specs, {
        "sends": _row_counts(input, a["input_split_sizes"], size) if rows_match else None,
        "recvs": _row_counts(output, a["output_split_sizes"], size) if rows_match else None}


def _fp_barrier(a: dict[str, Any], size: int) -> _Check:
    return [], {}


_FINGERPRINTS: dict[str, Callable[[dict[str, Any], int], _Check]] = {
    "broadcast": _fp_broadcast, "all_reduce": _fp_all_reduce, "reduce": _fp_reduce,
    "all_gather": _fp_all_gather, "all_gather_into_tensor": _fp_all_gather_into_tensor,
    "gather": _fp_gather, "scatter": _fp_scatter, "reduce_scatter": _fp_reduce_scatter,
    "reduce_scatter_tensor": _fp_reduce_scatter_tensor, "all_to_all": _fp_all_to_all,
    "all_to_all_single": _fp_all_to_all_single, "barrier": _fp_barrier,
}
