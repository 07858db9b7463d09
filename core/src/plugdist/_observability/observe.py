"""The one place where ops are observed: a ``torch.profiler`` event and a flight-recorder entry.

:class:`~plugdist.ProcessGroup` hands an op to :func:`run` whenever :func:`active` says someone
watches: a torch profiler is running (``torch.profiler.profile``, ``torch.autograd.profiler``),
or the flight recorder records (:mod:`plugdist._observability.flight_recorder`). Then the op becomes

* one profiler event ``plugdist:<backend>:<op>`` carrying the op's tensors (their shapes and
  dtypes appear with ``record_shapes=True``), spanning from the call until the op completed,
  on whichever thread completes it (async ops included), and
* one flight-recorder entry: ``scheduled`` at the call, ``started`` when handed to the backend,
  ``completed`` when done.

Every backend gets both through the core; composed ops are one event and one entry (the ops a
composition issues inside are not observed again), and so is an op issued through a wrapper
group that calls :func:`run` itself (the debug plugin): the inner group's dispatch only marks
the wrapper's entry ``started``. When nobody watches (the profiler off, recording turned off
with ``TORCH_FR_BUFFER_SIZE=0``), the cost is :func:`active`: two attribute reads. With the
recorder alone (the default), an op of one tensor takes the recorder's short route: a blocking
one's is written in ``ProcessGroup.run_blocking`` (see :func:`blocking`), an async one's in
:func:`run_one`.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._C._profiler import _RecordFunctionFast
from torch.autograd import profiler as _profiler

from plugdist._observability.flight_recorder import (
    COMPLETED,
    LISTS,
    NONE,
    ONE,
    PAIR,
    Flat,
    recorder,
)

__all__ = ["active", "run", "run_one", "blocking", "issue_rest", "SHORT_OPS"]

# op -> (how its tensors are recorded, point-to-point, input parameters, output parameters,
# peer parameter) of its public method
_Spec = tuple[int, bool, tuple[str, ...], tuple[str, ...], str | None]
_SPECS: dict[str, _Spec] = {
    "broadcast": (ONE, False, ("tensor",), ("tensor",), None),
    "all_reduce": (ONE, False, ("tensor",), ("tensor",), None),
    "reduce": (ONE, False, ("tensor",), ("tensor",), None),
    "all_gather": (LISTS, False, ("tensor",), ("output_tensors",), None),
    "all_gather_into_tensor": (PAIR, False, ("tensor",), ("output",), None),
    "gather": (LISTS, False, ("tensor",), ("gather_list",), None),
    "scatter": (LISTS, False, ("scatter_list",), ("tensor",), None),
    "reduce_scatter": (LISTS, False, ("input_list",), ("output",), None),
    "reduce_scatter_tensor": (PAIR, False, ("input",), ("output",), None),
    "all_to_all": (LISTS, False, ("input_tensors",), ("output_tensors",), None),
    "all_to_all_single": (PAIR, False, ("input",), ("output",), None),
    "barrier": (NONE, False, (), (), None),
    "send": (ONE, True, ("tensor",), (), "dst"),
    "recv": (ONE, True, (), ("tensor",), "src"),
}
_OTHER: _Spec = (NONE, False, (), (), None)
_now_ns = time.monotonic_ns  # the flight recorder's clock
_thread_id = threading.get_ident
# op -> (kind, p2p, input positions, output positions, peer position) among the positional
# arguments of its public method (run_blocking's)
_Positions = tuple[int, bool, tuple[int, ...], tuple[int, ...], int]
_positions: dict[str, _Positions] = {}
# the collectives of one tensor, the first argument of each: the recorder's short route, which
# ProcessGroup.run_blocking writes itself (see issue_rest)
SHORT_OPS = frozenset({"all_reduce", "broadcast", "reduce"})


def active() -> bool:
    """Whether ops are observed now: a torch profiler runs, or the flight recorder records."""
    return _profiler._is_profiler_enabled or recorder.on


class _Current(threading.local):
    entry: int | None = None  # the record id of the op this thread issues under observation


_current = _Current()


def run(pg: Any, op: str, args: tuple[Any, ...] | dict[str, Any],
        issue: Callable[[], Any], *, started: bool) -> Any:
    """Observe ``op`` on ``pg`` while ``issue()`` issues it; returns what ``issue`` returns.

    ``args``: the public op's arguments (positional, or by name). ``issue`` returns the op's
    Work (the observation ends when it completes) or None once the op is done. ``started``:
    whether ``issue`` hands the op straight to the backend (a wrapper that checks first passes
    False; the inner group's dispatch then marks it started). Inside another observation (a
    wrapper's), only marks that one started."""
    outer = _current.entry
    if outer is not None:
        recorder.started(outer)
        return issue()
    rid, rf = _begin(pg, op, args, started)
    _current.entry = rid
    try:
        result = issue()
    except BaseException as err:
        _finish(rid, rf, err)
        raise
    finally:
        _current.entry = None
    if result is None:
        _finish(rid, rf, None)
    elif result.is_completed():
        _finish(rid, rf, result.exception())
    else:
        result.on_completion(lambda error: _finish(rid, rf, error))
    return result


def run_one(pg: Any, op: str, device: str, kwargs: dict[str, Any], gathering: bool) -> Any:
    """``pg._dispatch_unobserved(op, device, kwargs, gathering)`` observed by the recorder's
    short route: a collective of one tensor (:data:`SHORT_OPS`, its tensor ``kwargs["tensor"]``)
    with the recorder alone on, untimed (``FlightRecorder.fast``, the default). Its entry is
    :meth:`FlightRecorder.record`'s, written here, completed untimed through the Work's
    ``on_completion``. Anything else takes :func:`run`: an observation around this one (a
    wrapper's, or ``run_blocking``'s), a tensor argument that is not a tensor, a group built by
    hand. Unlike :func:`run`, ops the backend issues meanwhile on other groups are their own
    entries (this group's own dispatch is not entered again: compositions and AVG's divide run
    below it)."""
    t = kwargs.get("tensor")
    g = getattr(pg, "_flight_group", None)
    if _current.entry is not None or type(t) is not torch.Tensor or g is None:
        return run(pg, op, kwargs,
                   lambda: pg._dispatch_unobserved(op, device, kwargs, gathering), started=True)
    g.collectives = seq = g.collectives + 1
    rid = next(recorder.ids)
    recorder.ring[rid % recorder.capacity] = entry = [
        rid, g, op, seq, g.p2p, None, ONE, t.shape, t.dtype, _now_ns(), _thread_id(), True, None]
    try:
        work = pg._dispatch_unobserved(op, device, kwargs, gathering)
    except BaseException as err:
        recorder.failed(rid, err)
        raise

    def done(error: BaseException | None) -> None:
        if error is None:
            entry[-1] = COMPLETED  # this entry: a ring slot reused meanwhile is not touched
        else:
            recorder.failed(rid, error)

    work.on_completion(done)
    return work


def blocking(pg: Any, op: str, args: tuple[Any, ...], lean: Callable[..., bool] | None) -> None:
    """``ProcessGroup.run_blocking`` observed: ``lean(pg, *args)`` (the backend's lean route,
    True once done), else ``pg._run_blocking_rest(op, args)``, as one observed op done when
    this returns (an entry, and a profiler event under the profiler).

    A collective of one tensor (:data:`SHORT_OPS`) with the recorder alone on (the default)
    does not come here: ``run_blocking`` writes its entry itself, the recorder's short route
    (what :meth:`FlightRecorder.record` writes, untimed, without the thread's id; a dump finds
    the thread blocked in that ``run_blocking``), since the call here would be a fifth of what
    recording such an op costs."""
    rid, rf = _begin(pg, op, args, True)
    try:
        if lean is None or not lean(pg, *args):
            issue_rest(pg, op, args, rid)
    except BaseException as err:
        _finish(rid, rf, err)
        raise
    _finish(rid, rf, None)


def issue_rest(pg: Any, op: str, args: tuple[Any, ...], rid: int | None) -> None:
    """``pg._run_blocking_rest(op, args)`` for the op observed as ``rid`` (its entry; None
    when only the profiler watches): the public op it issues marks that entry started instead
    of making its own."""
    _current.entry = rid
    try:
        pg._run_blocking_rest(op, args)
    finally:
        _current.entry = None


def _begin(pg: Any, op: str, args: tuple[Any, ...] | dict[str, Any],
           started: bool) -> tuple[int | None, Any]:
    """The op's entry (when recording) and (when a profiler runs) its entered profiler event."""
    rid = _record(pg, op, args, started) if recorder.on else None
    rf = None
    if _profiler._is_profiler_enabled:
        inputs, outputs, _ = _values(pg, op, args)
        rf = _RecordFunctionFast(f"plugdist:{pg.backend_name}:{op}", _flat(inputs, outputs))
        rf.__enter__()
    return rid, rf


def _finish(rid: int | None, rf: Any, error: BaseException | None) -> None:
    if rf is not None:
        rf.__exit__(None, None, None)
    if rid is not None:
        recorder.finished(rid, error)


def _record(pg: Any, op: str, args: tuple[Any, ...] | dict[str, Any], started: bool) -> int:
    """The entry of any op: its tensors taken as its kind records them."""
    kind, p2p, _, _, peer_name = _SPECS.get(op, _OTHER)
    if kind == ONE and type(args) is dict:  # a dispatch's (every async op): read directly
        t = args.get("tensor")  # every ONE op's tensor (see _SPECS)
        if type(t) is torch.Tensor:
            return recorder.record(pg, op, p2p, ONE, t.shape, t.dtype,
                                   args.get(peer_name) if peer_name else None, started)
    inputs, outputs, peer = _values(pg, op, args)
    a: Any = None
    b: Any = None
    if kind == ONE:
        t = next((v for v in (*inputs, *outputs) if isinstance(v, torch.Tensor)), None)
        if t is not None:
            a, b = t.shape, t.dtype
    elif kind == PAIR and inputs and outputs and isinstance(inputs[0], torch.Tensor) \
            and isinstance(outputs[0], torch.Tensor):
        a, b = (inputs[0].shape, inputs[0].dtype), (outputs[0].shape, outputs[0].dtype)
    elif kind != NONE:
        kind, a, b = LISTS, _specs(inputs), _specs(outputs)
    return recorder.record(pg, op, p2p, kind, a, b, peer, started)


def _values(pg: Any, op: str, args: tuple[Any, ...] | dict[str, Any]
            ) -> tuple[list[Any], list[Any], Any]:
    """The op's input values, output values and peer, from its arguments."""
    if isinstance(args, dict):
        _, _, ins, outs, peer = _SPECS.get(op, _OTHER)
        return ([args.get(n) for n in ins], [args.get(n) for n in outs],
                args.get(peer) if peer else None)
    _, _, at_in, at_out, at_peer = _positions.get(op) or _positions_of(pg, op)
    return ([args[i] for i in at_in if i < len(args)],
            [args[i] for i in at_out if i < len(args)],
            args[at_peer] if at_peer < len(args) else None)


def _positions_of(pg: Any, op: str) -> _Positions:
    """Where the public op's inputs, outputs and peer sit among its positional arguments."""
    at = _positions.get(op)
    if at is None:  # every group spells a public op's parameters as ProcessGroup does
        names = tuple(inspect.signature(getattr(type(pg), op)).parameters)[1:]
        kind, p2p, ins, outs, peer = _SPECS.get(op, _OTHER)
        at = _positions[op] = (kind, p2p, tuple(names.index(n) for n in ins if n in names),
                               tuple(names.index(n) for n in outs if n in names),
                               names.index(peer) if peer in names else len(names) + 1)
    return at


def _flat(inputs: list[Any], outputs: list[Any]) -> list[torch.Tensor]:
    """Every tensor of the op once, inputs first (an in-place op's tensor is both)."""
    flat: list[torch.Tensor] = []
    for v in (*inputs, *outputs):
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor) and not any(t is seen for seen in flat):
                flat.append(t)
    return flat


def _specs(values: list[Any]) -> tuple[tuple[Any, Any], ...]:
    """(shape, dtype) per tensor value; a tensor list's shapes as one Flat (its elements are
    summed at dump time, as torch records the lists it flattens)."""
    specs: list[tuple[Any, Any]] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            specs.append((v.shape, v.dtype))
        elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            specs.append((Flat(t.shape for t in v), v[0].dtype))
    return tuple(specs)
