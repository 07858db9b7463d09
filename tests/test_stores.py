"""One store test suite, run against every store: HashStore, FileStore, TCPStore, PrefixStore over
a TCPStore. Then cross-process checks (real worker processes) for the stores processes share."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_workers import result, spawn, wait_ready  # noqa: E402
from plugdist.errors import DistError, DistStoreError, DistTimeoutError
from plugdist.store import FileStore, HashStore, PrefixStore, Store, TCPStore

KINDS = ["hash", "file", "tcp", "prefix_tcp"]
SHORT = timedelta(seconds=0.2)


class Handle:
    """A store under test plus a way to open another handle on the same data (another client,
    another FileStore on the same path), as a second process would."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind = kind
        self.opened: list[Store] = []
        self.path = str(tmp_path / "store.log")
        if kind == "hash":
            self.store: Store = HashStore(timeout=timedelta(seconds=10))
        elif kind == "file":
            self.store = self._keep(FileStore(self.path, -1, timeout=timedelta(seconds=10)))
        else:
            self.master = self._keep(TCPStore("127.0.0.1", 0, is_master=True,
                                              timeout=timedelta(seconds=10)))
            self.store = self.master if kind == "tcp" else PrefixStore("ns", self.master)

    def _keep(self, s: Store) -> Store:
        self.opened.append(s)
        return s

    def peer(self) -> Store:
        if self.kind == "hash":
            return self.store
        if self.kind == "file":
            return self._keep(FileStore(self.path, -1, timeout=timedelta(seconds=10)))
        client = self._keep(TCPStore("127.0.0.1", self.master.port,
                                     timeout=timedelta(seconds=10)))
        return client if self.kind == "tcp" else PrefixStore("ns", client)

    def close(self) -> None:
        for s in reversed(self.opened):
            s.close()


@pytest.fixture(params=KINDS)
def h(request, tmp_path) -> Iterator[Handle]:
    handle = Handle(request.param, tmp_path)
    yield handle
    handle.close()


def later(delay: float, fn: Callable[[], object]) -> threading.Thread:
    t = threading.Timer(delay, fn)
    t.start()
    return t


# ---- each method's semantics -----------------------------------------------------------------

@pytest.mark.timeout(20)
def test_set_get_values(h: Handle) -> None:
    s, other = h.store, h.peer()
    s.set("str", "first_value")
    s.set("bytes", b"\x00\xffbinary\x00")
    s.set("empty", b"")
    s.set("unicode-κλειδί", "värde ✓")
    assert other.get("str") == b"first_value"
    assert other.get("bytes") == b"\x00\xffbinary\x00"
    assert other.get("empty") == b""
    assert other.get("unicode-κλειδί") == "värde ✓".encode()
    s.set("str", "second")  # overwrite
    assert other.get("str") == b"second"
    big = os.urandom(3 * 1024 * 1024 + 17)
    other.set("big", big)
    assert s.get("big") == big
    assert isinstance(s.get("str"), bytes)


@pytest.mark.timeout(20)
def test_get_missing_times_out_naming_key(h: Handle) -> None:
    s = h.store
    s.set_timeout(SHORT)
    assert s.timeout == SHORT
    with pytest.raises(DistTimeoutError, match="no_such_key") as info:
        s.get("no_such_key")
    assert isinstance(info.value, DistStoreError) and isinstance(info.value, DistError)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.timeout(20)
def test_get_blocks_until_set_by_another_handle(h: Handle) -> None:
    s, other = h.store, h.peer()
    t = later(0.3, lambda: other.set("late", "arrived"))
    assert s.get("late") == b"arrived"
    t.join()


@pytest.mark.timeout(20)
def test_add(h: Handle) -> None:
    s, other = h.store, h.peer()
    assert s.add("counter", 1) == 1
    assert other.add("counter", 6) == 7
    assert s.add("counter", -10) == -3
    assert s.add("counter", 0) == -3
    assert s.get("counter") == b"-3"
    assert s.add("fresh", 5) == 5  # the first add creates the counter at the amount
    s.set("int_text", "41")  # a set() value that parses as an integer is a counter too
    assert s.add("int_text", 1) == 42
    assert s.add("big", 2**62) == 2**62


