"""Authentication with a shared secret: real processes, real sockets, every wait bounded.

What is shown: a job whose ranks share the secret works; a rank with a wrong secret, no secret,
or a secret the others lack makes the job fail fast with an error that names authentication,
on the store and on the data connections; a secret file that others may read is refused; a
flood of missing, wrong and replayed answers is rejected, logged in a few lines, and leaves the
store serving; the secret shows up in no repr, exception or log line.

``ASYNCREDUCE_FUZZ_SCALE`` (default 1) multiplies the number of hostile attempts (1,000 at 1).
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncreduce as ar
from asyncreduce.auth import (
    ANSWER_BYTES,
    REJECTED,
    AuthenticationError,
    ClientHandshake,
    Secret,
    secret_from_env,
)
from asyncreduce.errors import UsageError
from asyncreduce.rendezvous import _CONTEXT, TCPStore
from asyncreduce.transport.mesh import connect_mesh
from spmd import free_port

LOCAL = "127.0.0.1"
SECRET = "s3cret-" + secrets.token_hex(8)  # distinctive, so a leak is easy to find
OTHER = "0ther-" + secrets.token_hex(8)
SCALE = int(os.environ.get("ASYNCREDUCE_FUZZ_SCALE", "1"))
JOB_TIMEOUT = 5.0  # init timeout in the failing jobs: the side that cannot tell waits this long
MAGIC, MAGIC_AUTH = b"ARSTORE1", b"ARSTOREA"
_CTX = mp.get_context("spawn")


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCREDUCE_SECRET", raising=False)
    monkeypatch.delenv("ASYNCREDUCE_SECRET_FILE", raising=False)


def leaks(*texts: str) -> list[str]:
    """The texts that contain either secret (there should be none)."""
    return [t for t in texts if SECRET in t or OTHER in t]


# ---------------------------------------------------------------- where the secret comes from


def secret_file(tmp_path: Path, mode: int, text: str = SECRET + "\n") -> str:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_secret_from_the_environment_or_an_owner_only_file(tmp_path: Path) -> None:
    assert secret_from_env({}) is None
    assert secret_from_env({"ASYNCREDUCE_SECRET": ""}) is None
    from_text = secret_from_env({"ASYNCREDUCE_SECRET": SECRET})
    from_file = secret_from_env({"ASYNCREDUCE_SECRET_FILE": secret_file(tmp_path, 0o600)})
    assert from_text is not None and from_file is not None
    nonce = bytes(32)
    # the editor's newline is not part of the secret: both give the same proofs
    assert from_text.proof(b"c", b"r", nonce, nonce) == from_file.proof(b"c", b"r", nonce, nonce)
    assert leaks(repr(from_text), str(from_file)) == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_secret_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = secret_file(tmp_path, mode)
    with pytest.raises(UsageError, match=f"chmod 600 {path}") as info:
        secret_from_env({"ASYNCREDUCE_SECRET_FILE": path})
    assert f"mode {mode:04o}" in str(info.value)
    assert leaks(str(info.value)) == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ASYNCREDUCE_SECRET": "a", "ASYNCREDUCE_SECRET_FILE": "/x"}, "set only one"),
        ({"ASYNCREDUCE_SECRET_FILE": "/nonexistent/secret"}, "cannot read"),
        ({"ASYNCREDUCE_SECRET_FILE": "/"}, "cannot read|not a regular file"),
    ],
)
def test_bad_secret_settings_say_what_to_do(env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        secret_from_env(env)


def test_an_empty_secret_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is empty"):
        secret_from_env({"ASYNCREDUCE_SECRET_FILE": secret_file(tmp_path, 0o600, "\n")})


# ---------------------------------------------------------------- jobs of real processes


def _rank_main(
    rank: int, n: int, where: str, env: dict[str, str], timeout: float, out: Any
) -> None:
    os.environ.update(env)
    logs = io.StringIO()
    logger = logging.getLogger("asyncreduce")
    logger.addHandler(logging.StreamHandler(logs))
    logger.setLevel(logging.DEBUG)
    start = time.monotonic()
    try:
        with ar.init(rank, n, init_method=where, timeout=timeout) as comm:
            x = np.full(5, rank + 1.0)
            comm.allreduce(x)
            result = ("ok", repr(x.tolist()), repr(comm))
    except BaseException as exc:
        result = (type(exc).__name__, str(exc), repr(exc))
    out.put((rank, result, time.monotonic() - start, logs.getvalue()))


def run_job(
    where: str, envs: list[dict[str, str]], timeout: float = JOB_TIMEOUT
) -> dict[int, tuple[Any, float, str]]:
    """Run one rank per env; {rank: ((outcome, message, repr), seconds in init, its logs)}."""
    out = _CTX.Queue()
    procs = [
        _CTX.Process(target=_rank_main, args=(r, len(envs), where, env, timeout, out), daemon=True)
        for r, env in enumerate(envs)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[Any, float, str]] = {}
    deadline = time.monotonic() + timeout + 30.0  # spawn and import, then init's timeout
    try:
        while len(results) < len(procs):
            try:
                rank, result, seconds, logs = out.get(
                    timeout=max(0.01, deadline - time.monotonic())
                )
            except queue.Empty:
                raise AssertionError(f"ranks hung; finished: {sorted(results)}") from None
            results[rank] = (result, seconds, logs)
    finally:
        _reap(procs, out)
    return results


def store_url(tmp_path: Path, plane: str) -> str:
    """The store plane is authenticated TCP; a file store's values are signed (the ranks
    that share the secret meet in it and connect over the authenticated data plane)."""
    return f"tcp://{LOCAL}:{free_port()}" if plane == "store" else f"file://{tmp_path}/store"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("plane", ["store", "file"])
def test_ranks_that_share_the_secret_allreduce(tmp_path: Path, plane: str) -> None:
    path = secret_file(tmp_path, 0o600)
    envs = [{"ASYNCREDUCE_SECRET": SECRET}, {"ASYNCREDUCE_SECRET_FILE": path}] + [
        {"ASYNCREDUCE_SECRET": SECRET}
    ]
    results = run_job(store_url(tmp_path, plane), envs, timeout=30.0)
    for rank, ((outcome, message, comm_repr), _, logs) in results.items():
        assert outcome == "ok", f"rank {rank}: {message}"
        assert message == repr([6.0] * 5)
        assert "dropping connection" not in logs and "SECURITY" not in logs
        assert leaks(message, comm_repr, logs) == []


MISMATCHES = {
    "wrong secret": ({"ASYNCREDUCE_SECRET": SECRET}, {"ASYNCREDUCE_SECRET": OTHER}),
    "no secret on rank 1": ({"ASYNCREDUCE_SECRET": SECRET}, {}),
    "secret only on rank 1": ({}, {"ASYNCREDUCE_SECRET": OTHER}),
}
CAUSE = {  # what rank 0 (store server / data acceptor) names as the reason it dropped rank 1
    "wrong secret": "wrong or replayed secret",
    "no secret on rank 1": "no secret",
    "secret only on rank 1": "unexpected secret",
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("plane", ["store", "file"])
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_rank_that_disagrees_about_the_secret_fails_the_job_fast(
    tmp_path: Path, plane: str, case: str
) -> None:
    results = run_job(store_url(tmp_path, plane), list(MISMATCHES[case]))
    (outcome1, message1, repr1), seconds1, logs1 = results[1]
    assert outcome1 == "AuthenticationError", message1
    assert "authenticat" in message1 and "ASYNCREDUCE_SECRET" in message1
    assert seconds1 < JOB_TIMEOUT - 2.0  # the side that can tell fails at once: no waiting
    (outcome0, message0, repr0), seconds0, logs0 = results[0]
    assert outcome0 == "TimeoutError", message0  # rank 0 cannot tell: it waits for rank 1
    assert seconds0 < JOB_TIMEOUT + 2.0
    if plane == "store":
        assert "1 never" in message0 and f"dropped 1 connection ({CAUSE[case]}: 1)" in message0
        assert logs0.count("dropping connection from 127.0.0.1:") == 1
    else:  # rank 1 finds it in the signed values of the file store, before any connection
        assert "rank 1 never joined" in message0 and "dropping connection" not in logs0
        assert "value of 'asyncreduce/world'" in message1, message1
    assert leaks(message0, message1, repr0, repr1, logs0, logs1) == []
    print(f"\nAUTH {plane} {case}: rank 1 failed in {seconds1:.2f} s, rank 0 in {seconds0:.2f} s")


# ---------------------------------------------------------------- the data plane, in threads


def mesh_pair(secrets_: tuple[Secret | None, Secret | None], seconds: float) -> dict[int, Any]:
    """Rank 0 accepts, rank 1 dials (each in a thread); {rank: sockets or the exception}."""
    token = os.urandom(16)
    listeners = [socket.create_server((LOCAL, 0)) for _ in range(2)]
    addresses = [(LOCAL, int(s.getsockname()[1])) for s in listeners]
    deadline = time.monotonic() + seconds
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            out[r] = connect_mesh(
                r, 2, listeners[r], addresses, token, deadline, secret=secrets_[r]
            )
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 5.0)
    for s in listeners:
        s.close()
    assert not any(t.is_alive() for t in threads), "connect_mesh hung"
    return out


def test_the_mesh_with_one_secret_connects_and_carries_bytes() -> None:
    out = mesh_pair((Secret(SECRET), Secret(SECRET)), 5.0)
    a, b = out[0][1], out[1][0]
    with a, b:
        a.sendall(b"ping")
        assert b.recv(4, socket.MSG_WAITALL) == b"ping"


@pytest.mark.parametrize(
    ("acceptor", "dialer", "cause"),
    [
        (SECRET, OTHER, "wrong or replayed"),
        (SECRET, None, "no secret"),
        (None, SECRET, "unexpected"),
    ],
)
def test_the_mesh_refuses_a_peer_that_disagrees(
    acceptor: str | None, dialer: str | None, cause: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncreduce")
    start = time.monotonic()
    out = mesh_pair((acceptor and Secret(acceptor), dialer and Secret(dialer)), 1.5)
    assert isinstance(out[1], AuthenticationError), out[1]
    assert isinstance(out[0], TimeoutError) and cause in str(out[0]), out[0]
    assert time.monotonic() - start < 3.0
    assert leaks(str(out[0]), str(out[1]), caplog.text) == []


# ---------------------------------------------------------------- the store, under attack


@pytest.fixture
def guarded(caplog: pytest.LogCaptureFixture) -> Iterator[TCPStore]:
    """A live store server with the secret, holding one key."""
    caplog.set_level(logging.DEBUG, logger="asyncreduce")
    with TCPStore(LOCAL, 0, is_server=True, timeout=5.0, secret=Secret(SECRET)) as store:
        store.set("kept", b"data")
        yield store


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    assert len(data) == n, data
    return data


def challenged(port: int) -> tuple[socket.socket, bytes]:
    """A raw connection that asked to authenticate; returns it and the server's nonce."""
    sock = socket.create_connection((LOCAL, port), timeout=5.0)
    sock.sendall(MAGIC_AUTH)
    head = recv_exact(sock, 40)
    assert head[:8] == MAGIC_AUTH
    return sock, head[8:]


