"""asyncreduce.rendezvous: the stores and gather, over real sockets, threads and processes."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncreduce.errors import BrokenError, ClosedError, UsageError
from asyncreduce.rendezvous import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    FileStore,
    Store,
    TCPStore,
    _describe_ranks,
    gather,
    store_from_env_or_args,
)

LOCAL = "127.0.0.1"
MAGIC = b"ARSTORE1"
SET, GET, ADD = 1, 2, 3


def store_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncreduce-store"]


@pytest.fixture
def server() -> Iterator[TCPStore]:
    with TCPStore(LOCAL, 0, is_server=True, timeout=5.0) as store:
        yield store


def client_of(server: TCPStore, timeout: float = 5.0) -> TCPStore:
    return TCPStore(LOCAL, server.port, is_server=False, timeout=timeout)


@pytest.fixture(params=["tcp", "file"])
def handles(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[Store]]:
    """Three handles on one shared store (for TCP: the server and two clients)."""
    stores: list[Store] = []
    if request.param == "tcp":
        srv = TCPStore(LOCAL, 0, is_server=True, timeout=5.0)
        stores = [srv, client_of(srv), client_of(srv)]
    else:
        stores = [FileStore(str(tmp_path / "store"), timeout=5.0) for _ in range(3)]
    yield stores
    for store in reversed(stores):
        store.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCAL, 0))
        return int(sock.getsockname()[1])


def run_in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    """Start ``fn`` in a thread; the dict gets its "result" or "error"."""
    out: dict[str, object] = {}

    def body() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # handed to the test to assert on
            out["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    return thread, out


# ------------------------------------------------------------ behaviour of every store


def test_set_get_check_delete_across_handles(handles: list[Store]) -> None:
    a, b, c = handles
    a.set("x", b"\x00hello\xff")
    assert b.get("x") == b"\x00hello\xff"
    assert c.get("x", timeout=0.5) == b"\x00hello\xff"
    c.set("x", b"new")
    assert a.get("x") == b"new"
    b.set("empty", b"")
    assert a.get("empty") == b""
    assert c.check(["x", "missing", "empty"]) == [True, False, True]
    b.delete("x")
    b.delete("never-set")  # deleting a missing key is fine
    assert a.check(["x", "empty"]) == [False, True]
    assert a.check([]) == []


def test_get_blocks_until_another_thread_sets(handles: list[Store]) -> None:
    a, b, _ = handles
    thread, out = run_in_thread(lambda: a.get("late", timeout=5.0))
    time.sleep(0.2)
    assert thread.is_alive(), "get returned before the key was set"
    b.set("late", b"here")
    thread.join(timeout=5.0)
    assert out == {"result": b"here"}
    b.set("late", b"again")  # the answered waiter must not be answered twice
    a.set("z", b"zz")
    assert a.get("z") == b"zz"
    assert a.get("late") == b"again"


def test_a_parked_get_does_not_block_a_set_on_the_same_handle(handles: list[Store]) -> None:
    shared = handles[1]
    thread, out = run_in_thread(lambda: shared.get("k", timeout=5.0))
    time.sleep(0.1)
    start = time.monotonic()
    shared.set("k", b"v")
    assert time.monotonic() - start < 1.0
    thread.join(timeout=5.0)
    assert out == {"result": b"v"}


def test_add_is_atomic_under_four_threads(handles: list[Store]) -> None:
    seen: list[list[int]] = [[] for _ in range(4)]

    def work(i: int) -> None:
        store = handles[i % len(handles)]  # handle 0 is shared by two threads
        seen[i] = [store.add("counter", 1) for _ in range(200)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30.0)
    assert handles[0].get("counter") == b"800"
    assert sorted(v for vals in seen for v in vals) == list(range(1, 801))
    assert handles[2].add("counter", -800) == 0


def test_add_counts_from_zero_and_wakes_a_get(handles: list[Store]) -> None:
    a, b, _ = handles
    thread, out = run_in_thread(lambda: a.get("n", timeout=5.0))
    time.sleep(0.1)
    assert b.add("n", 5) == 5
    thread.join(timeout=5.0)
    assert out == {"result": b"5"}
    assert a.add("n", -7) == -2
    assert b.add("n", 0) == -2


def test_get_times_out_and_the_store_still_works(handles: list[Store]) -> None:
    a, b, _ = handles
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="'nope'.*0.3 s"):
        a.get("nope", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 1.3
    b.set("after", b"ok")
    assert a.get("after") == b"ok"


def test_add_on_a_value_that_is_not_a_counter(handles: list[Store]) -> None:
    a, b, _ = handles
    a.set("text", b"hello")
    with pytest.raises(UsageError, match="not a counter"):
        b.add("text", 1)
    assert b.get("text") == b"hello"
    assert b.add("other", 2) == 2


def test_bad_arguments_are_usage_errors(handles: list[Store]) -> None:
    store = handles[1]
    with pytest.raises(UsageError, match="4097 bytes"):
        store.set("k" * (MAX_KEY_BYTES + 1), b"")
    with pytest.raises(UsageError, match="limit"):
        store.set("big", bytes(MAX_VALUE_BYTES + 1))
    with pytest.raises(UsageError, match="bytes"):
        store.set("k", "text")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        store.add("k", 2**63)
    with pytest.raises(UsageError):
        store.add("k", 1.5)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        store.get("k", timeout=-1)
    assert store.check(["k", "big"]) == [False, False]


def test_odd_keys_round_trip_and_stay_distinct(handles: list[Store]) -> None:
    a, b, _ = handles
    keys = ["", ".", "..", "a/b", "a%2Fb", "../../etc", ".lock", ".tmp-x", "ü ✓", "x" * 3000]
    for i, key in enumerate(keys):
        a.set(key, str(i).encode())
    assert [b.get(key) for key in keys] == [str(i).encode() for i in range(len(keys))]
    assert b.check(keys) == [True] * len(keys)


def test_closed_store_raises_closed_error(handles: list[Store]) -> None:
    user = handles[1]
    user.close()
    user.close()  # idempotent
    for call in (lambda: user.get("k"), lambda: user.set("k", b""), lambda: user.add("k", 1)):
        with pytest.raises(ClosedError):
            call()
    handles[0].set("still", b"works")
    assert handles[2].get("still") == b"works"


def test_gather_returns_values_in_rank_order(handles: list[Store]) -> None:
    results: list[object] = [None] * 3

    def rank(r: int) -> None:
        results[r] = gather(handles[r], "g", r, 3, f"v{r}".encode(), timeout=5.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10.0)
    assert results == [[b"v0", b"v1", b"v2"]] * 3


def test_gather_timeout_names_the_missing_ranks(handles: list[Store]) -> None:
    def rank(r: int) -> Callable[[], object]:
        return lambda: gather(handles[r], "t", r, 4, b"x", timeout=0.5)

    start = time.monotonic()
    outs = [run_in_thread(rank(r)) for r in (0, 1)]
    for thread, _ in outs:
        thread.join(timeout=5.0)
    assert time.monotonic() - start < 1.5
    for _, out in outs:
        error = out.get("error")
        assert isinstance(error, TimeoutError), out
        assert "rendezvous 't': waited 0.5 s; ranks 2, 3 never joined (world_size=4)" in str(error)


def test_gather_rejects_bad_rank_and_world_size(handles: list[Store]) -> None:
    with pytest.raises(UsageError, match="world_size"):
        gather(handles[0], "p", 0, 0, b"", 1.0)
    with pytest.raises(UsageError, match="rank"):
        gather(handles[0], "p", 3, 3, b"", 1.0)
    with pytest.raises(UsageError, match="rank"):
        gather(handles[0], "p", -1, 3, b"", 1.0)


def test_missing_ranks_are_described_compactly() -> None:
    assert _describe_ranks([2]) == "rank 2"
    assert _describe_ranks([2, 3]) == "ranks 2, 3"
    assert _describe_ranks([0, 2, 3, 4, 5, 9]) == "ranks 0, 2-5, 9"


# ------------------------------------------------------------ real processes

WORKER = r"""
import json, sys, time
from asyncreduce.rendezvous import gather, store_from_env_or_args

