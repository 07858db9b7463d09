"""plugdist-bench: a real two-rank sweep against the comparison, read back from its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import plugdist
import pytest
from plugdist._tools.bench import parse_size, parser

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_help_explains_every_option() -> None:
    actions = [a for a in parser()._actions if a.dest != "help"]
    assert {a.dest for a in actions} >= {"backend", "op", "nproc", "minbytes", "maxbytes",
                                         "stepfactor", "dtype", "compare", "completion",
                                         "iters", "pin", "timeout"}
    for action in actions:
        assert action.help and len(action.help) > 15, f"{action.option_strings}: {action.help!r}"
    text = parser().format_help()
    assert "-b MINBYTES, --minbytes MINBYTES" in text and "K, M and G suffixes" in text


def test_parse_size() -> None:
    assert [parse_size(s) for s in ("8", "64K", "1M", "2g", "512B")] == \
        [8, 64 << 10, 1 << 20, 2 << 30, 512]


def _sweep(*args: str, header: str = "completion=blocking ") -> list[list[str]]:
    res = subprocess.run([sys.executable, "-m", "plugdist._tools.bench", "--nproc", "2", "-b", "8",
                          "-e", "32", "-f", "4", "--iters", "30", *args, "--timeout", "120"],
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("# plugdist-bench") and "ratio = median over chunks" in lines[0]
    assert header in lines[0], lines[0]
    assert lines[1].split()[:6] == ["size(B)", "count", "type", "time(us)", "algbw(GB/s)",
                                    "busbw(GB/s)"]
    return [line.split() for line in lines[2:]]


@pytest.mark.parametrize("backend, compare, completion", [
    ("gloo", "torch", "blocking"), ("mpi", "mpi4py", "blocking"),
    ("gloo", "torch", "work"), ("mpi", "mpi4py", "future")])
def test_sweep_prints_one_row_per_size_with_a_ratio(backend: str, compare: str,
                                                    completion: str) -> None:
    if not plugdist.is_backend_available(backend):
        pytest.skip(f"plugdist-{backend} is not installed")
    rows = _sweep("--backend", backend, "--op", "all_reduce", "--compare", compare,
                  "--completion", completion, header=f"completion={completion} ")
    assert [(r[0], r[1], r[2]) for r in rows] == [("8", "2", "float32"), ("32", "8", "float32")]
    for r in rows:
        ours, theirs, ratio = float(r[3]), float(r[6]), float(r[7])
        assert ours > 0 and theirs > 0 and 0 < ratio < 100, r


@pytest.mark.parametrize("op, completion", [
    ("broadcast", "blocking"), ("reduce", "blocking"), ("all_gather", "blocking"),
    ("reduce_scatter", "blocking"), ("all_to_all", "blocking"),
    ("reduce", "work"), ("all_gather", "future")])
def test_every_op_compares_with_raw_mpi4py(op: str, completion: str) -> None:
    if not plugdist.is_backend_available("mpi"):
        pytest.skip("plugdist-mpi is not installed")
    rows = _sweep("--backend", "mpi", "--op", op, "--compare", "mpi4py",
                  "--completion", completion, header=f"completion={completion} ")
    assert [r[0] for r in rows] == ["8", "32"]
    for r in rows:
        assert float(r[3]) > 0 and float(r[6]) > 0 and 0 < float(r[7]) < 100, r


def test_old_vs_new_prints_each_sides_median_beside_the_other(tmp_path: Path) -> None:
    """Two "installations" (two interpreters: links to this one in two checkouts' venvs) run
    the same benchmark script, each its own checkout's copy, alternately; every line with
    numbers comes back twice, old above new, each number the median of that side's runs."""
    roots = {}
    for side, us in (("old", "[5.0, 7.0, 6.0]"), ("new", "[2.0, 3.0, 4.0]")):
        root = roots[side] = tmp_path / side
        (root / ".venv" / "bin").mkdir(parents=True)
        (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
        (root / "benchmarks").mkdir()
        # each run prints the next of its side's times (a count kept beside the script)
        (root / "benchmarks" / "tiny.py").write_text(
            "import pathlib\n"
            "n = pathlib.Path(__file__).with_suffix('.n')\n"
            "i = int(n.read_text()) if n.exists() else 0\n"
            "n.write_text(str(i + 1))\n"
            "print('# tiny')\n"
            f"print(f'all_reduce 8 float32 {{{us}[i]:.2f}} 1.50x')\n")
    res = subprocess.run(
        [str(roots["new"] / ".venv" / "bin" / "python"), str(BENCHMARKS / "old_vs_new.py"),
         "--old", str(roots["old"] / ".venv" / "bin" / "python"),
         "--new", str(roots["new"] / ".venv" / "bin" / "python"), "--repeat", "3", "--",
         str(roots["new"] / "benchmarks" / "tiny.py")],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "    # tiny" in lines
    at = lines.index("old all_reduce 8 float32 6.00 1.50x")
    assert lines[at + 1] == "new all_reduce 8 float32 3.00 1.50x", lines
    assert f"# old: {roots['old'] / '.venv' / 'bin' / 'python'} " \
           f"{roots['old'] / 'benchmarks' / 'tiny.py'}" in lines, lines


def test_late_peer_bench_times_each_way_of_waiting_past_the_delay() -> None:
    """benchmarks/late_peer_bench.py, short: every way of waiting lasts at least the peer's
    delay, and its table says so."""
    if not plugdist.is_backend_available("mpi"):
        pytest.skip("plugdist-mpi is not installed")
    res = subprocess.run([sys.executable, str(BENCHMARKS / "late_peer_bench.py"), "--late-ms",
                          "2", "--rounds", "2", "--timeout", "120"],
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[1].split() == ["way", "median", "worst", "excess", "(median)"], lines
    rows = {r.split()[0]: [float(x) for x in r.split()[1:]] for r in lines[2:]}
    assert set(rows) == {"sync", "work", "future"}, lines
    for way, (median, worst, excess) in rows.items():
        assert 2.0 <= median <= worst and excess > -0.5, (way, lines)
