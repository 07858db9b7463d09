"""The PNGs of plugdist-bench --plot, the benchmarks' --plot and the chaos soak's timeline: real
images (PNG header, size, read back), holding the series they should (the figure's data, and
each series' colour in the pixels), on log axes where the docs say so. plugdist-bench runs for
real, end to end; the benchmarks' plot functions get the rows their sweeps produce.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
matplotlib = pytest.importorskip("matplotlib", reason="pip install 'plugdist[plots]'")

BLUE, RED, GREEN = (0x15, 0x65, 0xC0), (0xC6, 0x28, 0x28), (0x2E, 0x7D, 0x32)


def png(path: Path, min_size: tuple[int, int] = (400, 300)) -> Any:
    """Check ``path`` is a PNG of at least ``min_size`` pixels; its pixels (rows x cols x 4)."""
    from matplotlib.image import imread
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])   # IHDR
    assert width >= min_size[0] and height >= min_size[1], (width, height)
    pixels = imread(str(path))
    assert pixels.shape[:2] == (height, width)
    assert pixels[..., :3].std() > 0.05, "a blank image"
    return pixels


def has_colour(pixels: Any, rgb: tuple[int, int, int], at_least: int = 30) -> bool:
    """Whether at least ``at_least`` pixels are (nearly) ``rgb``."""
    want = [c / 255 for c in rgb]
    close = abs(pixels[..., 0] - want[0]) + abs(pixels[..., 1] - want[1]) \
        + abs(pixels[..., 2] - want[2]) < 0.06
    return int(close.sum()) >= at_least


@pytest.mark.timeout(240)
def test_plugdist_bench_writes_latency_against_size_beside_its_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.png"
    done = subprocess.run(
        [sys.executable, "-m", "plugdist._tools.bench", "--backend", "gloo", "--nproc", "2",
         "-b", "8", "-e", "4K", "-f", "8", "--compare", "torch", "--iters", "24", "--no-pin",
         "--plot", str(out)], capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line[:1] == " "]
    assert [int(r[0]) for r in rows[1:]] == [8, 64, 512, 4096], done.stdout   # the table
    assert f"# plot: {out}" in done.stdout
    pixels = png(out)
    assert has_colour(pixels, BLUE) and has_colour(pixels, RED)   # plugdist and torch


def test_the_bench_figure_holds_both_sides_on_log_axes(tmp_path: Path) -> None:
    from plugdist._tools import bench
    rows = [{"bytes": b, "ours": t, "theirs": 2 * t, "ratio": 0.5}
            for b, t in ((8, 1e-4), (512, 2e-4), (32768, 8e-4))]
    cfg = {"op": "all_reduce", "backend": "gloo", "dtype": "float32", "compare": "torch"}
    fig = bench.plot(rows, cfg, 2, str(tmp_path / "b.png"))
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in ax.get_lines()}
    assert lines == {"plugdist (gloo)": ([8, 512, 32768], [100.0, 200.0, 800.0]),
                     "torch.distributed (gloo)": ([8, 512, 32768], [200.0, 400.0, 1600.0])}
    png(tmp_path / "b.png")


def test_nccl_bench_plots_every_side(tmp_path: Path) -> None:
    import nccl_bench
    rows: list[dict[str, Any]] = [
        {"bytes": b, **{s: {"latency": k * b * 1e-9 + 1e-5, "host": 1e-5}
                        for k, s in enumerate(nccl_bench.SIDES, 1)}}
        for b in (8, 65536, 4 << 20)]
    fig = nccl_bench.plot(rows, 2, str(tmp_path / "n.png"))
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert [line.get_label() for line in ax.get_lines()] == [
        "plugdist (plugdist-nccl)", "torch over plugdist_nccl", "torch's own NCCL"]
    assert list(ax.get_lines()[2].get_ydata()) == pytest.approx(
        [1e6 * r["torch"]["latency"] for r in rows])
    pixels = png(tmp_path / "n.png")
    assert has_colour(pixels, BLUE) and has_colour(pixels, RED) and has_colour(pixels, GREEN)


def test_store_and_ddp_bench_plot_a_bar_per_store_and_variant(tmp_path: Path) -> None:
    import argparse

    import ddp_bench
    import store_bench
    cases = ["set, split", "get, split"]
    medians = {"plugdist": [20.0, 18.0], "plugdist+token": [21.0, 19.0], "torch": [40.0, 35.0]}
    fig = store_bench.plot(cases, medians, argparse.Namespace(value_size=16, iters=100),
                           str(tmp_path / "s.png"))
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    assert [p.get_height() for p in ax.patches] == [20.0, 18.0, 21.0, 19.0, 40.0, 35.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(medians)
    png(tmp_path / "s.png")
    med = {"plugdist": 30.0, "torch": 33.0}
    fig = ddp_bench.plot(med, {"plugdist": 29.0, "torch": 31.0},
                         {"plugdist": 28.0, "torch": 30.0}, "ddp", str(tmp_path / "d.png"))
    assert [p.get_height() for p in fig.axes[0].patches] == [30.0, 29.0, 28.0, 33.0, 31.0, 30.0]
    png(tmp_path / "d.png")


def test_the_chaos_timeline_marks_each_fault_the_pauses_and_the_steps(tmp_path: Path) -> None:
    import chaos
    began = 1000.0
    commits = [(began + 0.1 * s, s, 4 if s < 40 or s >= 70 else 3) for s in range(100)]
    timeline = {"commits": commits, "pauses": [(began + 3.9, 1.2)]}
    faults = [(began + 3.8, "kill"), (began + 6.5, "stop")]
    fig = chaos.plot_timeline(timeline, faults, began, str(tmp_path / "t.png"), "soak")
    ax, right = fig.axes
    size_line = ax.get_lines()[0]
    assert size_line.get_label() == "world size"
    assert list(size_line.get_ydata()) == [c[2] for c in commits]
    marks = [line for line in ax.get_lines()[1:]]
    assert [m.get_xdata()[0] for m in marks] == pytest.approx([3.8, 6.5])
    assert [m.get_label() for m in marks] == ["fault: kill", "fault: stop"]
    assert len(ax.patches) == 1   # the shaded pause
    assert right.get_lines()[0].get_label() == "committed steps"
    assert list(right.get_lines()[0].get_ydata()) == list(range(100))
    pixels = png(tmp_path / "t.png", (800, 300))
    assert has_colour(pixels, BLUE) and has_colour(pixels, RED) and has_colour(pixels, GREEN)


def test_the_core_never_imports_matplotlib_and_a_plot_without_it_says_how() -> None:
    code = ("import sys, plugdist, plugdist._tools.bench, plugdist._launcher\n"
            "assert 'matplotlib' not in sys.modules, 'the core imported matplotlib'\n"
            "sys.modules['matplotlib'] = None  # as if not installed\n"
            "sys.modules['matplotlib.figure'] = None\n"
            "sys.exit(plugdist._tools.bench.main(['--plot', 'x.png']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    assert "pip install 'plugdist[plots]'" in done.stderr
