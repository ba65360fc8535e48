"""Hostile input against every listening endpoint: the store server and the data listener.

Each scenario throws bytes at a live endpoint (random bytes, a valid magic with a random body,
extreme length fields, a slow sender, many idle connections, a pickle that would create a
file if anything unpickled it), then checks that the endpoint closed every bad connection
within its deadline (a hang fails the test), is still alive and answers a good client, and
that its descriptors and memory stayed bounded. The store server runs in its own process;
the data listener is rank 0 of a two-rank ``connect_mesh`` running in a thread. Both run with
and without a shared secret. A last test scans the package's source for pickle, marshal,
shelve, eval and exec.

``ASYNCREDUCE_FUZZ_SCALE`` (default 1) multiplies the counts: at 1, 200 connections per
scenario and 100 idle ones; the long run (``ASYNCREDUCE_FUZZ_SCALE=10``) throws 2,000 and
1,000. Run with ``-s`` to see one summary line per scenario (the figures in docs/security.md).
"""

from __future__ import annotations

import ast
import os
import pickle
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import asyncreduce
from asyncreduce.auth import PROOF_BYTES, ClientHandshake, Secret
from asyncreduce.rendezvous import _CONTEXT, _MAX_FRAME, _MAX_PENDING, TCPStore
from asyncreduce.transport import mesh as mesh_module
from asyncreduce.transport.frame import DATA, HEADER, VERSION, Descriptor, FrameError, pack_header
from asyncreduce.transport.mesh import HELLO, connect_mesh
from asyncreduce.transport.tcp import TcpTransport

LOCAL = "127.0.0.1"
SECRET = "hostile-test-" + os.urandom(8).hex()
SCALE = int(os.environ.get("ASYNCREDUCE_FUZZ_SCALE", "1"))
RUNS = 200 * SCALE
IDLE = 100 * SCALE
HANDSHAKE_SECONDS = 1.0  # the endpoints' handshake deadline in these tests (default 10 s / 5 s)
MAGIC, MAGIC_AUTH = b"ARSTORE1", b"ARSTOREA"
MODES = ["open", "secret"]


def summary(endpoint: str, mode: str, scenario: str, **figures: object) -> None:
    """One line per scenario, printed for ``-s`` runs (docs/security.md quotes them)."""
    shown = " ".join(f"{k}={v}" for k, v in figures.items())
    print(f"\nHOSTILE {endpoint} {mode} {scenario}: {shown}")


def throw(port: int, payload: bytes, wait: float = 5.0) -> bool:
    """Send ``payload``, hang up our side, read until the endpoint closes; False if it hangs."""
    with socket.create_connection((LOCAL, port), timeout=wait) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        except TimeoutError:
            return False
        except OSError:
            pass  # reset, or closed with our bytes unread: closed all the same
    return True


def storm(port: int, payloads: Iterator[bytes]) -> tuple[int, int]:
    """Throw every payload on its own connection; (runs, hangs)."""
    runs = hangs = 0
    for payload in payloads:
        runs += 1
        hangs += not throw(port, payload)
    return runs, hangs


