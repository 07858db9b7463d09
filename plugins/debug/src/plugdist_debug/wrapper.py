"""``DebugProcessGroup``: the DETAIL wrapper, used exactly like the group it wraps.

Every public collective first records a flight-recorder entry, then checks its fingerprint
across the group (:mod:`plugdist_debug.exchange`), and only then hands the call, unchanged, to
the wrapped group's public op — so argument validation, composition and the returned Work are
the wrapped group's own. Point-to-point ops are recorded but not checked: they are not
collective. Anything else (``rank()``, ``capabilities()``, a backend's own attributes) is the
wrapped group's.

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
    OPS,
    Capabilities,
    GroupOptions,
    ProcessGroup,
    ReduceOp,
    Store,
    Work,
    observing,
    run_observed,
)

from .exchange import FingerprintExchange, GroupIdentity
from .fingerprint import Fingerprint, TensorSpec, spec_of
from .flight_recorder import FAILED, Entry, FlightRecorder, recorders

__all__ = ["DebugProcessGroup"]


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


class DebugProcessGroup(ProcessGroup):
    """Checks every collective across ranks before the wrapped group runs it. See the module
    docstring. Built by the plugin's wrap hook; ``store`` must be private to the group."""

    def __init__(self, inner: ProcessGroup, store: Store) -> None:
        super().__init__(inner.rank(), inner.size(), inner.options)
        self._inner = inner
        # one abort signal for both: aborting this group releases the wrapped group's waits
        self.abort_signal = inner.abort_signal
        global_ranks = tuple(inner.options.global_ranks) or tuple(range(inner.size()))
        self._ident = GroupIdentity(inner.group_name, inner.backend_name, inner.rank(),
                                    global_ranks)
        self.recorder = FlightRecorder(group_name=inner.group_name, group_rank=inner.rank(),
                                       global_ranks=global_ranks, backend=inner.backend_name,
                                       timeout=inner.timeout)
        recorders.add(self.recorder)
        self._exchange = FingerprintExchange(store, self._ident, inner.timeout,
                                             on_failure=self._check_failed)
        self._checking: Entry | None = None
        self._lock = threading.RLock()
        # p2p has its own lock: a send must not wait behind a collective blocked in its check
        # (the peer may need that send before it can reach the collective)
        self._p2p_lock = threading.Lock()
        self._seq = 0
        self._p2p_seq = 0

    # -- identity: the wrapped group's -----------------------------------------------------------
    @property
    def wrapped(self) -> ProcessGroup:
        """The group this one wraps."""
        return self._inner

    @property  # type: ignore[override]
    def backend_name(self) -> str:  # type: ignore[override]
        return self._inner.backend_name

    @property  # type: ignore[override]
    def device_types(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._inner.device_types

    @property  # type: ignore[override]
    def supports_any_source(self) -> bool:  # type: ignore[override]
        return self._inner.supports_any_source

    @property  # type: ignore[override]
    def rebuild_refusal(self) -> str:  # type: ignore[override]
        return self._inner.rebuild_refusal

    @property  # type: ignore[override]
    def grow_refusal(self) -> str:  # type: ignore[override]
        return self._inner.grow_refusal

    def capabilities(self) -> Capabilities:
        return self._inner.capabilities()

    # -- resilience: the wrapped group's mechanisms ---------------------------------------------
    def native_abort(self) -> None:
        self._inner.native_abort()  # the signal is shared (see __init__)

    def native_shrink(self, keep: Sequence[int], options: GroupOptions) -> Any:
        return self._inner.native_shrink(keep, options)  # the core wraps the result again

    def shutdown(self) -> None:
        recorders.remove(self.recorder)
        self._inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        # only reached for names this class lacks: a backend's own attributes
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"<DebugProcessGroup wrapping {self._inner!r}>"

    # -- the check -------------------------------------------------------------------------------
    def _collective(self, op: str, args: tuple[Any, ...], run: Callable[[], Work],
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

    # -- public ops: check, then the wrapped group's own op ------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Work:
        return self._collective(
            "broadcast", (tensor, src), lambda: self._inner.broadcast(tensor, src),
            [spec_of("tensor", tensor)], root=src)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        return self._collective(
            "all_reduce", (tensor, op), lambda: self._inner.all_reduce(tensor, op),
            [spec_of("tensor", tensor)], reduce_op=op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM) -> Work:
        return self._collective(
            "reduce", (tensor, dst, op), lambda: self._inner.reduce(tensor, dst, op),
            [spec_of("tensor", tensor)], reduce_op=op, root=dst)

    def all_gather(self, output_tensors: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        specs = [spec_of("tensor", tensor)]
        specs += [spec_of(f"output_tensors[{i}]", t) for i, t in enumerate(output_tensors)]
        return self._collective("all_gather", (output_tensors, tensor),
                                lambda: self._inner.all_gather(output_tensors, tensor), specs)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        return self._collective(
            "all_gather_into_tensor", (output, tensor),
            lambda: self._inner.all_gather_into_tensor(output, tensor),
            [spec_of("tensor", tensor), spec_of("output", output)])

    def gather(self, tensor: torch.Tensor, gather_list: Sequence[torch.Tensor] | None = None,
               dst: int = 0) -> Work:
        # gather_list exists on dst only: not part of what every rank must agree on
        return self._collective(
            "gather", (tensor, gather_list, dst),
            lambda: self._inner.gather(tensor, gather_list, dst),
            [spec_of("tensor", tensor)], root=dst)

    def scatter(self, tensor: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None = None,
                src: int = 0) -> Work:
        return self._collective(
            "scatter", (tensor, scatter_list, src),
            lambda: self._inner.scatter(tensor, scatter_list, src),
            [spec_of("tensor", tensor)], root=src)

    def reduce_scatter(self, output: torch.Tensor, input_list: Sequence[torch.Tensor],
                       op: ReduceOp = ReduceOp.SUM) -> Work:
        specs = [spec_of("output", output)]
        specs += [spec_of(f"input_list[{i}]", t) for i, t in enumerate(input_list)]
        return self._collective(
            "reduce_scatter", (output, input_list, op),
            lambda: self._inner.reduce_scatter(output, input_list, op), specs,
            reduce_op=op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op: ReduceOp = ReduceOp.SUM) -> Work:
        return self._collective(
            "reduce_scatter_tensor", (output, input, op),
            lambda: self._inner.reduce_scatter_tensor(output, input, op),
            [spec_of("output", output), spec_of("input", input)], reduce_op=op)

    def all_to_all(self, output_tensors: Sequence[torch.Tensor],
                   input_tensors: Sequence[torch.Tensor]) -> Work:
        # shapes differ between ranks by design; dtypes must not, and sizes must pair up
        specs = [TensorSpec(f"input_tensors[{i}]", None, s.dtype, s.device)
                 for i, s in enumerate(spec_of("", t) for t in input_tensors)]
        specs += [TensorSpec(f"output_tensors[{i}]", None, s.dtype, s.device)
                  for i, s in enumerate(spec_of("", t) for t in output_tensors)]
        paired = len(input_tensors) == len(output_tensors) == self.group_size
        return self._collective(
            "all_to_all", (output_tensors, input_tensors),
            lambda: self._inner.all_to_all(output_tensors, input_tensors), specs,
            sends=tuple(_numel(t) for t in input_tensors) if paired else None,
            recvs=tuple(_numel(t) for t in output_tensors) if paired else None)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None) -> Work:
        # rows of different shapes are a local error: left to the wrapped group to report
        rows_match = (isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor)
                      and output.shape[1:] == input.shape[1:])
        return self._collective(
            "all_to_all_single", (output, input, output_split_sizes, input_split_sizes),
            lambda: self._inner.all_to_all_single(output, input, output_split_sizes,
                                                  input_split_sizes),
            [spec_of("output", output, rows_vary=True), spec_of("input", input, rows_vary=True)],
            sends=_row_counts(input, input_split_sizes, self.group_size) if rows_match else None,
            recvs=_row_counts(output, output_split_sizes, self.group_size) if rows_match else None)

    def barrier(self) -> Work:
        return self._collective("barrier", (), self._inner.barrier)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        return self._p2p("send", lambda: self._inner.send(tensor, dst, tag), tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        return self._p2p("recv", lambda: self._inner.recv(tensor, src, tag), tensor, src)


def _forward_native(op: str) -> Callable[..., Work]:
    def native(self: DebugProcessGroup, **kwargs: Any) -> Work:
        return getattr(self._inner, "native_" + op)(**kwargs)

    native.__name__ = "native_" + op
    native.__doc__ = f"The wrapped group's ``native_{op}``, unchecked (for code that composes " \
                     f"ops on this group directly)."
    return native


# an op the core adds later, inherited unwrapped from ProcessGroup, composes through these and
# so still reaches the wrapped backend (unchecked) instead of failing
for _op in OPS:
    setattr(DebugProcessGroup, "native_" + _op, _forward_native(_op))
del _op
