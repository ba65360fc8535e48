"""On this host, a connection's other end must belong to this user: loopback is no boundary.

Without a secret, another user of the host could take the rendezvous port first (ports derived
from the job id are predictable: mpirun on one host, srun) and serve a store of their own; the
ranks would then join that user. The store client, the store server and every rank's data
listener therefore look up who owns the other end of a connection on this host and refuse
another user, naming the uid. Tests that start a process of another user (uid 65534) need
root; the others fake the lookup.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

import asyncreduce as ar
from asyncreduce.errors import UsageError
from asyncreduce.rendezvous import TCPStore
from asyncreduce.transport import owner
from asyncreduce.transport.mesh import _hello, connect_mesh
from spmd import free_port

LOCAL = "127.0.0.1"
NOBODY = 65534
_CTX = mp.get_context("spawn")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="starts a process of another user")


@pytest.fixture(autouse=True)
def no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCREDUCE_SECRET", raising=False)
    monkeypatch.delenv("ASYNCREDUCE_SECRET_FILE", raising=False)


def _as_nobody(body: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    """``body(*args)`` in a process of uid 65534; its outcome (or error) goes to ``out``.
    What it will import is imported first: this user may not read root's Python."""
    import encodings.idna  # noqa: F401 (socket.create_connection's host names)

    import asyncreduce.bootstrap  # noqa: F401

    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        out.put(("ok", body(*args)))
    except BaseException as exc:
        out.put((type(exc).__name__, str(exc)))


