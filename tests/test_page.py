"""plugdist-run --page, seen as a person sees it: a real 3-rank job, a real SIGKILL, and the page
rendered by a real headless Chromium (the DOM after the page's own script ran), plus the token
rule beyond loopback, checked with real HTTP requests from this process (a stranger to the job).

The browser is the system's Chromium (``make venv`` installs it with apt where it can); without
one the browser test skips, saying how to install it. Each run keeps a screenshot of the page
and prints its path; ``PLUGDIST_PAGE_SCREENSHOT=PATH`` also copies it there (docs/images/page.png is
made that way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "examples" / "resilient_train.py")
LAUNCHER = [sys.executable, "-m", "plugdist_run"]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = ("no Chromium found: install it to run the page's browser test (Debian/Ubuntu: "
                "apt-get install -y chromium; make venv does this when run as root with apt)")


def chromium() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(INSTALL_HINT)


def render(url: str, tmp: Path, *, screenshot: Path | None = None) -> str:
    """The page's DOM after its script ran for a few (virtual) seconds, from a headless
    Chromium; with ``screenshot``, a PNG of it too."""
    base = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--hide-scrollbars", f"--user-data-dir={tmp / 'chromium'}",
            "--virtual-time-budget=3000"]
    if screenshot is not None:
        subprocess.run([*base, "--window-size=1400,1000", f"--screenshot={screenshot}", url],
                       capture_output=True, timeout=120, check=True)
    done = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout


class Job:
    """A plugdist-run launch with its page on; stderr is read as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([*LAUNCHER, *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PLUGDIST_TORCH_WORLD="0", **env))
        self.lines: list[str] = []
        assert self.proc.stderr is not None
        stream = self.proc.stderr
        self._reader = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self._reader.start()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def url(self, deadline: float = 120) -> str:
        """The address the run's first lines give."""
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            found = re.search(r"live page at (http://\S+/)", self.stderr)
            if found:
                return found.group(1)
            assert self.proc.poll() is None, f"plugdist-run ended:\n{self.stderr[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"no page address within {deadline}s:\n{self.stderr[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait_state(url: str, check: Any, what: str, deadline: float, job: Job) -> dict[str, Any]:
    """Poll the page's JSON until ``check(state)`` holds; fail naming ``what`` at the deadline."""
    end = time.monotonic() + deadline
    state: dict[str, Any] = {}
    while time.monotonic() < end:
        code, body = get(url + "api/state")
        if code == 200:
            state = json.loads(body)
            if state and check(state):
                return state
        time.sleep(0.3)
    raise AssertionError(f"{what}: not seen within {deadline}s; last state "
                         f"{json.dumps(state)[-2000:]}\nlauncher:\n{job.stderr[-3000:]}")


@pytest.mark.resilience
@pytest.mark.timeout(300)
def test_the_page_shows_a_killed_rank_and_the_shrink_in_a_browser(tmp_path: Path) -> None:
    chromium()   # skip before starting anything when there is no browser
    stop = tmp_path / "stop"
    job = Job(["--nproc-per-node", "3", "--monitor-interval", "0.05", "--page", "0",
               "--page-linger", "60", TRAIN, "--steps", "1000000", "--hidden", "32",
               "--step-time", "0.05", "--stop-file", str(stop)],
              {"PLUGDIST_RESILIENCE": "1", "TORCH_FR_BUFFER_SIZE": "64"})
    try:
        url = job.url()
        assert url.startswith("http://127.0.0.1:"), url   # loopback by default

        def training(s: dict[str, Any]) -> bool:
            return len(s["members"]) == 3 and all(
                m["state"] == "running" and (m["step"] or 0) >= 3 for m in s["members"])
        before = wait_state(url, training, "3 ranks training", 180, job)
        assert before["world"] == {"epoch": 0, "size": 3, "members": ["0", "1", "2"]}

        # each rank hands the page its recent collectives on request
        code, body = get(url + "api/ops?ask=1")
        asked = json.loads(body)["request"]
        end = time.monotonic() + 30
        while time.monotonic() < end:
            ops = json.loads(get(url + "api/ops")[1])
            if len(ops["ranks"]) == 3 and all(r["request"] >= asked for r in ops["ranks"]):
                break
            time.sleep(0.3)
        assert [r["rank"] for r in ops["ranks"]] == [0, 1, 2], ops
        assert all(r["recording"] and r["ops"] for r in ops["ranks"]), ops
        assert all(o["op"] == "all_reduce" for r in ops["ranks"] for o in r["ops"]), ops

        victim = next(m for m in before["members"] if m["uid"] == "1")
        os.kill(victim["pid"], signal.SIGKILL)

        def dead(s: dict[str, Any]) -> bool:
            return any(m["uid"] == "1" and m["state"] == "dead" for m in s["members"])
        # a look reads the death log before the epochs: when the death and the shrink land
        # between those two reads, one snapshot shows the shrink without the death
        after = wait_state(url, lambda s: s["world"]["size"] == 2 and dead(s) and any(
            e["kind"] == "shrink" for e in s["history"]), "the shrink to 2, member 1 dead", 120,
            job)
        assert after["world"]["members"] == ["0", "2"]
        # the pause: known once the survivors committed their first step of the new epoch
        wait_state(url, lambda s: any(e["kind"] == "shrink" and e["pause_s"] is not None
                                      for e in s["history"]), "the shrink's pause", 60, job)

        # the page as a browser renders it (the DOM after the page's script ran)
        shot = tmp_path / "page.png"
        dom = render(url + "#ops", tmp_path, screenshot=shot)
        print(f"\nscreenshot of the live page: {shot}")
        copy = os.environ.get("PLUGDIST_PAGE_SCREENSHOT")
        if copy:
            shutil.copyfile(shot, copy)
        assert re.search(r'id="world-size"[^>]*>2<', dom), dom[:3000]
        assert re.search(r'id="epoch"[^>]*>1<', dom)
        assert re.search(r'data-kind="death"[^>]*>[^<]*rank 1 \(member 1\) died', dom), dom
        assert re.search(r'data-kind="exit"[^>]*>[^<]*rank 1 \(pid \d+\)[^<]*SIGKILL', dom)
        assert re.search(r'data-kind="shrink"[^>]*>[^<]*from 3 to 2 \(without 1\)'
                         r'; training paused [0-9.]+s', dom), dom
        assert re.search(r'data-state="dead" data-uid="1"', dom)
        assert len(re.findall(r'data-state="running"', dom)) == 2
        assert re.search(r'<th>rank 0 \(0, running\)</th>', dom)   # the ops, side by side
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

        # the end: the run stops cleanly and the page shows its end state
        stop.touch()
        ended = wait_state(url, lambda s: s["state"] == "ended", "the end state", 120, job)
        assert ended["exit_code"] == 0 and ended["history"][-1]["kind"] == "end"
        dom = render(url, tmp_path)
        assert re.search(r'id="state"[^>]*>succeeded<', dom)
        assert "The run has ended (exit code 0)" in dom
    finally:
        job.close()


@pytest.mark.resilience
@pytest.mark.timeout(300)
def test_the_page_shows_a_replacement_join_and_the_world_grow_back(tmp_path: Path) -> None:
    """--replace-failed: the killed rank's replacement asks to join and the world grows back
    to 3; the rendered page shows the join, the grow and the new member running."""
    chromium()
    stop = tmp_path / "stop"
    job = Job(["--nproc-per-node", "3", "--monitor-interval", "0.05", "--page", "0",
               "--replace-failed", "--max-restarts", "1", TRAIN, "--steps", "1000000",
               "--hidden", "32", "--step-time", "0.05", "--stop-file", str(stop)],
              {"PLUGDIST_RESILIENCE": "1"})
    try:
        url = job.url()
        before = wait_state(url, lambda s: len(s["members"]) == 3 and all(
            (m["step"] or 0) >= 3 for m in s["members"]), "3 ranks training", 180, job)
        os.kill(next(m["pid"] for m in before["members"] if m["uid"] == "2"), signal.SIGKILL)
        grown = wait_state(url, lambda s: s["world"]["size"] == 3 and s["world"]["epoch"] >= 2,
                           "the world grown back to 3", 240, job)
        kinds = [e["kind"] for e in grown["history"]]
        assert "death" in kinds and "join" in kinds, grown["history"]
        assert kinds.index("shrink") < kinds.index("grow"), grown["history"]
        assert grown["world"]["members"] == ["0", "1", "j1"]
        dom = render(url, tmp_path)
        assert re.search(r'id="world-size"[^>]*>3<', dom), dom[:3000]
        assert re.search(r'data-kind="grow"[^>]*>[^<]*from 2 to 3 \(with j1\)', dom), dom
        assert re.search(r'data-kind="join"[^>]*>[^<]*member id j1', dom)
        assert re.search(r'data-state="dead" data-uid="2"', dom)
        assert re.search(r'data-state="running" data-uid="j1"><td>2</td>', dom)
        stop.touch()
        assert job.proc.wait(timeout=120) == 0, job.stderr[-3000:]
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_beyond_loopback_every_request_needs_the_jobs_token(tmp_path: Path) -> None:
    secret = "page-test-" + os.urandom(8).hex()
    token_file = tmp_path / "token"
    token_file.write_text(secret)
    token_file.chmod(0o600)
    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(600)\n")
    job = Job(["--page", "0.0.0.0:0", str(script)],
              {"PLUGDIST_STORE_TOKEN_FILE": str(token_file)})
    try:
        url = job.url().replace("0.0.0.0", "127.0.0.1")
        assert secret not in job.stderr   # the address printed never holds the token
        for path in ("", "api/state", "api/ops"):
            code, body = get(url + path)
            assert code == 403 and b"token" in body, (path, code, body)
            assert get(url + path, {"X-Plugdist-Token": secret[:-1] + "x"})[0] == 403
            assert get(url + path, {"X-Plugdist-Token": secret})[0] == 200
        assert get(url + f"api/state?token={secret}")[0] == 200
        assert get(url + "api/state?token=wrong")[0] == 403
    finally:
        job.close()
    assert secret not in job.stderr


@pytest.mark.timeout(60)
def test_a_page_beyond_loopback_without_a_token_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "nothing.py"
    script.write_text("")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PLUGDIST_STORE_TOKEN", "PLUGDIST_STORE_TOKEN_FILE")}
    done = subprocess.run([*LAUNCHER, "--page", "0.0.0.0:0", str(script)], capture_output=True,
                          text=True, timeout=50, env=env)
    assert done.returncode == 1
    assert "needs the job's store token" in done.stderr and "SSH tunnel" in done.stderr, \
        done.stderr


def test_page_addresses() -> None:
    from plugdist._launcher.page import parse_address
    assert parse_address("8265") == ("127.0.0.1", 8265)
    assert parse_address("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    with pytest.raises(ValueError, match="expected PORT or HOST:PORT"):
        parse_address("host:port")