def eavesdropped_answer(port: int) -> bytes:
    """A genuine client's answer, as someone watching the wire would record it."""
    sock, nonce = challenged(port)
    with sock:
        answer = ClientHandshake(Secret(SECRET), _CONTEXT).answer(nonce)
        sock.sendall(answer)
        assert recv_exact(sock, 32) != REJECTED
    return answer


def attempt(port: int, kind: str, replay: bytes) -> None:
    """One bad attempt; asserts the server refused it and hung up."""
    if kind == "no secret":
        with socket.create_connection((LOCAL, port), timeout=5.0) as sock:
            sock.sendall(MAGIC)
            assert recv_exact(sock, 8) == MAGIC_AUTH
            sock.recv(64)  # the rest of the challenge, then EOF
            assert sock.recv(64) == b""
        return
    sock, nonce = challenged(port)
    with sock:
        if kind == "missing answer":
            return  # hang up instead of answering
        answers = {
            "wrong secret": lambda: ClientHandshake(Secret(OTHER), _CONTEXT).answer(nonce),
            "random answer": lambda: os.urandom(ANSWER_BYTES),
            "replayed answer": lambda: replay,
        }
        sock.sendall(answers[kind]())
        assert recv_exact(sock, 32) == REJECTED
        assert sock.recv(64) == b""