@pytest.mark.timeout(20)
def test_add_on_a_set_value_raises(h: Handle) -> None:
    s = h.store
    s.set("written", "first_value")
    with pytest.raises(DistStoreError, match="written.*not an integer"):
        s.add("written", 1)
    assert s.get("written") == b"first_value"  # untouched
    assert s.add("other", 2) == 2  # the store still works afterwards


@pytest.mark.timeout(20)
def test_bad_argument_types(h: Handle) -> None:
    s = h.store
    with pytest.raises(TypeError, match="int"):
        s.add("k", "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        s.add("k", True)
    with pytest.raises(TypeError, match="keys must be str"):
        s.set(1, "v")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes or str"):
        s.set("k", 12)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single string"):
        s.wait("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single string"):
        s.check("abc")  # type: ignore[arg-type]
    assert not s.check(["k"])  # nothing was written by the rejected calls


@pytest.mark.timeout(20)
def test_compare_set(h: Handle) -> None:
    s = h.store
    s.set("key", "first_value")
    assert s.compare_set("key", "first_value", "second_value") == b"second_value"
    assert s.get("key") == b"second_value"
    # wrong expectation: nothing changes, the current value comes back
    assert s.compare_set("key", "first_value", "third") == b"second_value"
    assert s.get("key") == b"second_value"
    # missing key + empty expectation: created
    assert s.compare_set("new", "", b"made") == b"made"
    assert s.get("new") == b"made"
    # missing key + non-empty expectation: stays missing, the expectation comes back
    assert s.compare_set("absent", "guess", "x") == b"guess"
    assert not s.check(["absent"])


@pytest.mark.timeout(20)
def test_wait_and_check(h: Handle) -> None:
    s, other = h.store, h.peer()
    assert s.check([])
    s.wait([])
    s.set("a", "1")
    s.wait(["a"])
    s.wait(["a"], timedelta(seconds=1))
    assert s.check(["a"])
    assert not s.check(["a", "b"])
    with pytest.raises(DistTimeoutError) as info:
        s.wait(["a", "missing_1", "missing_2"], SHORT)
    msg = str(info.value)
    assert "missing_1" in msg and "missing_2" in msg and "'a'" not in msg
    s.set_timeout(SHORT)  # the default timeout of wait()
    with pytest.raises(DistTimeoutError, match="missing_3"):
        s.wait(["missing_3"])
    s.set_timeout(timedelta(seconds=10))
    t = later(0.2, lambda: other.multi_set(["b", "c"], ["2", "3"]))
    s.wait(["b", "c"])
    assert s.check(["a", "b", "c"])
    t.join()


@pytest.mark.timeout(20)
def test_num_keys_and_delete_key(h: Handle) -> None:
    s = h.store
    before = s.num_keys()
    s.set("first_key", "first_value")
    s.add("counter", 1)
    s.set("first_key", "again")  # overwriting is not a new key
    assert s.num_keys() == before + 2
    if h.kind == "file":
        with pytest.raises(DistStoreError, match="delete_key is not supported by FileStore"):
            s.delete_key("first_key")
        assert s.get("first_key") == b"again"
        return
    assert s.delete_key("first_key") is True
    assert s.delete_key("first_key") is False
    assert s.delete_key("bad_key") is False
    assert s.num_keys() == before + 1
    assert not s.check(["first_key"])
    s.set_timeout(SHORT)
    with pytest.raises(DistTimeoutError, match="first_key"):
        s.get("first_key")
    assert s.add("counter", 1) == 2


@pytest.mark.timeout(20)
def test_multi_set_multi_get(h: Handle) -> None:
    s, other = h.store, h.peer()
    s.multi_set(["x", "y", "z"], ["1", b"2", ""])
    assert other.multi_get(["z", "x", "y"]) == [b"", b"1", b"2"]
    assert other.multi_get([]) == []
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        s.multi_set(["p", "q"], ["only one"])
    t = later(0.2, lambda: other.set("w2", "late"))
    assert s.multi_get(["x", "w2"]) == [b"1", b"late"]
    t.join()
    s.set_timeout(SHORT)
    with pytest.raises(DistTimeoutError, match="never"):
        s.multi_get(["x", "never"])


@pytest.mark.timeout(30)
def test_threads_share_one_store(h: Handle) -> None:
    s = h.store
    per_thread, nthreads = 100, 6
    seen: list[int] = []
    lock = threading.Lock()

    def bump() -> None:
        got = [s.add("shared", 1) for _ in range(per_thread)]
        with lock:
            seen.extend(got)

    # one thread parks in a blocking get on the same object while the others keep writing
    waiter_result: list[bytes] = []
    waiter = threading.Thread(target=lambda: waiter_result.append(s.get("released")))
    waiter.start()
    threads = [threading.Thread(target=bump) for _ in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.set("released", "yes")
    waiter.join()
    assert sorted(seen) == list(range(1, per_thread * nthreads + 1))  # every add was atomic
    assert s.get("shared") == str(per_thread * nthreads).encode()
    assert waiter_result == [b"yes"]


@pytest.mark.timeout(20)
def test_timeout_zero_checks_once(h: Handle) -> None:
    s = h.store
    s.set("here", "1")
    s.wait(["here"], timedelta(0))
    with pytest.raises(DistTimeoutError, match="gone"):
        s.wait(["gone"], timedelta(0))


# ---- PrefixStore specifics --------------------------------------------------------------------

@pytest.mark.timeout(20)
def test_prefix_store_namespaces() -> None:
    inner = HashStore(timeout=timedelta(seconds=5))
    a, b = PrefixStore("a", inner), PrefixStore("b", inner)
    a.set("k", "from a")
    b.set("k", "from b")
    assert a.get("k") == b"from a" and b.get("k") == b"from b"
    assert inner.get("a/k") == b"from a"
    assert a.add("n", 2) == 2 and b.add("n", 5) == 5
    assert a.check(["k", "n"]) and not a.check(["only_b"])
    b.set("only_b", "x")
    assert not a.check(["only_b"])
    nested = PrefixStore("inner", a)
    nested.set("deep", "1")
    assert inner.get("a/inner/deep") == b"1"
    a.set_timeout(SHORT)  # shared with the inner store, as in torch
    assert inner.timeout == SHORT and b.timeout == SHORT
    with pytest.raises(DistTimeoutError, match="a/missing"):
        a.get("missing")
    assert a.delete_key("k") and b.get("k") == b"from b"
    with pytest.raises(TypeError):
        PrefixStore(3, inner)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PrefixStore("p", {})  # type: ignore[arg-type]


# ---- FileStore specifics ----------------------------------------------------------------------

@pytest.mark.timeout(20)
def test_file_store_cleanup_after_last_user(tmp_path) -> None:
    path = str(tmp_path / "fs")
    s1, s2 = FileStore(path, 2), FileStore(path, 2)
    s1.set("first_key", "first_value")
    assert s2.get("first_key") == b"first_value"
    s1.close()
    s1.close()  # idempotent
    assert os.path.exists(path)  # s2 still uses it
    with pytest.raises(DistStoreError, match="closed"):
        s1.get("first_key")
    assert s2.get("first_key") == b"first_value"
    s2.close()
    assert not os.path.exists(path)

    # unknown world size: the file stays, and a later store sees the old keys
    keep = str(tmp_path / "keep")
    s3 = FileStore(keep)
    s3.set("survives", "1")
    s3.close()
    assert os.path.exists(keep)
    s4 = FileStore(keep)
    assert s4.get("survives") == b"1"
    s4.close()


@pytest.mark.timeout(20)
def test_file_store_cleanup_on_garbage_collection(tmp_path) -> None:
    import gc
    path = str(tmp_path / "gc")
    s = FileStore(path, 1)
    s.set("k", "v")
    del s
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.timeout(20)
def test_file_store_bad_arguments(tmp_path) -> None:
    with pytest.raises(DistStoreError, match="cannot open"):
        FileStore(str(tmp_path / "no" / "such" / "dir" / "f"))
    with pytest.raises(ValueError, match="world_size"):
        FileStore(str(tmp_path / "f"), 0)


# ---- across processes -------------------------------------------------------------------------

XKINDS = ["tcp", "file", "prefix_tcp"]


@pytest.fixture(params=XKINDS)
def shared(request, tmp_path) -> Iterator[tuple[Store, dict]]:
    """A store in this process and the JSON spec a worker process uses to open the same one."""
    kind = request.param
    if kind == "file":
        path = str(tmp_path / "xproc.log")
        s: Store = FileStore(path, -1, timeout=timedelta(seconds=30))
        spec: dict = {"kind": "file", "path": path}
        closers = [s]
    else:
        master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
        spec = {"kind": "tcp", "host": "127.0.0.1", "port": master.port}
        s = master
        closers = [master]
        if kind == "prefix_tcp":
            s = PrefixStore("job", master)
            spec = {"prefix": "job", "inner": spec}
    yield s, spec
    for c in closers:
        c.close()


@pytest.mark.timeout(60)
def test_cross_process_get_add_compare_set(shared: tuple[Store, dict]) -> None:
    s, spec = shared
    # a blocking get in another process is released by our set
    getter = spawn("get", spec=spec, key="late_key")
    wait_ready(getter)
    time.sleep(0.2)  # let it reach the blocking get; the result does not depend on this
    s.set("late_key", "from the parent")
    got = result(getter)
    assert got == {"present_before": False, "value": "from the parent"}

    # 8 processes x 50 adds: the sum is right and every intermediate value was seen exactly once
    nproc, times = 8, 50
    adders = [spawn("add", spec=spec, key="sum", times=times, go="go_add") for _ in range(nproc)]
    for p in adders:
        wait_ready(p)
    s.set("go_add", "1")
    seen = [v for p in adders for v in result(p)]
    assert sorted(seen) == list(range(1, nproc * times + 1))
    assert s.get("sum") == str(nproc * times).encode()

    # compare_set race: exactly one process claims the key, every process sees the winner
    racers = [spawn("compare_set", spec=spec, key="leader", mine=f"rank{i}", go="go_cas")
              for i in range(6)]
    for p in racers:
        wait_ready(p)
    s.set("go_cas", "1")
    answers = [result(p) for p in racers]
    winner = s.get("leader").decode()
    assert winner in {f"rank{i}" for i in range(6)}
    assert answers == [winner] * 6
    assert sum(1 for i, a in enumerate(answers) if a == f"rank{i}") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_cross_process_prefix_isolation(kind: str, tmp_path) -> None:
    if kind == "tcp":
        base: Store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
        inner = {"kind": "tcp", "host": "127.0.0.1", "port": base.port}
    else:
        path = str(tmp_path / "prefix.log")
        base = FileStore(path, -1, timeout=timedelta(seconds=30))
        inner = {"kind": "file", "path": path}
    try:
        procs = [spawn("prefix", spec={"prefix": name, "inner": inner}, key="k", value=name,
                       go="go") for name in ("alpha", "beta", "gamma")]
        for p in procs:
            wait_ready(p)
        names = ("alpha", "beta", "gamma")
        base.multi_set([f"{n}/go" for n in names], ["1"] * 3)  # each waits in its namespace
        outs = [result(p) for p in procs]
        assert [o["own"] for o in outs] == ["alpha", "beta", "gamma"]
        assert [base.get(f"{n}/k") for n in ("alpha", "beta", "gamma")] == [
            b"alpha", b"beta", b"gamma"]
        assert not base.check(["k"])  # nobody wrote outside a namespace
        assert all(o["num_keys"] >= 6 for o in outs)  # num_keys counts every namespace
    finally:
        base.close()
