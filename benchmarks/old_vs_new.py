"""Any benchmark, two installations, one run: the old figures beside the new ones.

Runs the benchmark command under the old installation's interpreter and under this one,
alternately (old, new, old, new, ...: drift on a shared machine hits both sides alike), then
prints every line of its output twice, ``old`` above ``new``, each number the median over that
side's runs (``--best``: the lowest, for times). Lines are matched by their text with the
numbers taken out, and by how often that text came before in the run (a table's rows).

    git worktree add ../old HEAD~1 && (cd ../old && make venv)     # the version before
    python benchmarks/old_vs_new.py --old ../old/.venv/bin/python -- benchmarks/bridge_bench.py \\
        --parts floor
    python benchmarks/old_vs_new.py --old ../old/.venv/bin/python --repeat 3 -- \\
        -m plugdist._tools.bench --backend mpi --op all_reduce --nproc 2 -b 8 -e 4K -f 8 \\
        --compare mpi4py

A script path in the command (``benchmarks/x.py``) is run from each side's own checkout (the
folder above the interpreter's virtualenv), so each side measures with its own copy of the
benchmark; where the old checkout has no such file, both run the new copy (said at the top).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

# a number standing alone (not in "float32"), or as a ratio ("1.19x") or at a sentence's end
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?=x\b|\.(?!\d)|[^\w.]|$)")


def checkout_of(python: str) -> Path:
    """The checkout whose virtualenv ``python`` is (``<root>/.venv/bin/python``)."""
    return Path(python).absolute().parents[2]


def command_for(python: str, cmd: list[str], here: Path) -> tuple[list[str], str | None]:
    """``cmd`` for ``python``'s checkout: a script path of this checkout becomes the same path
    in that one, when it exists there. Returns the command and a note when it does not."""
    if not cmd or not cmd[0].endswith(".py"):
        return [python, *cmd], None
    script = Path(cmd[0]).absolute()
    try:
        relative = script.relative_to(here)
    except ValueError:
        return [python, *cmd], None
    theirs = checkout_of(python) / relative
    if theirs.exists():
        return [python, str(theirs), *cmd[1:]], None
    return [python, str(script), *cmd[1:]], f"{relative} is not in {checkout_of(python)}: " \
                                            f"both sides run this checkout's copy"


def lines_of(output: str) -> dict[tuple[str, int], tuple[list[str], list[str]]]:
    """Each output line by (its text without numbers, spacing aside, and the number it starts
    with, if any: a table row's size; then its occurrence): its pieces between numbers, and its
    numbers as printed (the leading one kept as a label, not compared)."""
    seen: dict[str, int] = {}
    out: dict[tuple[str, int], tuple[list[str], list[str]]] = {}
    for line in output.splitlines():
        pieces = _NUMBER.split(line)
        numbers = _NUMBER.findall(line)
        text = "\0".join(" ".join(p.split()) for p in pieces)
        if numbers and not pieces[0].strip():  # a row: its first number names it
            text += "\0" + numbers[0]
        at = seen[text] = seen.get(text, -1) + 1
        out[(text, at)] = (pieces, numbers)
    return out


def _render(pieces: list[str], numbers: list[float], like: list[str]) -> str:
    """The line with ``numbers`` in place, each as wide and with as many decimals as the
    printed number in its place (``like``)."""
    out = [pieces[0]]
    for value, model, piece in zip(numbers, like, pieces[1:], strict=True):
        decimals = len(model.split(".")[1]) if "." in model else 0
        sign = "+" if model.startswith("+") else ""
        out += [f"{value:{sign}.{decimals}f}".rjust(len(model)), piece]
    return "".join(out)


def merge(runs: dict[str, list[str]], best: bool) -> list[str]:
    """The lines of the runs' outputs: a line without numbers once, any other as ``old``
    above ``new`` (see the module), in the order of the first new run."""
    pick = min if best else statistics.median
    parsed = {side: [lines_of(out) for out in outs] for side, outs in runs.items()}
    report = []
    for key, (pieces, like) in parsed["new"][0].items():
        if not like:
            report.append(f"    {''.join(pieces)}")
            continue
        for side in ("old", "new"):
            columns = [[float(n) for n in out[key][1]] for out in parsed[side] if key in out]
            if columns:
                values = [pick(col) for col in zip(*columns, strict=True)]
                report.append(f"{side:<4}{_render(pieces, values, like)}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, metavar="PYTHON",
                   help="the old installation's interpreter (its checkout's .venv/bin/python)")
    p.add_argument("--new", default=sys.executable, metavar="PYTHON",
                   help="the new one (default: this interpreter)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--best", action="store_true",
                   help="each number the lowest of a side's runs (times), not the median")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: the benchmark's arguments to python (a script or -m module)")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the benchmark after --")
    here = checkout_of(args.new)
    sides = {"old": command_for(args.old, cmd, here), "new": command_for(args.new, cmd, here)}
    for side, (_, note) in sides.items():
        if note:
            print(f"# {side}: {note}")
    runs: dict[str, list[str]] = {"old": [], "new": []}
    for i in range(args.repeat):
        for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
            full, _ = sides[side]
            done = subprocess.run(full, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"# {side} run {i + 1} failed ({done.returncode}): {' '.join(full)}\n"
                      f"{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            runs[side].append(done.stdout)
    print(f"# {args.repeat} runs per side, alternating; each number the "
          f"{'lowest' if args.best else 'median'} of a side's runs")
    print(f"# old: {' '.join(sides['old'][0])}\n# new: {' '.join(sides['new'][0])}")
    print("\n".join(merge(runs, args.best)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