KINDS = ["missing answer", "wrong secret", "random answer", "replayed answer", "no secret"]


@pytest.mark.timeout(300)
def test_a_thousand_bad_attempts_are_rejected_and_logged_in_a_few_lines(
    guarded: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    replay = eavesdropped_answer(guarded.port)
    total = 1000 * SCALE
    start = time.monotonic()
    for i in range(total):
        attempt(guarded.port, KINDS[i % len(KINDS)], replay)
    assert guarded._server is not None
    counts = guarded._server.rejections.counts
    deadline = time.monotonic() + 5.0
    while sum(counts.values()) < total and time.monotonic() < deadline:
        time.sleep(0.01)  # the server may still be reading the last hang-ups
    assert counts == {
        "no answer": total // 5,
        "wrong or replayed secret": 3 * total // 5,
        "no secret": total // 5,
    }
    with TCPStore(LOCAL, guarded.port, is_server=False, secret=Secret(SECRET)) as client:
        assert client.get("kept") == b"data"  # good clients are still served
    loud = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(loud) == 3, [r.getMessage() for r in loud]  # one line per cause, not per attempt
    assert leaks(caplog.text) == []
    print(f"{total} bad attempts rejected in {time.monotonic() - start:.1f} s")


def test_clients_that_disagree_fail_at_once_with_a_clear_error(
    guarded: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[BaseException] = []
    for secret in (Secret(OTHER), None):
        start = time.monotonic()
        with pytest.raises(AuthenticationError, match="authenticat") as info:
            TCPStore(LOCAL, guarded.port, is_server=False, timeout=10.0, secret=secret)
        assert time.monotonic() - start < 1.0  # not retried until the timeout
        errors.append(info.value)
    assert "rejected this rank's secret" in str(errors[0])
    assert "has no secret" in str(errors[1])
    with (
        TCPStore(LOCAL, 0, is_server=True, timeout=5.0, secret=None) as open_store,
        pytest.raises(AuthenticationError, match="does not authenticate"),
    ):
        TCPStore(LOCAL, open_store.port, is_server=False, timeout=10.0, secret=Secret(OTHER))
    texts = [str(e) for e in errors] + [repr(e) for e in errors] + [caplog.text]
    assert leaks(*texts) == []


def test_the_secret_is_in_no_repr(guarded: TCPStore) -> None:
    with TCPStore(LOCAL, guarded.port, is_server=False, secret=Secret(SECRET)) as client:
        texts = [repr(guarded), repr(client), repr(vars(guarded)), repr(vars(client))]
        texts += [repr(vars(client._client)), repr(Secret(SECRET)), str(Secret(SECRET))]
        assert "authenticated" in repr(client)
    assert leaks(*texts) == []


# ---------------------------------------------------------------- where listeners bind


def test_listening_on_every_interface_without_a_secret_warns_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncreduce")
    with TCPStore("0.0.0.0", 0, is_server=True, timeout=5.0, secret=None):
        pass
    with socket.create_server(("0.0.0.0", 0)) as listener:
        connect_mesh(0, 1, listener, [], b"t" * 16, time.monotonic() + 1, secret=None)
    warnings = [r.getMessage() for r in caplog.records if "SECURITY" in r.getMessage()]
    assert len(warnings) == 2, caplog.text
    assert all("all interfaces" in w and "ASYNCREDUCE_SECRET" in w for w in warnings)
    caplog.clear()
    with TCPStore("0.0.0.0", 0, is_server=True, timeout=5.0, secret=Secret(SECRET)):
        pass
    with TCPStore(LOCAL, 0, is_server=True, timeout=5.0, secret=None):
        pass
    assert "SECURITY" not in caplog.text


# ---------------------------------------------------------------- a store the secret does not guard

OUTSIDER = "an outsider wrote this: stop the job"
NAMESPACE = "asyncreduce/0/0/"  # the first init of a process in torchrun's store (bootstrap)


def _torch_store_rank(rank: int, port: int, secret: str, timeout: float, out: Any) -> None:
    """A rank of a torchrun job with a secret: it meets the others in the agent's store."""
    os.environ.update(
        TORCHELASTIC_RUN_ID="t", TORCHELASTIC_USE_AGENT_STORE="True", RANK=str(rank),
        WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR=LOCAL,
        MASTER_PORT=str(port), ASYNCREDUCE_SECRET=secret,
    )  # fmt: skip
    try:
        with ar.init(timeout=timeout) as comm:
            x = np.full(3, rank + 1.0)
            comm.allreduce(x)
            result = ("ok", repr(x.tolist()))
    except BaseException as exc:
        result = (type(exc).__name__, str(exc))
    out.put((rank, result))


@pytest.fixture
def torch_stores() -> Iterator[list[Any]]:
    """Torch TCPStores the test makes (the agent's, the outsider's), closed after it."""
    pytest.importorskip("torch.distributed")
    stores: list[Any] = []
    yield stores
    stores.clear()  # torch closes a store when its last reference goes
    import gc

    gc.collect()


def _torch_store(stores: list[Any], port: int = 0) -> Any:
    """port 0: the store torchrun's agent serves (torch's TCPStore: no authentication of its
    own); else a client of it with no secret: anyone who reaches the port."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(LOCAL, port, is_master=port == 0, timeout=timedelta(seconds=30),
                          wait_for_workers=False)  # fmt: skip
    stores.append(store)
    return store


def _start(rank: int, port: int, out: Any) -> Any:
    proc = _CTX.Process(target=_torch_store_rank, args=(rank, port, SECRET, JOB_TIMEOUT, out),
                        daemon=True)  # fmt: skip
    proc.start()
    return proc


def _reap(procs: list[Any], out: Any) -> None:
    """Join the rank processes (killing any still alive after 5 s) and close their queue."""
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()
    out.close()
    out.join_thread()


def _results(out: Any, procs: list[Any], seconds: float) -> dict[int, tuple[str, str]]:
    results: dict[int, tuple[str, str]] = {}
    try:
        while len(results) < len(procs):
            rank, result = out.get(timeout=seconds)
            results[rank] = result
    finally:
        _reap(procs, out)
    return results


@pytest.mark.timeout(90)
def test_ranks_with_a_secret_meet_in_torchs_store_and_sign_what_they_write(
    torch_stores: list[Any],
) -> None:
    port = _torch_store(torch_stores).port
    out = _CTX.Queue()
    results = _results(out, [_start(r, port, out) for r in (0, 1)], 60)
    assert results == {r: ("ok", "[3.0, 3.0, 3.0]") for r in (0, 1)}, results
    token = bytes(_torch_store(torch_stores, port).get(NAMESPACE + "token"))
    assert token.startswith(b"ARSIGNED") and len(token) == 8 + 32 + 16  # signed, not hidden


@pytest.mark.timeout(90)
def test_an_outsider_who_writes_torchs_store_makes_init_fail_with_authentication_error(
    torch_stores: list[Any],
) -> None:
    """With a secret, torch's store (no authentication of its own) carries only signed values:
    an outsider's ``abort`` and a forged address of rank 0 end init with AuthenticationError on
    each rank that reads them, never with the outsider's text and never by joining."""
    port = _torch_store(torch_stores).port
    outsider = _torch_store(torch_stores, port)
    outsider.set(NAMESPACE + "abort", OUTSIDER.encode())  # read by a rank that waits over 1 s
    out = _CTX.Queue()
    first = _start(0, port, out)  # rank 0 waits for rank 1 and looks at "abort"
    deadline = time.monotonic() + 40
    while not outsider.check([NAMESPACE + "addr/0"]):
        assert time.monotonic() < deadline, "rank 0 never published its address"
        time.sleep(0.01)
    outsider.set(NAMESPACE + "addr/0", b"127.0.0.1:1")  # rank 1 would dial the outsider's pick
    # rank 0 looks at "abort" once it waited 1 s for rank 1's address: rank 1 must not publish
    # it sooner (a quick start did, 1 run in 10 on an idle machine: rank 0 went on and timed
    # out waiting for rank 1 to connect)
    time.sleep(1.5)
    results = _results(out, [first, _start(1, port, out)], 60)
    for rank, (outcome, message) in sorted(results.items()):
        assert OUTSIDER not in message, (rank, outcome, message)
        assert outcome == "AuthenticationError", (rank, outcome, message)
        assert "secret" in message and not leaks(message), (rank, message)


def test_a_store_without_authentication_of_its_own_gets_signed_values(tmp_path: Path) -> None:
    """What ``signed`` stores and refuses, over a file store (guarded only by permissions)."""
    from asyncreduce.rendezvous import FileStore, PrefixStore
    from asyncreduce.rendezvous.signed import signed

    raw = FileStore(str(tmp_path / "store"), timeout=1.0)
    store = signed(PrefixStore("ns/", raw), Secret(SECRET))
    store.set("addr/0", b"127.0.0.1:5000")
    assert store.get("addr/0") == b"127.0.0.1:5000"
    assert raw.get("ns/addr/0").endswith(b"127.0.0.1:5000") and len(raw.get("ns/addr/0")) == 54
    raw.set("ns/abort", OUTSIDER.encode())  # written by someone without the secret
    raw.set("ns/addr/1", raw.get("ns/addr/0"))  # a signed value moved to another key
    raw.set("other/addr/0", raw.get("ns/addr/0"))  # ... and to another namespace
    for forged, where in [("abort", store), ("addr/1", store),
                          ("addr/0", signed(PrefixStore("other/", raw), Secret(SECRET))),
                          ("addr/0", signed(PrefixStore("ns/", raw), Secret(OTHER))),
                          ("addr/0", signed(PrefixStore("ns/", raw), None))]:  # fmt: skip
        with pytest.raises(AuthenticationError, match="authentication failed.*ASYNCREDUCE_SECRET"):
            where.get(forged)
    plain = signed(raw, None)  # no secret: values as they are, and an unsigned one is fine
    plain.set("plain", b"x")
    assert raw.get("plain") == b"x" == plain.get("plain")
    with pytest.raises(AuthenticationError) as info:
        store.get("abort")
    assert OUTSIDER not in str(info.value) and not leaks(str(info.value), repr(store))
    with TCPStore(LOCAL, 0, is_server=True, timeout=5.0, secret=Secret(SECRET)) as ours:
        assert signed(PrefixStore("ns/", ours), Secret(SECRET)).store is ours  # it proves it
