"""Worker processes for the store tests: ``python _store_workers.py TASK JSON_ARGS``.

Each worker opens real stores (TCP clients, FileStores) in its own process, prints ``READY`` when
it is about to do the thing under test, and ends with ``RESULT <json>`` on stdout. Workers load
``plugdist.store`` without running ``plugdist/__init__`` (which imports torch, ~1-2 s per process
on this machine): the store modules need only the standard library and structlog, so a worker
starts in ~0.1 s and a test can afford many of them.

The parent side (``spawn``, ``result``) is imported by the tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import types
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- parent side ---------------------------------------------------------------------------

def spawn(task: str, env: dict[str, str] | None = None, **args: Any) -> subprocess.Popen:
    """Start a worker running ``task`` with keyword ``args`` (JSON-serialisable); ``env`` is
    added to this process's environment for it."""
    return subprocess.Popen([sys.executable, os.path.join(HERE, "_store_workers.py"), task,
                             json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def wait_ready(proc: subprocess.Popen) -> None:
    """Block until the worker printed READY (raises with its stderr if it died first)."""
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if line.strip() != "READY":
        rest = proc.stdout.read()  # type: ignore[union-attr]
        raise RuntimeError(f"worker did not get ready: {line!r}{rest!r}\n{proc.stderr.read()}")


def result(proc: subprocess.Popen, timeout: float = 60) -> Any:
    """The worker's RESULT value; raises with its stderr if it failed."""
    out, err = proc.communicate(timeout=timeout)
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker exited {proc.returncode} without a result\nstdout: {out}\n"
                       f"stderr: {err}")


# ---- worker side ---------------------------------------------------------------------------

def _load_store_package() -> types.ModuleType:
    spec = importlib.util.find_spec("plugdist")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("plugdist is not installed in this interpreter")
    pkg = types.ModuleType("plugdist")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules["plugdist"] = pkg
    from plugdist import store
    return store


def _open(spec: dict) -> Any:
    """A store from a JSON description: {"kind": "tcp"|"file"|"url", ...} or {"prefix",
    "inner"}."""
    store = _load_store_package()
    if "prefix" in spec:
        return store.PrefixStore(spec["prefix"], _open(spec["inner"]))
    timeout = timedelta(seconds=spec.get("timeout", 30))
    if spec["kind"] == "tcp":
        return store.TCPStore(spec["host"], spec["port"], world_size=spec.get("world_size"),
                              is_master=False, timeout=timeout, token=spec.get("token"))
    if spec["kind"] == "file":
        return store.FileStore(spec["path"], spec.get("world_size", -1), timeout=timeout)
    if spec["kind"] == "url":  # any installed store scheme, through the plugdist.stores group
        # plugdist.open_store, without the torch that importing plugdist itself costs
        return importlib.import_module("plugdist._open_store").open_store(spec["url"], timeout)
    raise ValueError(f"unknown store kind {spec['kind']!r}")


def _ready() -> None:
    print("READY", flush=True)


def task_get(spec: dict, key: str) -> Any:
    """Report whether ``key`` existed, then block in get(key) until another process sets it."""
    s = _open(spec)
    present = s.check([key])
    _ready()
    return {"present_before": present, "value": s.get(key).decode()}


def task_add(spec: dict, key: str, times: int, go: str) -> Any:
    """Wait for ``go`` (so every worker starts together), then add 1 ``times`` times."""
    s = _open(spec)
    _ready()
    s.wait([go])
    return [s.add(key, 1) for _ in range(times)]


def task_compare_set(spec: dict, key: str, mine: str, go: str) -> Any:
    """Wait for ``go``, then try to claim ``key`` with compare_set(key, "", mine)."""
    s = _open(spec)
    _ready()
    s.wait([go])
    return s.compare_set(key, "", mine).decode()


def task_prefix(spec: dict, key: str, value: str, go: str) -> Any:
    """Set ``key`` in this worker's namespace, wait for ``go``, read it back and check others."""
    s = _open(spec)
    s.set(key, value)
    _ready()
    s.wait([go])
    return {"own": s.get(key).decode(), "num_keys": s.num_keys()}


def task_rendezvous(spec: dict, clients: int, total: int) -> Any:
    """Open ``clients`` stores from as many threads at once; each: connect, add 1 to "count",
    the one that brings it to ``total`` sets "done", and every one waits for "done"."""
    _load_store_package()
    results: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def one() -> None:
        try:
            start.wait()
            s = _open(spec)
            n = s.add("count", 1)
            if n == total:
                s.set("done", "1")
            s.wait(["done"])
            with lock:
                results.append(n)
            s.close()
        except Exception as e:  # reported to the parent, which fails the test
            with lock:
                errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    _ready()
    for t in threads:
        t.join()
    return {"counts": results, "errors": errors}


def task_queue_worker(spec: dict) -> Any:
    """Pop from queue "requests" until a "stop" arrives; answer each on queue "replies"."""
    s = _open(spec)
    _ready()
    taken = []
    while (item := s.queue_pop("requests").decode()) != "stop":
        taken.append(item)
        s.queue_push("replies", item + "!")
    return taken


def task_file_user(path: str, world_size: int) -> Any:
    """A second process on one FileStore: write, wait for "go", write again, wait for "done",
    close; report whether the file was still there after it closed."""
    s = _open({"kind": "file", "path": path, "world_size": world_size})
    s.set("from_worker_before", "1")
    _ready()
    s.wait(["go"])
    s.set("from_worker_after", "2")
    s.wait(["done"])
    s.close()
    return {"exists_after_close": os.path.exists(path)}


def task_busy_clients(spec: dict, clients: int, stop_key: str) -> Any:
    """``clients`` threads, one store each, write and read back their own keys and bump a shared
    counter, round after round, until ``stop_key`` appears (then one more round). Reports each
    client's rounds and every error or wrong value seen."""
    _load_store_package()
    lock = threading.Lock()
    rounds: dict[str, int] = {}
    errors: list[str] = []
    pid = os.getpid()

    def one(i: int) -> None:
        name = f"{pid}-{i}"
        try:
            s = _open(spec)
            n, stop = 0, False
            while not stop:
                stop = s.check([stop_key])
                value = f"{name}:{n}"
                s.set(f"client/{name}/{n}", value)
                s.add("total", 1)
                if s.get(f"client/{name}/{n}").decode() != value:
                    raise AssertionError(f"read back something else than {value}")
                n += 1
                time.sleep(0.01)
            with lock:
                rounds[name] = n
            s.close()
        except Exception as e:  # reported to the parent, which fails the test
            with lock:
                errors.append(f"{name}: {e!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    _ready()
    for t in threads:
        t.join()
    return {"rounds": rounds, "errors": errors}


def task_churn(spec: dict, me: int, go: str, stop: str) -> Any:
    """add + set in a loop until ``stop`` exists (for failover tests): every add's result, the
    number of sets, the longest op and when it started, and any error."""
    s = _open(spec)
    adds: list[int] = []
    sets, longest, longest_at, errors = 0, 0.0, 0.0, []
    _ready()
    s.get(go)
    while True:
        t0 = time.time()
        try:
            adds.append(s.add("counter", 1))
            s.set(f"w{me}/{sets}", str(adds[-1]))
            sets += 1
            if sets % 10 == 0 and s.check([stop]):
                break
        except Exception as err:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(err).__name__}: {err}")
            if len(errors) > 3:
                break
        took = time.time() - t0
        if took > longest:
            longest, longest_at = took, t0
    return {"adds": adds, "sets": sets, "longest": longest, "longest_at": longest_at,
            "errors": errors}


def main() -> None:
    task, raw = sys.argv[1], sys.argv[2]
    fn = globals()[f"task_{task}"]
    value = fn(**json.loads(raw))
    print("RESULT " + json.dumps(value), flush=True)


if __name__ == "__main__":
    main()
