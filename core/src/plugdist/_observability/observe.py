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
the wrapper's entry ``started``. When nobody watches, the cost is :func:`active`: two attribute
reads.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._C._profiler import _RecordFunctionFast
from torch.autograd import profiler as _profiler

from plugdist._observability.flight_recorder import Entry, recorder

__all__ = ["active", "run", "blocking"]

# op -> (input parameters, output parameters) of its public method
_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "broadcast": (("tensor",), ("tensor",)),
    "all_reduce": (("tensor",), ("tensor",)),
    "reduce": (("tensor",), ("tensor",)),
    "all_gather": (("tensor",), ("output_tensors",)),
    "all_gather_into_tensor": (("tensor",), ("output",)),
    "gather": (("tensor",), ("gather_list",)),
    "scatter": (("scatter_list",), ("tensor",)),
    "reduce_scatter": (("input_list",), ("output",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
    "all_to_all": (("input_tensors",), ("output_tensors",)),
    "all_to_all_single": (("input",), ("output",)),
    "barrier": ((), ()),
    "send": (("tensor",), ()),
    "recv": ((), ("tensor",)),
}
_PEER = {"send": "dst", "recv": "src"}
_params: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {}


def active() -> bool:
    """Whether ops are observed now: a torch profiler runs, or the flight recorder records."""
    return _profiler._is_profiler_enabled or recorder.on


class _Current(threading.local):
    entry: Entry | None = None  # the op this thread is issuing under observation


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
    entry, rf = _begin(pg, op, args, started)
    _current.entry = entry
    try:
        result = issue()
    except BaseException as err:
        _finish(entry, rf, err)
        raise
    finally:
        _current.entry = None
    if result is None:
        _finish(entry, rf, None)
    elif result.is_completed():
        _finish(entry, rf, result.exception())
    else:
        result.get_future().add_done_callback(lambda fut: _finish(entry, rf, _error(fut)))
    return result


def blocking(pg: Any, op: str, args: tuple[Any, ...], lean: Callable[..., bool] | None,
             rest: Callable[[str, tuple[Any, ...]], None]) -> None:
    """``ProcessGroup.run_blocking`` observed: ``lean(pg, *args)`` (the backend's lean route,
    True once done), else ``rest(op, args)``, as one observed op done when this returns."""
    entry, rf = _begin(pg, op, args, True)
    try:
        if lean is None or not lean(pg, *args):
            _current.entry = entry  # only here: the lean route dispatches nothing
            try:
                rest(op, args)
            finally:
                _current.entry = None
    except BaseException as err:
        _finish(entry, rf, err)
        raise
    _finish(entry, rf, None)


def _begin(pg: Any, op: str, args: tuple[Any, ...] | dict[str, Any],
           started: bool) -> tuple[Entry, Any]:
    """The op's entry and (when a profiler runs) its entered profiler event."""
    ins, outs = _IO.get(op, ((), ()))
    if isinstance(args, dict):
        inputs = [args.get(n) for n in ins]
        outputs = [args.get(n) for n in outs]
        peer = args.get(_PEER.get(op, ""))
    else:
        at = _positions(pg, op)
        inputs = [args[i] for i in at[0] if i < len(args)]
        outputs = [args[i] for i in at[1] if i < len(args)]
        peer = args[at[2]] if at[2] < len(args) else None
    entry = recorder.record(pg, op, _specs(inputs), _specs(outputs), peer)
    rf = None
    if _profiler._is_profiler_enabled:
        rf = _RecordFunctionFast(f"plugdist:{pg.backend_name}:{op}", _flat(inputs, outputs))
        rf.__enter__()
    if started:
        recorder.started(entry, now=True)
    return entry, rf


def _finish(entry: Entry, rf: Any, error: BaseException | None) -> None:
    if rf is not None:
        rf.__exit__(None, None, None)
    recorder.finished(entry, error)


def _error(fut: torch.futures.Future) -> BaseException | None:
    try:
        fut.value()
    except BaseException as err:  # noqa: BLE001 - recorded; the caller's wait raises it
        return err
    return None


def _positions(pg: Any, op: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Where the public op's inputs, outputs and peer sit among its positional arguments."""
    at = _params.get(op)
    if at is None:  # every group spells a public op's parameters as ProcessGroup does
        names = tuple(inspect.signature(getattr(type(pg), op)).parameters)[1:]
        ins, outs = _IO.get(op, ((), ()))
        peer = _PEER.get(op)
        at = _params[op] = (tuple(names.index(n) for n in ins if n in names),
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


def _specs(values: list[Any]) -> list[tuple[Any, Any]]:
    """(shape, dtype) per value; a tensor list counts as one flat tensor of all its elements,
    as torch records the lists it flattens (what torch's analyzer compares)."""
    specs: list[tuple[Any, Any]] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            specs.append((v.shape, v.dtype))
        elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            specs.append(((sum(t.numel() for t in v),), v[0].dtype))
    return specs
