"""Liveness at scale: TCPStore wills with a ttl (a stopped holder is declared dead, a renewed one
never, even while the server does not read its connection), the death log read in bursts by
one parked request, a will withdrawn while its holder's wait is parked, and
``benchmarks/scale_sim.py`` at a small size so it cannot rot. Real processes, real sockets,
real SIGSTOP/SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from plugdist.errors import DistNetworkError, DistTimeoutError
from plugdist.store import TCPStore

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]

_HOLDER = """
import sys, time
from plugdist.store import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), None, False)
will = store.hold_will("deaths", sys.argv[2], ttl=float(sys.argv[3]))
print("holding", flush=True)
time.sleep(120)
"""


def _holder(port: int, name: str, ttl: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(port), name, str(ttl)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    return proc


@pytest.fixture()
def master():  # type: ignore[no-untyped-def]
    store = TCPStore(HOST, 0, None, is_master=True, timeout=timedelta(seconds=30))
    yield store
    store.close()


@pytest.mark.timeout(120)
def test_a_stopped_holder_is_declared_dead_after_its_ttl_and_a_renewed_one_never(
        master: TCPStore) -> None:
    ttl = 1.0
    renewed = _holder(master.port, "renewed", ttl)
    stopped = _holder(master.port, "stopped", ttl)
    try:
        time.sleep(3 * ttl)  # several ttls: both renew, nothing lapses
        assert not master.check(["deaths/1"]), master.read_log("deaths", 1, timedelta(0))
        os.kill(stopped.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        entries = master.read_log("deaths", 1, timedelta(seconds=30))
        took = time.monotonic() - t0
        assert entries == [b"stopped"], entries
        # declared within a ttl of its last renewal (renewals come every quarter ttl)
        assert 0.5 * ttl <= took < ttl + 5.0, took
        time.sleep(2 * ttl)  # the renewed holder is still alive and counted once
        assert master.add("deaths", 0) == 1
    finally:
        for proc in (renewed, stopped):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


_PAUSED_HOLDER = """
import struct, sys, time
from plugdist.store import TCPStore
from plugdist.store import _wire as w
store = TCPStore("127.0.0.1", int(sys.argv[1]), None, False)
will = store.hold_will("deaths", "paused", ttl=float(sys.argv[2]))
# on the will's own connection, 32 gets of a 1 MiB value whose replies are never read: the
# server stops reading the connection, and the renewals queue behind them
get = w.request(w.Op.GET, struct.pack("!dI", 0.0, 3) + b"big")
will._conn.send_control(get * 32)
print("holding", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_a_will_renewed_on_a_connection_the_server_is_not_reading_does_not_lapse(
        master: TCPStore) -> None:
    """A ttl counts the holder's renewals, not the server's backlog: renewals that reached
    the server while it did not read the connection (here paused: its replies lie unread; at
    scale, resting after a heavy request) keep the will; once the holder stops, it lapses."""
    ttl = 2.0
    master.set("big", b"x" * (1 << 20))
    holder = subprocess.Popen([sys.executable, "-c", _PAUSED_HOLDER, str(master.port),
                               str(ttl)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        server = master._server
        assert server is not None

        def paused() -> bool:
            return any(c.paused and c.will for c in list(server._conns.values()))

        deadline = time.monotonic() + 30
        while not paused() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert paused(), "the will's connection was never paused"
        time.sleep(3 * ttl)  # several ttls, the connection unread throughout
        assert paused()
        assert master.add("deaths", 0) == 0, master.read_log("deaths", 1, timedelta(0))
        os.kill(holder.pid, signal.SIGSTOP)  # it stops renewing: the will runs
        assert master.read_log("deaths", 1, timedelta(seconds=30)) == [b"paused"]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


@pytest.mark.timeout(60)
def test_read_log_answers_a_burst_and_a_will_cancelled_while_its_wait_is_parked_never_runs(
        master: TCPStore) -> None:
    victims = [_holder(master.port, f"v{i}", 30.0) for i in range(3)]
    for proc in victims:  # killed together: one wake carries every entry written by then
        os.kill(proc.pid, signal.SIGKILL)
    for proc in victims:
        proc.wait()
    deadline = time.monotonic() + 30
    seen: list[bytes] = []
    while len(seen) < 3 and time.monotonic() < deadline:
        seen += master.read_log("deaths", len(seen) + 1, timedelta(seconds=30))
    assert sorted(seen) == [b"v0", b"v1", b"v2"], seen

    will = master.hold_will("deaths", "polite", ttl=5.0)
    outcome: list[BaseException] = []

    def wait_on_the_log() -> None:
        try:
            will.read_log(4, timedelta(seconds=30))
        except BaseException as e:  # noqa: BLE001 - examined below
            outcome.append(e)

    reader = threading.Thread(target=wait_on_the_log)
    reader.start()
    time.sleep(0.3)  # parked on the server
    t0 = time.monotonic()
    will.cancel()
    reader.join(10)
    assert not reader.is_alive() and time.monotonic() - t0 < 5.0
    assert isinstance(outcome[0], DistNetworkError), outcome
    time.sleep(0.5)
    assert master.add("deaths", 0) == 3, "a cancelled will must not run"
    with pytest.raises(DistTimeoutError, match="missing keys"):
        master.read_log("deaths", 4, timedelta(seconds=0.2))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("monitor", ["loop", "threads"])
def test_scale_sim_runs_a_small_world(monitor: str) -> None:
    """scale_sim end to end at 128 members, with the members' death-log reads on one loop per
    process and on Will.read_log threads: every survivor learns of the killed node and of the
    shrink's decision. The loop run also meets on torch's TCPStore, side by side."""
    side_by_side = "--torch" if monitor == "loop" else "--no-torch"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scale_sim.py"), "--members", "128",
         "--steady", "1", side_by_side, "--json", "--timeout", "60", "--monitor", monitor],
        capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert "errors" not in row, row
    assert row["rendezvous_done"] == 128, row
    assert row["death_known_by"] == 120 and row["shrink_decided_by"] == 120, row
    assert row["death_known_s_p99"] < 30 and row["shrink_s_max"] < 30, row
    assert 0 <= row["steady_server_cpu_pct"] < 100, row
    if side_by_side == "--torch":
        assert row["torch_rendezvous_done"] == 128 and "torch_errors" not in row, row

