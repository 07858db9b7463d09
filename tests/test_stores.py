"""One store test suite, run against every store: HashStore, FileStore, TCPStore, PrefixStore over
a TCPStore, and plugdist-etcd's EtcdStore on a real etcd member (skipped without the plugin).
Then cross-process checks (real worker processes) for the stores processes share."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plugdist
from _store_workers import result, spawn, wait_ready  # noqa: E402
from plugdist.errors import DistError, DistStoreError, DistTimeoutError, QueueEmptyError
from plugdist.store import FileStore, HashStore, PrefixStore, Store, TCPStore

KINDS = ["hash", "file", "tcp", "prefix_tcp", "etcd"]
SHORT = timedelta(seconds=0.2)


class Handle:
    """A store under test plus a way to open another handle on the same data (another client,
    another FileStore on the same path), as a second process would."""

    def __init__(self, kind: str, tmp_path, request=None) -> None:
        self.kind = kind
        self.opened: list[Store] = []
        self.path = str(tmp_path / "store.log")
        if kind == "etcd":  # a real etcd member, shared by the session; a prefix per test
            self.url = request.getfixturevalue("etcd1").url(f"t/{os.urandom(6).hex()}")
            self.store = self._keep(plugdist.open_store(self.url, timedelta(seconds=10)))
        elif kind == "hash":
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
        if self.kind == "etcd":
            return self._keep(plugdist.open_store(self.url, timedelta(seconds=10)))
        client = self._keep(TCPStore("127.0.0.1", self.master.port,
                                     timeout=timedelta(seconds=10)))
        return client if self.kind == "tcp" else PrefixStore("ns", client)

    def close(self) -> None:
        for s in reversed(self.opened):
            s.close()


@pytest.fixture(params=KINDS)
def h(request, tmp_path) -> Iterator[Handle]:
    handle = Handle(request.param, tmp_path, request)
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
    for amount in (2**63, -(2**63) - 1):  # a counter is a signed 64-bit int, as torch's
        with pytest.raises(TypeError, match=r"64-bit signed int, from -9223372036854775808 "
                                            r"to 9223372036854775807"):
            s.add("k", amount)
    assert s.add("edge", 2**63 - 1) == 2**63 - 1 and s.add("edge", -(2**63 - 1)) == 0
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


@pytest.mark.timeout(30)
def test_wait_for_many_keys_set_one_by_one(h: Handle) -> None:
    """A wait on 40 keys (more than etcd's gateway creates watchers for on one stream) returns
    once another handle has set the last of them, one by one."""
    s, other = h.store, h.peer()
    keys = [f"many/{i}" for i in range(40)]

    def set_all() -> None:
        for k in reversed(keys):
            other.set(k, "x")
            time.sleep(0.01)
    t = later(0.2, set_all)
    s.wait(keys, timedelta(seconds=20))
    assert s.check(keys)
    t.join()


@pytest.mark.timeout(20)
def test_num_keys_and_delete_key(h: Handle) -> None:
    """delete_key on every store (FileStore included) returns whether the key existed; num_keys
    counts as torch does (torch: test_numkeys_delkeys, test_set_get_check)."""
    s = h.store
    before = s.num_keys()
    s.set("first_key", "first_value")
    s.add("counter", 1)
    s.set("first_key", "again")  # overwriting is not a new key
    assert s.num_keys() == before + 2
    assert s.delete_key("first_key") is True
    assert s.delete_key("first_key") is False
    assert s.delete_key("bad_key") is False
    assert s.num_keys() == before + 1
    assert not s.check(["first_key"])
    s.set_timeout(SHORT)
    with pytest.raises(DistTimeoutError, match="first_key"):
        s.get("first_key")
    assert s.add("counter", 1) == 2
    s.set("first_key", "back")  # a deleted key can be written again
    assert h.peer().get("first_key") == b"back"


@pytest.mark.timeout(20)
def test_num_keys_counts_like_torch(h: Handle) -> None:
    """torch counts one coordination entry in FileStore (its reference count) and in a TCPStore
    once a store with a fixed world size joined; HashStore counts only the user's keys."""
    s = h.store
    base = {"hash": 0, "file": 1, "tcp": 0, "prefix_tcp": 0, "etcd": 0}[h.kind]
    assert s.num_keys() == base
    for k in ("key", "key0", "key1", "key2", "key3"):
        s.set(k, "v")
    s.queue_push("a_queue", "not a key")  # queues are not counted
    assert s.num_keys() == base + 5
    if h.kind in ("tcp", "prefix_tcp"):
        sized = TCPStore("127.0.0.1", h.master.port, world_size=2,
                         timeout=timedelta(seconds=10))
        assert s.num_keys() == base + 6  # the worker counter now exists
        sized.close()


@pytest.mark.timeout(20)
def test_timeouts_say_timeout(h: Handle) -> None:
    """Every blocking call's timeout error is a DistTimeoutError (a DistStoreError) whose message
    says "timeout" and names what was missing (torch: test_simple_wait, test_queues_timeout)."""
    s = h.store
    s.set_timeout(SHORT)
    calls = [("get", "k_get", lambda: s.get("k_get")),
             ("wait", "k_wait", lambda: s.wait(["k_wait"], SHORT)),
             ("multi_get", "k_multi", lambda: s.multi_get(["k_multi"])),
             ("queue_pop", "k_queue", lambda: s.queue_pop("k_queue"))]
    for name, key, call in calls:
        with pytest.raises(DistTimeoutError, match=f"timeout.*{key}") as info:
            call()
        assert isinstance(info.value, DistStoreError), name
        assert f"{name} timeout" in str(info.value), str(info.value)
        # what torch's own tests match in a timeout's message
        assert re.search(" (Timed out|closed|timeout) ", str(info.value)), str(info.value)


@pytest.mark.timeout(20)
def test_append(h: Handle) -> None:
    s, other = h.store, h.peer()
    assert s.has_extended_api()
    s.set("foo", "po")
    s.append("foo", "tato")
    other.append("bar", b"po")  # a missing key is created
    other.append("bar", "tato")
    assert other.get("foo") == b"potato" and s.get("bar") == b"potato"
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(s.get("late_append")))
    t.start()
    time.sleep(0.1)
    other.append("late_append", "x")  # creating a key by append wakes a blocked get
    t.join(10)
    assert got == [b"x"]
    # concurrent appends from threads lose nothing
    threads = [threading.Thread(target=lambda i=i: [s.append("log", f"{i}") for _ in range(20)])
               for i in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    log = s.get("log").decode()
    assert sorted(log) == sorted("".join(str(i) * 20 for i in range(5)))


@pytest.mark.timeout(20)
def test_queues(h: Handle) -> None:
    """FIFO per key, beside the keys; check/wait see a non-empty queue (torch: test_queues)."""
    s, other = h.store, h.peer()
    assert not s.check(["q"]) and s.queue_len("q") == 0
    s.queue_push("q", "1")
    other.queue_push("q", b"2")
    assert s.check(["q"]) and other.queue_len("q") == 2
    s.wait(["q"])
    assert other.queue_pop("q") == b"1"
    assert s.queue_pop("q", block=False) == b"2"
    assert not s.check(["q"]) and s.queue_len("q") == 0
    with pytest.raises(QueueEmptyError, match="empty") as info:
        s.queue_pop("q", block=False)
    assert isinstance(info.value, DistStoreError)
    assert plugdist.QueueEmptyError is QueueEmptyError   # as torch's dist.QueueEmptyError
    # a queue and a value may share a key without touching each other
    s.set("both", "value")
    s.queue_push("both", "item")
    assert s.get("both") == b"value" and s.queue_len("both") == 1
    assert s.queue_pop("both") == b"item" and s.get("both") == b"value"
    # a blocked pop is released by a push from another handle; a blocked wait by the same push
    popped: list[bytes] = []
    t = threading.Thread(target=lambda: popped.append(s.queue_pop("later")))
    t.start()
    time.sleep(0.1)
    other.queue_push("later", "arrived")
    t.join(10)
    assert popped == [b"arrived"] and s.queue_len("later") == 0
    t = later(0.1, lambda: other.queue_push("waited", "x"))
    s.wait(["waited"], timedelta(seconds=10))
    t.join()
    assert s.delete_key("waited") and s.queue_len("waited") == 0


@pytest.mark.timeout(30)
def test_queue_values_go_to_exactly_one_popper(h: Handle) -> None:
    s = h.store
    n_items, n_poppers = 60, 4
    got: list[bytes] = []
    lock = threading.Lock()

    def pop_some() -> None:
        mine = s.clone() if h.kind != "hash" else s
        for _ in range(n_items // n_poppers):
            v = mine.queue_pop("work")
            with lock:
                got.append(v)

    poppers = [threading.Thread(target=pop_some) for _ in range(n_poppers)]
    for t in poppers:
        t.start()
    for i in range(n_items):
        h.peer().queue_push("work", str(i)) if i % 10 == 0 else s.queue_push("work", str(i))
    for t in poppers:
        t.join(20)
    assert sorted(int(v) for v in got) == list(range(n_items))


@pytest.mark.timeout(20)
def test_clone(h: Handle) -> None:
    """A clone is a Store on the same data, usable from another thread (torch: test_clone,
    test_queues_bidirectional)."""
    s = h.store
    c = s.clone()
    assert isinstance(c, Store) and type(c) is type(s)
    s.set("foo", "bar")
    assert c.get("foo") == b"bar"
    c.set("from_clone", "1")
    assert s.get("from_clone") == b"1"

    def side_a() -> bytes:
        mine = s.clone()
        mine.queue_push("a", "a1")
        return mine.queue_pop("b")

    def side_b() -> bytes:
        mine = s.clone()
        got = mine.queue_pop("a")
        mine.queue_push("b", "b1")
        return got

    with ThreadPoolExecutor(2) as pool:
        fa, fb = pool.submit(side_a), pool.submit(side_b)
        assert (fa.result(15), fb.result(15)) == (b"b1", b"a1")
    if h.kind in ("tcp", "prefix_tcp"):
        inner = c.underlying_store if isinstance(c, PrefixStore) else c
        assert isinstance(inner, TCPStore) and not inner.is_master
        inner.close()  # closing a clone never stops the server
        assert s.get("foo") == b"bar"
    if h.kind == "file":
        assert isinstance(c, FileStore)
        c.close()


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


# ---- the Store base class ----------------------------------------------------------------------

class DictStore(Store):
    """A partial store: only the four core calls torch's Python stores usually override."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}
        self.calls: list[tuple] = []

    def set(self, key: str, value: bytes | str) -> None:
        if type(value) is not bytes:
            raise AssertionError(f"set got {type(value).__name__}, not bytes")
        self.calls.append(("set", key, value))
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        n = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(n).encode()
        return n

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        if type(expected_value) is not bytes or type(desired_value) is not bytes:
            raise AssertionError("compare_set got a non-bytes value")
        current = self.data.get(key)
        if current is None and expected_value == b"" or current == expected_value:
            self.data[key] = desired_value
            return desired_value
        return expected_value if current is None else current


@pytest.mark.timeout(20)
def test_store_base_class_can_be_subclassed_partially() -> None:
    """torch: TestPythonStore.test_optional_methods_fail, test_extended_methods_fallbacks."""

    class Empty(Store):
        pass

    e = Empty()
    assert not e.has_extended_api() and e.timeout == timedelta(seconds=300)
    e.set_timeout(SHORT)
    assert e.timeout == SHORT
    for name, call in [("set", lambda: e.set("k", b"v")), ("get", lambda: e.get("k")),
                       ("add", lambda: e.add("k", 1)), ("wait", lambda: e.wait(["k"])),
                       ("check", lambda: e.check(["k"])), ("num_keys", e.num_keys),
                       ("delete_key", lambda: e.delete_key("k")), ("clone", e.clone),
                       ("compare_set", lambda: e.compare_set("k", b"", b"v")),
                       ("compare_set", lambda: e.append("k", "v")),  # append falls back
                       ("get", lambda: e.multi_get(["k"])),  # falls back on get
                       ("set", lambda: e.multi_set(["k"], ["v"])),  # falls back on set
                       ("queue_push", lambda: e.queue_push("q", "v")),
                       ("queue_pop", lambda: e.queue_pop("q")),
                       ("queue_len", lambda: e.queue_len("q"))]:
        with pytest.raises(NotImplementedError, match=rf"Empty\.{name}: Not implemented\.") as info:
            call()
        assert isinstance(info.value, RuntimeError)  # what torch's tests catch
    e.close()  # a no-op, never an error

    d = DictStore()
    d.append("foo", b"po")
    d.append("foo", "tato")
    d.multi_set(["a", "b"], ["c", b"d"])
    assert d.multi_get(["a", "b", "foo"]) == [b"c", b"d", b"potato"]
    assert ("set", "a", b"c") in d.calls  # str values reach a subclass as bytes

    p = PrefixStore("p", d)
    assert not p.has_extended_api()
    p.append("foo", "po")
    p.append("foo", b"tato")
    p.multi_set(["x"], ["y"])
    assert p.get("foo") == b"potato" and d.data["p/x"] == b"y"
    assert p.multi_get(["foo", "x"]) == [b"potato", b"y"]
    with pytest.raises(NotImplementedError, match="DictStore.queue_push: Not implemented"):
        p.queue_push("q", "v")


@pytest.mark.timeout(20)
def test_prefix_store_forwards_extended_calls_as_bytes() -> None:
    """torch: test_has_extended_api_roundtrip, test_append/multi_get/multi_set_roundtrip,
    test_get_underlying_store, test_underlying_non_prefix_store."""

    class Recorder(Store):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple] = []

        def has_extended_api(self) -> bool:
            return True

        def append(self, key: str, value: bytes | str) -> None:
            self.seen.append(("append", key, value))

        def multi_get(self, keys):  # type: ignore[no-untyped-def]
            self.seen.append(("multi_get", list(keys)))
            return [b"x", b"y"]

        def multi_set(self, keys, values):  # type: ignore[no-untyped-def]
            self.seen.append(("multi_set", list(keys), list(values)))

    r = Recorder()
    p = PrefixStore("p", r)
    assert p.has_extended_api()
    p.append("foo", "bar")
    assert p.multi_get(["foo", "bar"]) == [b"x", b"y"]
    p.multi_set(["foo", "bar"], ["x", b"y"])
    assert r.seen == [("append", "p/foo", b"bar"), ("multi_get", ["p/foo", "p/bar"]),
                      ("multi_set", ["p/foo", "p/bar"], [b"x", b"y"])]
    nested = PrefixStore("q", p)
    assert nested.underlying_store is p
    assert p._underlying_non_prefix_store is r and nested._underlying_non_prefix_store is r
    with pytest.raises(ValueError, match="cannot be None"):
        PrefixStore("prefix", None)  # type: ignore[arg-type]


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
def test_file_store_reference_count_in_one_process(tmp_path) -> None:
    """Two users of one file, each told world_size=1: the file goes with the last of them
    (torch: test_refcount)."""
    path = str(tmp_path / "rc")
    a, b = FileStore(path, 1), FileStore(path, 1)
    a.set("k", "v")
    a.close()
    assert os.path.exists(path)
    c = FileStore(path, 1)  # joins while b is open: same file, same keys
    assert c.get("k") == b"v"
    b.set("after", "1")
    assert c.get("after") == b"1"
    b.close()
    assert os.path.exists(path)
    c.close()
    assert not os.path.exists(path)
    # world_size counts users over time: the file stays until that many have left
    d = FileStore(path, 2)
    d.set("x", "1")
    d.close()
    assert os.path.exists(path)
    e = FileStore(path, 2)
    assert e.get("x") == b"1"
    e.close()
    assert not os.path.exists(path)


@pytest.mark.timeout(60)
def test_file_store_life_cycle_across_processes(tmp_path) -> None:
    """The store must never split: closing one process's store while another process still uses
    the file keeps the file, so a new store on the path sees the old keys and the new ones."""
    path = str(tmp_path / "shared.log")
    mine = FileStore(path, 1, timeout=timedelta(seconds=30))
    worker = spawn("file_user", path=path, world_size=1)
    wait_ready(worker)
    mine.close()
    assert os.path.exists(path)
    again = FileStore(path, 1, timeout=timedelta(seconds=30))
    assert again.get("from_worker_before") == b"1"  # written before our first store closed
    again.set("go", "1")
    assert again.get("from_worker_after") == b"2"  # written by the still-open store afterwards
    again.close()
    assert os.path.exists(path)  # the worker still has it open
    last = FileStore(path, 1, timeout=timedelta(seconds=30))
    last.set("done", "1")
    assert result(worker) == {"exists_after_close": True}  # we still had `last` open
    assert last.num_keys() == 5  # four keys + the reference count
    last.close()
    assert not os.path.exists(path)


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

XKINDS = ["tcp", "file", "prefix_tcp", "etcd"]


@pytest.fixture(params=XKINDS)
def shared(request, tmp_path) -> Iterator[tuple[Store, dict]]:
    """A store in this process and the JSON spec a worker process uses to open the same one."""
    kind = request.param
    if kind == "etcd":
        url = request.getfixturevalue("etcd1").url(f"x/{os.urandom(6).hex()}")
        s = plugdist.open_store(url, timedelta(seconds=30))
        spec = {"kind": "url", "url": url}
        closers = [s]
    elif kind == "file":
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


@pytest.mark.timeout(180)  # etcd: 400 contended adds are compare-and-swap retries, slow under load
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
def test_queues_between_processes(shared: tuple[Store, dict]) -> None:
    """Two worker processes pop from one queue and answer on another: every request is taken by
    exactly one of them, in order per worker, and every answer arrives."""
    s, spec = shared
    workers = [spawn("queue_worker", spec=spec) for _ in range(2)]
    for p in workers:
        wait_ready(p)
    items = [f"job{i}" for i in range(40)]
    for item in items:
        s.queue_push("requests", item)
    replies = sorted(s.queue_pop("replies").decode() for _ in items)
    for _ in workers:
        s.queue_push("requests", "stop")
    taken = [result(p) for p in workers]
    assert sorted(taken[0] + taken[1]) == sorted(items)
    for t in taken:
        assert t == sorted(t, key=lambda x: int(x[3:]))  # FIFO as each worker saw it
    assert replies == sorted(i + "!" for i in items)
    assert s.queue_len("requests") == 0 and s.queue_len("replies") == 0


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


@pytest.mark.timeout(30)
def test_delete_prefix_drops_values_counters_and_queues_under_it(h: Handle) -> None:
    """delete_prefix (how resilient training forgets old steps' votes) on every store that
    offers it: the names under the prefix go, values, counters and queues alike, and nothing
    else; the count is of names, as num_keys sees the values among them."""
    s = h.store
    try:
        s.delete_prefix("nothing/")
    except NotImplementedError:
        pytest.skip(f"{h.kind}: no delete_prefix (optional)")
    s.set("ep/1/a", "x")
    s.set("ep/1/b/c", "y")
    assert s.add("ep/1/n", 5) == 5
    s.queue_push("ep/1/q", "one")
    s.queue_push("ep/1/q", "two")
    for kept in ("ep/2/a", "ep/10/a", "ep/1"):
        s.set(kept, "kept")
    s.queue_push("ep/2/q", "kept")
    before = s.num_keys()
    assert s.delete_prefix("ep/1/") == 4
    assert s.num_keys() == before - 3   # queues are not counted by num_keys
    assert not s.check(["ep/1/a"]) and not s.check(["ep/1/b/c"]) and s.queue_len("ep/1/q") == 0
    assert s.add("ep/1/n", 1) == 1     # the counter starts again
    assert h.peer().get("ep/2/a") == b"kept" and s.get("ep/10/a") == b"kept"
    assert s.get("ep/1") == b"kept" and s.queue_len("ep/2/q") == 1


@pytest.mark.timeout(30)
def test_read_log_reads_from_start_to_the_first_gap_and_waits_for_the_first(h: Handle) -> None:
    """read_log (how members read the death log) on every store: the entries from ``start`` up
    to the first missing one, more than one batch of them; a wait for the next entry that
    another handle appends (which may return that entry alone); a timeout naming the missing
    entry."""
    s = h.store
    for i in range(1, 41):  # a log's writer counts, then writes (as a will does)
        assert s.add("log", 1) == i
        s.set(f"log/{i}", f"e{i}")
    assert s.add("log", 2) == 42  # the writer of entry 41 has counted it, not written it
    s.set("log/42", "after the gap")
    assert s.read_log("log", 1, SHORT) == [f"e{i}".encode() for i in range(1, 41)]
    assert s.read_log("log", 38, SHORT) == [b"e38", b"e39", b"e40"]
    writer = later(0.3, lambda: h.peer().set("log/41", "e41"))
    started = time.monotonic()
    woken = s.read_log("log", 41, timedelta(seconds=10))
    waited = time.monotonic() - started > 0.1  # not when this thread came late to the read
    writer.join()
    # a store that waited may return the entry it waited for alone; the rest comes next. etcd
    # does: the entry came with the watch's event, and a second read is what it saves
    assert woken in ([b"e41"], [b"e41", b"after the gap"]), woken
    if h.kind == "etcd" and waited:
        assert woken == [b"e41"]
    if len(woken) == 1:
        assert s.read_log("log", 42, SHORT) == [b"after the gap"]
    with pytest.raises(DistTimeoutError, match="log/43"):
        s.read_log("log", 43, SHORT)