kind, rank, world_size, where = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if kind == "tcp":
    store = store_from_env_or_args(rank, world_size, "127.0.0.1", int(where), None, 20.0)
    if rank == 0:
        print(store.port, flush=True)
else:
    store = store_from_env_or_args(rank, world_size, None, None, "file://" + where, 20.0)
with store:
    value = bytes([rank, 0, 255]) + b"rank%d" % rank
    got = gather(store, "job", rank, world_size, value, 20.0)
    print(json.dumps([v.hex() for v in got]), flush=True)
    store.add("left", 1)
    while rank == 0 and store.add("left", 0) < world_size:  # the server outlives its clients
        time.sleep(0.01)
"""


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> list[bytes]:
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return [bytes.fromhex(v) for v in json.loads(out.strip().splitlines()[-1])]


def expected(world_size: int) -> list[bytes]:
    return [bytes([r, 0, 255]) + b"rank%d" % r for r in range(world_size)]


def test_gather_across_processes_over_tcp() -> None:
    world_size = 3
    rank0 = spawn("tcp", "0", str(world_size), "0")
    try:
        assert rank0.stdout is not None
        port = rank0.stdout.readline().strip()
        assert port.isdigit(), rank0.stderr.read() if rank0.stderr else ""
        others = [spawn("tcp", str(r), str(world_size), port) for r in range(1, world_size)]
        results = [finish(p) for p in [rank0, *others]]
    finally:
        rank0.kill()
        rank0.wait()
    assert results == [expected(world_size)] * world_size


def test_gather_across_processes_over_a_file_store(tmp_path: Path) -> None:
    world_size = 3
    where = str(tmp_path / "rdzv")
    procs = [spawn("file", str(r), str(world_size), where) for r in range(world_size)]
    assert [finish(p) for p in procs] == [expected(world_size)] * world_size


COUNTER = r"""
import sys
from asyncreduce.rendezvous import FileStore
with FileStore(sys.argv[1], timeout=20.0) as store:
    store.get("go")  # start together, so the adds contend
    for _ in range(100):
        store.add("n", 1)