def random_bytes(rng: random.Random, most: int) -> bytes:
    return rng.randbytes(rng.randint(0, most))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        line = next(x for x in fh if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


class Evil:
    """Unpickling this opens (creates) a file: proof that nobody unpickles what they receive."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (open, (self.path, "w"))


def evil_payload(path: Path) -> bytes:
    return pickle.dumps(Evil(str(path)))


def test_the_pickle_payload_is_live(tmp_path: Path) -> None:
    """The control: unpickling the payload (in a throwaway process) does create the file."""
    target = tmp_path / "control"
    code = "import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, evil_payload(target).hex()], check=True)
    assert target.exists()


# ---------------------------------------------------------------- the store server


SERVER = r"""
import os, sys
from asyncreduce import rendezvous
from asyncreduce.auth import Secret
from asyncreduce.rendezvous import server
server._HANDSHAKE_SECONDS = float(sys.argv[1])
secret = Secret(sys.argv[2]) if len(sys.argv) > 2 else None
with rendezvous.TCPStore("127.0.0.1", 0, is_server=True, timeout=10.0, secret=secret) as store:
    store.set("kept", b"data")
    print(store.port, flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
"""


@dataclass
class Server:
    """A store server in its own process."""

    proc: subprocess.Popen[str]
    port: int
    secret: Secret | None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self) -> TCPStore:
        return TCPStore(LOCAL, self.port, is_server=False, timeout=5.0, secret=self.secret)

    def serves(self) -> float:
        """Seconds a good client takes to connect, read a key, write one and read it back."""
        start = time.monotonic()
        with self.client() as client:
            assert client.get("kept") == b"data"
            client.set("probe", b"ok")
            assert client.get("probe") == b"ok"
        return time.monotonic() - start

    def authenticated(self) -> socket.socket:
        """A raw connection past the handshake (with the secret, if the server has one)."""
        sock = socket.create_connection((LOCAL, self.port), timeout=5.0)
        if self.secret is None:
            sock.sendall(MAGIC)
            assert sock.recv(8, socket.MSG_WAITALL) == MAGIC
            return sock
        sock.sendall(MAGIC_AUTH)
        head = sock.recv(40, socket.MSG_WAITALL)
        handshake = ClientHandshake(self.secret, _CONTEXT)
        sock.sendall(handshake.answer(head[8:]))
        handshake.check(sock.recv(PROOF_BYTES, socket.MSG_WAITALL), "the test server")
        return sock


@pytest.fixture(params=MODES)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    args = [str(HANDSHAKE_SECONDS)] + ([SECRET] if request.param == "secret" else [])
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    port = proc.stdout.readline().strip()
    assert port.isdigit(), proc.stderr.read() if proc.stderr else ""
    secret = Secret(SECRET) if request.param == "secret" else None
    try:
        yield Server(proc, int(port), secret)
    finally:
        _, err = proc.communicate(input="", timeout=15)  # EOF on its stdin: it stops
        assert proc.returncode == 0, err
        assert err.count("\n") <= 8, err  # one warning per cause, never one per connection
        assert SECRET not in err


def mode_of(server: Server) -> str:
    return "open" if server.secret is None else "secret"


def frame(tag: int, *fields: bytes) -> bytes:
    body = bytes([tag]) + b"".join(struct.pack("!I", len(f)) + f for f in fields)
    return struct.pack("!I", len(body)) + body


@pytest.mark.timeout(300)
def test_store_random_bytes(server: Server) -> None:
    rng = random.Random(1)
    before = fds(server.pid)
    greetings = [b"", MAGIC, MAGIC_AUTH]
    payloads = (rng.choice(greetings) + random_bytes(rng, 512) for _ in range(RUNS))
    runs, hangs = storm(server.port, payloads)
    assert hangs == 0
    assert server.serves() < 1.0
    assert fds(server.pid) <= before + 2
    summary("store", mode_of(server), "random bytes", runs=runs, hangs=hangs, alive=True)


@pytest.mark.timeout(300)
def test_store_valid_magic_random_body(server: Server) -> None:
    """After the greeting the server parses frames (open) or reads the answer (secret)."""
    rng = random.Random(2)
    runs = hangs = 0
    for _ in range(RUNS):
        runs += 1
        sock = server.authenticated() if rng.random() < 0.5 else None
        if sock is None:
            hangs += not throw(server.port, MAGIC_AUTH + random_bytes(rng, 256))
            continue
        with sock:  # an accepted client sending random frames
            sock.sendall(random_bytes(rng, 256))
            sock.shutdown(socket.SHUT_WR)
            try:
                while sock.recv(1 << 16):
                    pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                hangs += 1
    assert hangs == 0
    assert server.serves() < 1.0
    summary("store", mode_of(server), "valid magic, random body", runs=runs, hangs=hangs)


EXTREME_FRAMES = {
    "frame length 0": struct.pack("!I", 0),
    "frame length 2**32-1": struct.pack("!I", 0xFFFFFFFF) + b"x" * 64,
    "frame length 2**31": struct.pack("!I", 1 << 31) + b"x" * 64,
    "frame length just over the bound": struct.pack("!I", _MAX_FRAME + 1) + b"x" * 64,
    "frame length at the bound, body cut": struct.pack("!I", _MAX_FRAME) + b"x" * 64,
    "field length 2**32-1": struct.pack("!IBI", 9, 2, 0xFFFFFFFF) + b"abcd",
    "5000 empty fields": frame(4, *([b""] * 5000)),
    "key over 4096 bytes": frame(2, b"k" * 5000),
    "unknown command": frame(200, b"k"),
}


@pytest.mark.timeout(300)
def test_store_extreme_length_fields(server: Server) -> None:
    """Lengths are checked before anything is allocated: memory stays where it was."""
    before = rss_mib(server.pid)
    runs = hangs = 0
    for _ in range(max(1, RUNS // len(EXTREME_FRAMES))):
        for payload in EXTREME_FRAMES.values():
            runs += 1
            with server.authenticated() as sock:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                try:
                    while sock.recv(1 << 16):
                        pass
                except ConnectionResetError:
                    pass
                except TimeoutError:
                    hangs += 1
    grown = rss_mib(server.pid) - before
    assert hangs == 0 and grown < 32, grown
    assert server.serves() < 1.0
    summary(
        "store", mode_of(server), "extreme lengths", runs=runs, hangs=hangs, rss_grown_mib=grown
    )


@pytest.mark.timeout(60)
def test_store_slow_sender_holds_up_nobody(server: Server) -> None:
    """One byte per 100 ms: other clients are served meanwhile; a handshake that slow is cut."""
    message = (MAGIC if server.secret is None else MAGIC_AUTH) + frame(1, b"slow", b"v")
    outcome: dict[str, object] = {}

    def trickle() -> None:
        start = time.monotonic()
        with socket.create_connection((LOCAL, server.port), timeout=10.0) as sock:
            try:
                for byte in message:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.1)
                outcome["answer"] = sock.recv(64)
            except (ConnectionResetError, BrokenPipeError) as exc:
                outcome["answer"] = exc
        outcome["after"] = time.monotonic() - start  # served, or when the drop was noticed

    thread = threading.Thread(target=trickle)
    thread.start()
    slowest = max(server.serves() for _ in range(10))
    thread.join(timeout=20.0)
    assert not thread.is_alive()
    assert slowest < 1.0
    answer, after = outcome["answer"], outcome["after"]
    assert isinstance(after, float)
    if server.secret is None:  # no deadline after the 8-byte greeting: the slow client is served
        assert isinstance(answer, bytes) and answer.startswith(MAGIC), outcome
        assert after >= 0.1 * len(message), outcome
    else:  # the greeting takes 0.8 s, the answer would take 1.8 s more: dropped at 1 s
        assert isinstance(answer, OSError), outcome  # a send failed: the server hung up
        # noticed by the first or second byte sent after the drop (0.1 s apart)
        assert HANDSHAKE_SECONDS - 0.1 <= after < HANDSHAKE_SECONDS + 0.7, outcome
    summary("store", mode_of(server), "slow sender", slowest_good_client_s=round(slowest, 3))


@pytest.mark.timeout(120)
def test_store_idle_connections_are_bounded_and_expire(server: Server) -> None:
    base_fds, base_rss = fds(server.pid), rss_mib(server.pid)
    idle = []
    for i in range(IDLE):
        sock = socket.create_connection((LOCAL, server.port), timeout=5.0)
        if i % 2:
            sock.sendall(MAGIC[:3])  # a greeting that never finishes
        idle.append(sock)
    try:
        assert server.serves() < 1.0  # served while they sit there
        peak = fds(server.pid) - base_fds
        assert peak <= _MAX_PENDING + 2, peak
        time.sleep(HANDSHAKE_SECONDS + 0.5)
        for sock in idle:  # every one of them was hung up on
            sock.settimeout(5.0)
            try:
                assert sock.recv(16) == b""
            except ConnectionResetError:
                pass
        after = fds(server.pid) - base_fds
        assert after <= 1, after
        grown = rss_mib(server.pid) - base_rss
        assert grown < 32, grown
    finally:
        for sock in idle:
            sock.close()
    assert server.serves() < 1.0
    summary(
        "store", mode_of(server), "idle connections", runs=IDLE, peak_extra_fds=peak,
        extra_fds_after=after, rss_grown_mib=round(grown, 1),
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_store_pickle_payload_is_never_unpickled(server: Server, tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    payload = evil_payload(target)
    assert throw(server.port, payload)  # instead of a greeting
    assert throw(server.port, (MAGIC_AUTH if server.secret else MAGIC) + payload)
    with server.client() as client:  # as a value and as a key, by a client the server trusts
        client.set("evil", payload)
        assert client.get("evil") == payload
        client.set(payload.decode("latin-1"), b"x")
    with server.authenticated() as sock:  # as a whole frame
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        try:
            while sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
    time.sleep(0.2)
    created = target.exists()
    summary("store", mode_of(server), "pickle payload", file_created=created)
    assert not created
    assert server.serves() < 1.0


# ---------------------------------------------------------------- the data listener


@dataclass
class Mesh:
    """Rank 0 of a two-rank connect_mesh, accepting in a thread; rank 1 is the test's to dial."""

    listener: socket.socket
    addresses: list[tuple[str, int]]
    token: bytes
    secret: Secret | None
    thread: threading.Thread
    out: dict[str, Any]

    @property
    def port(self) -> int:
        return self.addresses[0][1]

    def join_as_rank_1(self) -> float:
        """Dial rank 0 as the good rank 1; seconds until both sides are connected."""
        start = time.monotonic()
        with socket.create_server((LOCAL, 0)) as mine:
            socks = connect_mesh(
                1, 2, mine, self.addresses, self.token, time.monotonic() + 10.0, secret=self.secret
            )
        self.thread.join(timeout=10.0)
        took = time.monotonic() - start
        theirs = self.out.get("socks")
        assert isinstance(theirs, dict), self.out
        with socks[0], theirs[1]:
            socks[0].sendall(b"hi")
            assert theirs[1].recv(2, socket.MSG_WAITALL) == b"hi"
        return took


@pytest.fixture(params=MODES)
def mesh(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Mesh]:
    monkeypatch.setattr(mesh_module, "_HANDSHAKE_SECONDS", HANDSHAKE_SECONDS)
    secret = Secret(SECRET) if request.param == "secret" else None
    listener = socket.create_server((LOCAL, 0), backlog=64)
    addresses = [(LOCAL, int(listener.getsockname()[1])), (LOCAL, 0)]
    token = os.urandom(16)
    out: dict[str, Any] = {}

    def rank0() -> None:
        try:
            deadline = time.monotonic() + 120.0
            out["socks"] = connect_mesh(0, 2, listener, addresses, token, deadline, secret=secret)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=rank0)
    thread.start()
    state = Mesh(listener, addresses, token, secret, thread, out)
    try:
        yield state
    finally:
        if thread.is_alive():  # the test failed before rank 1 joined: let rank 0 finish
            try:
                state.join_as_rank_1()
            except BaseException:
                pass
        thread.join(timeout=10.0)
        listener.close()
        assert not thread.is_alive()


def mode_of_mesh(mesh: Mesh) -> str:
    return "open" if mesh.secret is None else "secret"


@pytest.mark.timeout(300)
def test_data_listener_random_bytes_and_magic_with_random_body(mesh: Mesh) -> None:
    rng = random.Random(3)
    starts = [b"", b"ARDH", b"ARDHAUTH", HELLO.pack(b"ARDH", VERSION, 1, 2, bytes(16))[:9]]
    payloads = (rng.choice(starts) + random_bytes(rng, 200) for _ in range(RUNS))
    runs, hangs = storm(mesh.port, payloads)
    assert hangs == 0
    assert mesh.join_as_rank_1() < 2.0
    summary(
        "data", mode_of_mesh(mesh), "random bytes / magic + random body", runs=runs, hangs=hangs
    )


@pytest.mark.timeout(120)
def test_data_listener_extreme_hello_fields(mesh: Mesh) -> None:
    """A HELLO has no length field; its numbers are still checked before anything trusts them."""
    hellos = [
        HELLO.pack(b"ARDH", VERSION, 0xFFFFFFFF, 0xFFFFFFFF, mesh.token),
        HELLO.pack(b"ARDH", VERSION, 1, 0xFFFFFFFF, mesh.token),
        HELLO.pack(b"ARDH", 255, 1, 2, mesh.token),
        HELLO.pack(b"ARDH", VERSION, 0, 2, mesh.token),  # a rank that is not higher: not expected
        HELLO.pack(b"ARDH", VERSION, 1, 2, bytes(16)),  # another job's token
    ]
    runs, hangs = storm(mesh.port, (h for _ in range(max(1, RUNS // 5)) for h in hellos))
    assert hangs == 0
    assert mesh.join_as_rank_1() < 2.0
    summary("data", mode_of_mesh(mesh), "extreme HELLO fields", runs=runs, hangs=hangs)


def test_a_hello_of_another_protocol_version_is_refused_by_name() -> None:
    token = bytes(range(16))
    assert mesh_module._check_hello(HELLO.pack(b"ARDH", VERSION, 1, 2, token), 2, token) == 1
    older = f"protocol version {VERSION - 1}, this rank {VERSION}"
    with pytest.raises(ConnectionError, match=older):
        mesh_module._check_hello(HELLO.pack(b"ARDH", VERSION - 1, 1, 2, token), 2, token)
    with pytest.raises(ConnectionError, match="not an asyncreduce peer"):
        mesh_module._check_hello(HELLO.pack(b"XXXX", VERSION, 1, 2, token), 2, token)


@pytest.mark.timeout(60)
def test_data_listener_slow_sender_holds_up_nobody(mesh: Mesh) -> None:
    hello = HELLO.pack(b"ARDH", VERSION, 1, 2, bytes(16))
    ended: dict[str, float] = {}

    def trickle() -> None:
        start = time.monotonic()
        with socket.create_connection((LOCAL, mesh.port), timeout=10.0) as sock:
            try:
                for byte in hello:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.1)
            except (ConnectionResetError, BrokenPipeError):
                pass
        ended["after"] = time.monotonic() - start

    thread = threading.Thread(target=trickle)
    thread.start()
    time.sleep(0.3)  # the slow one is in the middle of its handshake
    took = mesh.join_as_rank_1()
    thread.join(timeout=10.0)
    assert not thread.is_alive()
    assert took < 2.0
    # Hung up on before its 29-byte HELLO (2.9 s) was through: at the handshake deadline, or
    # sooner, when rank 0 is done; noticed by the first or second byte sent after that.
    assert ended["after"] < HANDSHAKE_SECONDS + 0.7, ended
    summary("data", mode_of_mesh(mesh), "slow sender", good_rank_joined_s=round(took, 3))


@pytest.mark.timeout(120)
def test_data_listener_idle_connections(mesh: Mesh) -> None:
    me = os.getpid()
    base = fds(me)
    idle = [socket.create_connection((LOCAL, mesh.port), timeout=5.0) for _ in range(IDLE)]
    try:
        time.sleep(0.2)  # rank 0 accepts them all
        # ours (IDLE) plus rank 0's (at most _MAX_PENDING + the one rank it waits for)
        peak = fds(me) - base - IDLE
        assert peak <= mesh_module._MAX_PENDING + 1 + 2, peak
        took = mesh.join_as_rank_1()
        assert took < 2.0
        for sock in idle:  # rank 0 hung up on every one of them once it was done
            sock.settimeout(5.0)
            try:
                assert sock.recv(16) == b""
            except ConnectionResetError:
                pass
    finally:
        for sock in idle:
            sock.close()
    summary("data", mode_of_mesh(mesh), "idle connections", runs=IDLE, peak_extra_fds=peak)


@pytest.mark.timeout(60)
def test_data_listener_pickle_payload(mesh: Mesh, tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    payload = evil_payload(target)
    assert throw(mesh.port, payload)
    assert throw(mesh.port, HELLO.pack(b"ARDH", VERSION, 1, 2, bytes(16)) + payload)
    assert throw(mesh.port, b"ARDHAUTH" + payload)
    assert mesh.join_as_rank_1() < 2.0
    created = target.exists()
    summary("data", mode_of_mesh(mesh), "pickle payload", file_created=created)
    assert not created


class Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.lost: list[BaseException] = []

    def frame_buffer(self, peer: int, header: Any) -> memoryview | None:
        return None

    def frame_view(self, peer: int, header: Any, view: memoryview) -> bool:
        return False

    def on_frame(self, peer: int, header: Any, payload: memoryview) -> None:
        self.frames.append(bytes(payload))

    def on_sent(self, token: object) -> None:
        pass

    def on_peer_lost(self, peer: int, error: BaseException) -> None:
        self.lost.append(error)


def test_data_frames_extreme_lengths_and_a_pickle_body(tmp_path: Path) -> None:
    """After the handshake, parse_header bounds every length before a byte is allocated."""
    target = tmp_path / "pwned"
    body = evil_payload(target)
    desc = Descriptor(1, 2, 1, 0, len(body))
    good = pack_header(DATA, b"op", 0, 0, 0, len(body), desc) + body
    fields = dict(magic=b"ARDC", version=1, type=DATA, name_len=0, step=0, seg=0, instance=0)
    extremes = [
        HEADER.pack(*fields.values(), (1 << 64) - 1, 1, 2, 1, 0, 0, 10),  # payload_len 2**64-1
        HEADER.pack(*list(fields.values())[:3], 0xFFFF, 0, 0, 0, 8, 1, 2, 1, 0, 0, 10),  # name
    ]
    for extreme in extremes:
        a, b = socket.socketpair()
        sink = Sink()
        transport = TcpTransport(0, {1: a}, sink)
        try:
            b.sendall(good + extreme)
            deadline = time.monotonic() + 5.0
            while not sink.lost and time.monotonic() < deadline:
                transport.poll(0.01)
            assert sink.frames == [body]  # delivered as bytes, never unpickled
            assert len(sink.lost) == 1 and isinstance(sink.lost[0], FrameError), sink.lost
        finally:
            transport.close()
            b.close()
    assert not target.exists()


# ---------------------------------------------------------------- the source itself


BANNED_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _call_hazard(call: ast.Call) -> str:
    """What is dangerous about one call, or ""."""
    func, keywords = call.func, {kw.arg: kw.value for kw in call.keywords}
    if isinstance(func, ast.Name) and func.id in BANNED_CALLS:
        return f"{func.id}()"
    if "allow_pickle" in keywords and _is_true(keywords["allow_pickle"]):
        return "allow_pickle=True"
    is_torch_load = (
        isinstance(func, ast.Attribute)
        and func.attr == "load"
        and isinstance(func.value, ast.Name)
        and func.value.id == "torch"
    )
    if is_torch_load and not _is_true(keywords.get("weights_only", ast.Constant(False))):
        return "torch.load without weights_only=True (it unpickles)"
    if any(isinstance(a, ast.Constant) and a.value in BANNED_MODULES for a in call.args):
        return "a dynamic import of a deserializer"
    return ""


def _hazard(node: ast.AST) -> str:
    """What is dangerous about one syntax node, or ""."""
    if isinstance(node, ast.Import):
        return ", ".join(sorted({a.name.split(".")[0] for a in node.names} & BANNED_MODULES))
    if isinstance(node, ast.ImportFrom) and node.module:
        return node.module if node.module.split(".")[0] in BANNED_MODULES else ""
    if isinstance(node, ast.Call):
        return _call_hazard(node)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id if node.value.id in BANNED_MODULES else ""
    return ""


def dangerous(source: str, filename: str = "<source>") -> list[str]:
    """Every import or use of a deserializer or evaluator in ``source``, as 'file:line: what'."""
    return [
        f"{filename}:{getattr(node, 'lineno', '?')}: {what}"
        for node in ast.walk(ast.parse(source, filename))
        if (what := _hazard(node))
    ]


def test_the_scan_finds_what_it_looks_for() -> None:
    bad = (
        "import pickle\nfrom marshal import loads\nimport shelve as s\neval('1')\nexec('x')\n"
        "np.load(f, allow_pickle=True)\ntorch.load(f)\nimportlib.import_module('pickle')\n"
    )
    assert len(dangerous(bad)) == 8, dangerous(bad)
    fine = "import json\nre.compile('x')\ntorch.load(f, weights_only=True)\nx = 'pickle'\n"
    assert dangerous(fine) == []


def test_no_pickle_marshal_shelve_eval_or_exec_in_the_package() -> None:
    root = Path(asyncreduce.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 10
    found = [hit for path in files for hit in dangerous(path.read_text(), str(path))]
    assert found == [], "\n".join(found)
