"""The ``plugdist`` command line: ``plugdist info``, ``plugdist new-backend`` and subcommands that
plugins add."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from plugdist._backend.base import OPS, BackendBase
from plugdist._backend.capabilities import Capabilities
from plugdist._backend.reduce_op import ReduceOp
from plugdist._group import composition
from plugdist._registry import BACKENDS, GROUPS, registry

__all__ = ["main", "backend_table", "reduction_lines"]

DEVICES = ("cpu", "cuda")
# the ops that reduce: a backend's reductions are native only where one of these is
REDUCING_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
_MARK = {"native": "native", "composed": "composed", "unsupported": "-"}


def backend_table(factory: Any) -> list[tuple[str, list[str]]]:
    """Rows ``(op, [mark per device])`` for a backend class, as in the seed document's table."""
    if not (isinstance(factory, type) and issubclass(factory, BackendBase)):
        return []
    caps = factory.static_capabilities()
    rows = []
    for op in OPS:
        marks = []
        for dev in DEVICES:
            if dev not in caps.device_types:
                marks.append("-")
            else:
                marks.append(_MARK[composition.plan(caps, op, dev)[0]])
        rows.append((op, marks))
    return rows


def reduction_lines(caps: Capabilities) -> list[str]:
    """How a backend reduces, as ``plugdist info`` says it: a reduction is native only where a
    reducing op is; the rest are composed (named with how) or refused."""
    native_ops = sorted({op for op, _dev in caps.native if op in REDUCING_OPS})
    refused = caps.refused_reduce_ops
    offered = [r for r in ReduceOp if r not in refused]
    native = [r for r in offered if native_ops and r in caps.reduce_ops]
    lines = [f"native reductions: {_names(native) or 'none'}"
             + (f" (in {', '.join(native_ops)})" if native else "")]
    by_divide = ReduceOp.AVG not in native and ReduceOp.SUM in native
    by_gather = [r for r in offered if r not in native and not (by_divide and r is ReduceOp.AVG)]
    composed = ["AVG as SUM, then a local divide"] if by_divide else []
    if by_gather:
        which = "all" if len(by_gather) == len(offered) else _names(by_gather)
        composed.append(f"{which} as an all_gather, then a local reduce")
    if composed:
        lines.append(f"composed reductions: {'; '.join(composed)}")
    if refused:
        lines.append(f"refused reductions (an error, not composed): {_names(refused)}")
    return lines


def _names(reductions: Iterable[ReduceOp]) -> str:
    return ", ".join(sorted(r.name for r in reductions))


def _info(args: argparse.Namespace) -> int:
    out = sys.stdout
    plugins = registry.describe()
    for group in GROUPS:
        entries = [p for p in plugins if p.group == group]
        out.write(f"{group}:\n")
        if not entries:
            out.write("  (none installed)\n")
        for p in entries:
            origin = "registered at runtime" if p.runtime else f"{p.distribution} {p.version}"
            status = "" if p.error is None else "  FAILED TO LOAD"
            out.write(f"  {p.name:<16} {origin:<28} {p.target}{status}\n")
            if p.error:
                out.write("".join(f"      {line}\n" for line in p.error.splitlines()))
    for name in registry.names(BACKENDS):
        try:
            factory = registry.load(BACKENDS, name)
        except Exception:  # noqa: BLE001 - already reported above
            continue
        check = getattr(factory, "is_available", None)
        ok, why = check() if callable(check) else (True, "")
        out.write(f"\nbackend {name}: {'available' if ok else 'NOT available: ' + why}\n")
        rows = backend_table(factory)
        if not rows:
            out.write("  (a factory function: ops known only once a group exists)\n")
            continue
        caps = factory.static_capabilities()
        out.write(f"  {'op':<24}" + "".join(f"{d:<11}" for d in DEVICES) + "\n")
        for op, marks in rows:
            out.write(f"  {op:<24}" + "".join(f"{m:<11}" for m in marks) + "\n")
        out.write("".join(f"  {line}\n" for line in reduction_lines(caps)))
        out.write(f"  receive from any source: {'yes' if caps.any_source_recv else 'no'}\n")
    return 0


def _new_backend(args: argparse.Namespace) -> int:
    from pathlib import Path

    from plugdist._tools.scaffold import scaffold

    name = args.name
    directory = Path(args.dir or f"plugdist-{name.replace('_', '-')}")
    try:
        written = scaffold(name, directory)
    except (ValueError, FileExistsError) as err:
        sys.stderr.write(f"plugdist new-backend: {err}\n")
        return 2
    out = sys.stdout
    out.write("".join(f"wrote {path}\n" for path in written))
    if name in registry.names(BACKENDS):
        out.write(f"note: a backend named {name!r} is installed already; installing this one "
                  f"makes the name ambiguous (pick another name, or uninstall that one)\n")
    out.write(f"\nnext:\n  pip install -e \"{directory}[testing]\"\n  plugdist info\n"
              f"  pytest {directory}    # the conformance suite on backend {name!r}\n"
              f"Every hook a backend may implement: plugdist's docs/backends.md.\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugdist", description="plugdist command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info",
                          help="installed plugins, their versions, and what each backend does")
    info.set_defaults(func=_info)
    new = sub.add_parser("new-backend",
                         help="write a backend package (send/recv over TCP sockets) that passes "
                              "the conformance suite as written")
    new.add_argument("name", help="the backend's name (lowercase letters, digits, underscores)")
    new.add_argument("--dir", help="where to write the package (default: ./plugdist-NAME)")
    new.set_defaults(func=_new_backend)
    registry.plugins().hook.plugdist_add_cli_commands(subparsers=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