"""


def test_file_store_add_is_atomic_across_processes(tmp_path: Path) -> None:
    where = str(tmp_path / "counter")
    with FileStore(where) as store:
        procs = [subprocess.Popen([sys.executable, "-c", COUNTER, where]) for _ in range(3)]
        time.sleep(0.3)
        store.set("go", b"")
        assert [p.wait(timeout=30) for p in procs] == [0, 0, 0]
        assert store.get("n") == b"300"


def test_file_store_keeps_its_files_inside_its_directory(tmp_path: Path) -> None:
    with FileStore(str(tmp_path / "s")) as store:
        store.set("../escape", b"1")
        store.set("a/b/c", b"2")
        store.add("n", 1)
    names = sorted(p.name for p in tmp_path.rglob("*"))
    assert names == sorted(["s", ".lock", "k_..%2Fescape", "k_a%2Fb%2Fc", "k_n"])


# ------------------------------------------------------------ TCP store specifics


def test_large_value_round_trips(server: TCPStore) -> None:
    value = bytes(range(256)) * (8 * 4096)  # 8 MiB
    with client_of(server) as client:
        client.set("big", value)
        assert server.get("big") == value


def test_connecting_to_a_port_nobody_serves_times_out() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        TCPStore(LOCAL, port, is_server=False, timeout=0.5)
    assert 0.4 < time.monotonic() - start < 1.5
    message = str(info.value)
    assert f"could not reach the store at 127.0.0.1:{port} within 0.5 s" in message
    assert "is rank 0 running? is MASTER_ADDR/MASTER_PORT right?" in message


def test_a_client_may_start_before_the_server() -> None:
    port = free_port()
    thread, out = run_in_thread(lambda: TCPStore(LOCAL, port, is_server=False, timeout=5.0))
    time.sleep(0.3)
    with TCPStore(LOCAL, port, is_server=True, timeout=5.0) as srv:
        thread.join(timeout=5.0)
        client = out.get("result")
        assert isinstance(client, TCPStore), out
        with client:
            client.set("early", b"bird")
            assert srv.get("early") == b"bird"


def test_a_service_that_is_not_a_store_is_named() -> None:
    with socket.create_server((LOCAL, 0)) as listener:
        port = listener.getsockname()[1]

        def banner() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        thread = threading.Thread(target=banner)
        thread.start()
        with pytest.raises(UsageError, match=f"127.0.0.1:{port} is not an asyncreduce store"):
            TCPStore(LOCAL, port, is_server=False, timeout=2.0)
        thread.join(timeout=5.0)


def test_server_bind_failure_is_explained(server: TCPStore) -> None:
    with pytest.raises(UsageError, match=f"cannot serve the store on 127.0.0.1:{server.port}"):
        TCPStore(LOCAL, server.port, is_server=True, timeout=1.0)


def test_close_stops_the_thread_and_frees_the_port() -> None:
    srv = TCPStore(LOCAL, 0, is_server=True, timeout=5.0)
    client = client_of(srv)
    port = srv.port
    assert len(store_threads()) == 1
    srv.close()
    srv.close()
    assert store_threads() == []
    with pytest.raises(BrokenError, match=f"127.0.0.1:{port}"):
        client.set("k", b"v")  # the server is gone: fail, do not hang
    client.close()
    with TCPStore(LOCAL, port, is_server=True, timeout=5.0) as again:
        again.set("k", b"v")
        assert again.get("k") == b"v"


def test_server_close_fails_a_parked_get_promptly() -> None:
    srv = TCPStore(LOCAL, 0, is_server=True, timeout=5.0)
    with client_of(srv) as client:
        thread, out = run_in_thread(lambda: client.get("never", timeout=10.0))
        time.sleep(0.2)
        start = time.monotonic()
        srv.close()
        thread.join(timeout=5.0)
        assert time.monotonic() - start < 2.0
        assert isinstance(out.get("error"), BrokenError), out


def test_closing_a_client_wakes_its_parked_get(server: TCPStore) -> None:
    client = client_of(server)
    thread, out = run_in_thread(lambda: client.get("never", timeout=10.0))
    time.sleep(0.2)
    start = time.monotonic()
    client.close()
    thread.join(timeout=5.0)
    assert time.monotonic() - start < 2.0
    assert isinstance(out.get("error"), ClosedError), out
    server.set("never", b"now")  # the server is unharmed
    assert server.get("never") == b"now"


# ------------------------------------------------------------ hostile input to the server


def frame(tag: int, *fields: bytes) -> bytes:
    body = bytes([tag]) + b"".join(struct.pack("!I", len(f)) + f for f in fields)
    return struct.pack("!I", len(body)) + body


def greeted(port: int) -> socket.socket:
    sock = socket.create_connection((LOCAL, port), timeout=5.0)
    sock.sendall(MAGIC)
    assert sock.recv(8, socket.MSG_WAITALL) == MAGIC
    return sock


def assert_dropped(sock: socket.socket) -> None:
    """The server closed this connection (it may not answer first)."""
    with sock, contextlib.suppress(ConnectionResetError):
        assert sock.recv(1 << 16) == b""


def assert_serving(port: int, tag: str) -> None:
    with TCPStore(LOCAL, port, is_server=False, timeout=5.0) as client:
        assert client.get("kept") == b"data"
        client.set(tag, tag.encode())
        assert client.get(tag) == tag.encode()


HOSTILE = {
    "http request instead of greeting": (False, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
    "oversized length field": (True, struct.pack("!I", 0xFFFFFFFF) + b"xxxx"),
    "zero length frame": (True, struct.pack("!I", 0)),
    "unknown command": (True, frame(99, b"key")),
    "field overruns its frame": (True, struct.pack("!IBI", 8, SET, 1000) + b"abc"),
    "key too long": (True, frame(GET, b"k" * (MAX_KEY_BYTES + 1))),
    "wrong field count": (True, frame(GET, b"a", b"b")),
    "bad add amount": (True, frame(ADD, b"n", b"\x01")),
}


def test_hostile_input_drops_only_that_connection(
    server: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncreduce.rendezvous")
    server.set("kept", b"data")
    for name, (greet, payload) in HOSTILE.items():
        sock = greeted(server.port) if greet else socket.create_connection((LOCAL, server.port))
        sock.settimeout(5.0)
        sock.sendall(payload)
        assert_dropped(sock)
        assert_serving(server.port, name)
    records = [r for r in caplog.records if r.name == "asyncreduce.rendezvous"]
    assert sum(r.levelno == logging.WARNING for r in records) == 1  # logged once, then DEBUG
    assert len(records) == len(HOSTILE)
    assert all("dropping connection" in r.getMessage() for r in records)


def test_connections_that_vanish_do_not_hurt_the_server(server: TCPStore) -> None:
    server.set("kept", b"data")
    half = greeted(server.port)
    half.sendall(struct.pack("!I", 100) + b"0123456789")  # frame cut short
    half.close()
    parked = greeted(server.port)
    parked.sendall(frame(GET, b"later"))  # parks, then leaves
    time.sleep(0.05)
    parked.close()
    silent = socket.create_connection((LOCAL, server.port))
    silent.close()  # never even greets
    time.sleep(0.05)
    server.set("later", b"L")
    assert_serving(server.port, "after-vanish")
    assert server.get("later") == b"L"


def test_random_bytes_never_stop_the_server() -> None:
    with TCPStore(LOCAL, 0, is_server=True, timeout=5.0) as srv:
        srv.set("kept", b"data")

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(greet=st.booleans(), payload=st.binary(max_size=64))
        def throw(greet: bool, payload: bytes) -> None:
            sock = greeted(srv.port) if greet else socket.create_connection((LOCAL, srv.port))
            with sock:
                sock.settimeout(5.0)
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(1 << 16):  # the server answers or drops, then closes
                    pass
            assert srv.get("kept") == b"data"

        throw()
        assert_serving(srv.port, "after-fuzz")
        assert len(store_threads()) == 1


# ------------------------------------------------------------ store_from_env_or_args


@pytest.fixture
def no_master_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    return monkeypatch


def test_tcp_init_method(no_master_env: pytest.MonkeyPatch) -> None:
    with store_from_env_or_args(0, 2, None, None, "tcp://127.0.0.1:0", 5.0) as rank0:
        assert isinstance(rank0, TCPStore)
        url = f"tcp://127.0.0.1:{rank0.port}"
        with store_from_env_or_args(1, 2, "ignored", 1, url, 5.0) as rank1:
            assert isinstance(rank1, TCPStore)
            rank1.set("hi", b"there")
            assert rank0.get("hi") == b"there"


def test_file_init_method(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/job%201"
    with (
        store_from_env_or_args(0, 2, None, None, url, 5.0) as a,
        store_from_env_or_args(1, 2, None, None, url, 5.0) as b,
    ):
        assert isinstance(a, FileStore)
        a.set("k", b"v")
        assert b.get("k") == b"v"
    assert (tmp_path / "job 1" / "k_k").read_bytes() == b"v"


def test_master_addr_and_port_from_args_and_env(no_master_env: pytest.MonkeyPatch) -> None:
    with store_from_env_or_args(0, 2, LOCAL, 0, None, 5.0) as rank0:
        assert isinstance(rank0, TCPStore)
        no_master_env.setenv("MASTER_ADDR", LOCAL)
        no_master_env.setenv("MASTER_PORT", str(rank0.port))
        with store_from_env_or_args(1, 2, None, None, None, 5.0) as rank1:
            rank1.set("env", b"ok")
            assert rank0.get("env") == b"ok"


@pytest.mark.parametrize(
    ("args", "env", "match"),
    [
        ((0, 2, None, None, None), {}, "set MASTER_ADDR and MASTER_PORT"),
        ((0, 2, LOCAL, None, None), {}, "set MASTER_PORT"),
        ((1, 2, None, 29500, None), {}, "set MASTER_ADDR"),
        ((1, 2, None, None, None), {"MASTER_ADDR": "h", "MASTER_PORT": "x"}, "MASTER_PORT must"),
        ((0, 2, None, None, "http://h:1"), {}, "'tcp://HOST:PORT'.*'file:///ABSOLUTE/PATH'"),
        ((0, 2, None, None, "tcp://hostonly"), {}, "needs a host and a port"),
        ((0, 2, None, None, "tcp://h:99999"), {}, "needs a host and a port"),
        ((0, 2, None, None, "file://relative/path"), {}, "not an absolute file URL"),
        ((1, 2, LOCAL, 0, None), {}, "port must be an int in 1..65535"),
        ((0, -1, LOCAL, 1, None), {}, "world_size must be an int >= 1"),
        ((2, 2, LOCAL, 1, None), {}, r"rank must be an int in 0\.\.1"),
    ],
)
def test_usage_errors(
    no_master_env: pytest.MonkeyPatch, args: tuple[object, ...], env: dict[str, str], match: str
) -> None:
    for name, value in env.items():
        no_master_env.setenv(name, value)
    with pytest.raises(UsageError, match=match):
        store_from_env_or_args(*args, timeout=1.0)  # type: ignore[arg-type,misc]