def _nobody(body: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    out = _CTX.Queue()
    proc = _CTX.Process(target=_as_nobody, args=(body, args, out), daemon=True)
    proc.start()
    return proc, out


def _stop(proc: Any, out: Any) -> None:
    proc.kill()
    proc.join()
    out.close()
    out.join_thread()


def _impostor_rank0(port: int) -> str:
    """Another user's rank 0: it serves the store on the job's port and waits for rank 1."""
    os.environ["ASYNCREDUCE_SHM"] = "0"  # shared memory would fail on the owner: join on TCP
    with ar.init(0, 2, LOCAL, port, timeout=30) as comm:
        return f"rank 1 joined uid {os.getuid()} (world {comm.world_size})"


def _rank1(port: int, out: Any) -> None:
    try:
        with ar.init(1, 2, LOCAL, port, timeout=10) as comm:
            out.put(("joined", f"joined another user's job (world {comm.world_size})"))
    except BaseException as exc:
        out.put((type(exc).__name__, str(exc)))


@as_root
@pytest.mark.timeout(60)
def test_a_rank_refuses_a_store_that_another_user_serves_on_its_port() -> None:
    """The squatter of a derived port: a fake store (another user's rank 0) on loopback; this
    user's rank 1 has no secret. It must fail with a UsageError naming the uid, not join."""
    port = free_port()
    impostor, told = _nobody(_impostor_rank0, port)
    out = _CTX.Queue()
    rank1 = _CTX.Process(target=_rank1, args=(port, out), daemon=True)
    rank1.start()
    try:
        outcome, message = out.get(timeout=40)
        assert outcome == "UsageError", (outcome, message)
        assert f"uid {NOBODY}" in message and "another user" in message, message
        try:
            ended = told.get(timeout=0.5)
        except queue.Empty:
            ended = None  # the impostor has nobody: it still waits for rank 1
        assert ended is None, f"the impostor's init ended: {ended}"
    finally:
        rank1.kill()
        rank1.join()
        _stop(impostor, told)
        out.close()
        out.join_thread()


def _greet_store(port: int) -> bytes:
    with socket.create_connection((LOCAL, port), timeout=5) as sock:
        sock.sendall(b"ARSTORE1")
        try:
            return sock.recv(8)
        except ConnectionResetError:
            return b""


def _dial_as_rank1(port: int, token: bytes, sent: Any) -> bytes:
    with socket.create_connection((LOCAL, port), timeout=5) as sock:
        sock.sendall(_hello(1, 2, token))
        sent.set()
        try:
            return sock.recv(64)
        except ConnectionResetError:
            return b""


@as_root
@pytest.mark.timeout(60)
def test_the_store_server_drops_another_users_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncreduce")
    with TCPStore(LOCAL, 0, is_server=True, timeout=5.0, secret=None) as store:
        proc, out = _nobody(_greet_store, store.port)
        try:
            assert out.get(timeout=30) == ("ok", b""), "the store answered another user"
        finally:
            _stop(proc, out)
        store.set("still", b"served")
        assert store.get("still") == b"served"
    drops = [r.getMessage() for r in caplog.records if "another user" in r.getMessage()]
    assert len(drops) == 1 and f"uid {NOBODY}" in drops[0], caplog.text


@as_root
@pytest.mark.timeout(60)
def test_a_data_listener_drops_another_users_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncreduce")
    token = os.urandom(16)
    with socket.create_server((LOCAL, 0)) as sock:
        port = sock.getsockname()[1]
        sent = _CTX.Event()
        proc, out = _nobody(_dial_as_rank1, port, token, sent)
        try:
            assert sent.wait(30)  # its HELLO waits in the listener's queue
            with pytest.raises(TimeoutError, match="rank 1 never connected.*another user: 1"):
                connect_mesh(0, 2, sock, [(LOCAL, port)] * 2, token, time.monotonic() + 1,
                             secret=None)  # fmt: skip
            assert out.get(timeout=30) == ("ok", b""), "rank 0 answered another user's HELLO"
        finally:
            _stop(proc, out)
    drops = [r.getMessage() for r in caplog.records if "another user" in r.getMessage()]
    assert len(drops) == 1 and f"uid {NOBODY}" in drops[0], caplog.text


# ---------------------------------------------------------------- any user: the lookup itself


def test_both_ends_of_a_loopback_connection_are_found_and_are_this_user() -> None:
    with socket.create_server((LOCAL, 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            assert owner.peer_uid(client) == owner.peer_uid(accepted) == os.geteuid()
            assert owner.other_user(accepted, held=True) is None
            owner.check_peer_user(client, "the store")  # no error: this user
            ends = [(owner._address(host), port) for host, port in
                    (accepted.getsockname(), accepted.getpeername())]  # fmt: skip
            for ask in (owner._diag, owner._table):  # the fast way and the slow one agree
                assert ask(*ends) == (os.geteuid(), os.fstat(accepted.fileno()).st_ino)
                assert ask(*ends[::-1]) == (os.geteuid(), os.fstat(client.fileno()).st_ino)
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as server:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
        with client, accepted:
            assert owner.peer_uid(client) == owner.peer_uid(accepted) == os.geteuid()


def test_a_client_that_closed_before_it_was_accepted_is_refused_unread() -> None:
    """Its bytes could be anyone's: a socket no process holds no longer says whose it was."""
    with socket.create_server((LOCAL, 0)) as server:
        hit = socket.create_connection(server.getsockname())
        hit.sendall(b"ARSTORE1")
        hit.close()
        time.sleep(0.05)  # its FIN arrives: the socket is an orphan, then a time-wait remnant
        accepted, _ = server.accept()
        with accepted:
            assert owner.other_user(accepted, held=True) == (
                "no process (its socket is closed or gone)"
            )
            assert owner.other_user(accepted) is None  # a client does not ask this


def test_another_users_end_is_refused_by_the_client_and_the_server(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncreduce")
    stranger = os.geteuid() + 4242
    with TCPStore(LOCAL, 0, is_server=True, timeout=5.0, secret=None) as store:
        monkeypatch.setattr(owner, "_lookup", lambda sock: (True, (stranger, 7)))
        start = time.monotonic()
        refused = rf"another user of this host \(uid {stranger}"
        with pytest.raises(UsageError, match=refused) as info:
            TCPStore(LOCAL, store.port, is_server=False, timeout=5.0, secret=None)
        assert time.monotonic() - start < 2.0  # not retried: it is no transient failure
        assert "ASYNCREDUCE_SECRET" in str(info.value)
        assert _greet_store(store.port) == b"", "the server answered another user"
    assert f"another user: its end belongs to uid {stranger}" in caplog.text


def _derived_port_serve(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    from asyncreduce.bootstrap.stores import open_store
    from asyncreduce.launchers import detect

    place = detect(env=env)
    assert place.rendezvous.derived, place
    port = free_port()
    place = type(place)(0, place.world_size, 0, place.world_size, place.launcher,
                        type(place.rendezvous)("serve", LOCAL, port, derived=True))  # fmt: skip
    store, serving = open_store(place, 5.0)
    store.close()
    assert serving


@pytest.mark.parametrize(
    "env",
    [
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
         "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
         "OMPI_MCA_ess_base_jobid": "123456"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4242",
         "SLURM_STEP_NODELIST": "node1", "SLURM_STEP_TASKS_PER_NODE": "2"},
    ],
    ids=["mpirun on one host", "srun"],
)  # fmt: skip
def test_a_port_derived_from_the_job_id_without_a_secret_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, env: dict[str, str]
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncreduce")
    _derived_port_serve(monkeypatch, env)
    warnings = [r.getMessage() for r in caplog.records if "SECURITY" in r.getMessage()]
    assert len(warnings) == 1 and "derived from the job id" in warnings[0], caplog.text
    assert "ASYNCREDUCE_SECRET" in warnings[0]
    caplog.clear()
    monkeypatch.setenv("ASYNCREDUCE_SECRET", "s3cret")
    _derived_port_serve(monkeypatch, env)
    assert "SECURITY" not in caplog.text
    with_port = {**env, "MASTER_PORT": "2345", "MASTER_ADDR": LOCAL}
    from asyncreduce.launchers import detect

    assert not detect(env=with_port).rendezvous.derived  # a port someone chose
