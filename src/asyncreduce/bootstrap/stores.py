"""Opening the job's store: ours served by rank 0, torchrun's agent store, a file store, or
ours with its address sent through MPI (which launcher said what: launchers.py)."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

from ..auth import secret_from_env
from ..errors import UsageError
from ..launchers import Place
from ..rendezvous import Store, TCPStore, store_from_env_or_args

__all__ = ["open_store"]

log = logging.getLogger("asyncreduce.comm")


def open_store(place: Place, timeout: float) -> tuple[Store, bool]:
    """The store of this job, and whether this rank serves it."""
    meeting, rank = place.rendezvous, place.rank
    if meeting.kind == "url":
        return store_from_env_or_args(rank, place.world_size, None, None, meeting.url,
                                      timeout), rank == 0  # fmt: skip
    if meeting.kind == "agent":
        from ..c10d_store import torchrun_store

        assert meeting.host is not None and meeting.port is not None
        return torchrun_store(meeting.host, meeting.port, timeout), False
    if meeting.kind == "mpi":
        return _store_through_mpi(place, timeout), rank == 0
    assert meeting.host is not None and meeting.port is not None
    if meeting.derived:
        _warn_derived(place, meeting.host, meeting.port)
    return TCPStore(meeting.host, meeting.port, is_server=rank == 0, timeout=timeout), rank == 0


def _warn_derived(place: Place, host: str, port: int) -> None:
    """Without a secret, warn that a port derived from the job id can be taken first."""
    if secret_from_env() is not None:
        return
    log.warning(
        "SECURITY: the ranks meet at %s:%d, a port derived from the job id (%s): another user "
        "of a host of this job can predict it and serve a store of their own there first. A "
        "rank refuses a store or a rank of another user on its own host, but no rank on "
        "another host can tell. Set ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE) on every "
        "rank; MASTER_PORT chooses the port", host, port, place.launcher,
    )  # fmt: skip


def _store_through_mpi(place: Place, timeout: float) -> TCPStore:
    """mpirun across hosts: rank 0 serves a store on its own address and tells the others
    where through one MPI broadcast of a fixed-size byte buffer (nothing pickled)."""
    from mpi4py import MPI  # initializes MPI if the program has not

    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (place.rank, place.world_size):
        raise UsageError(
            f"{place.launcher} says rank {place.rank} of {place.world_size} but MPI's "
            f"COMM_WORLD says rank {world.Get_rank()} of {world.Get_size()}"
        )
    where = bytearray(256)
    store = None
    if place.rank == 0:
        host = os.environ.get("ASYNCREDUCE_ADDR") or _host_addresses()[0]
        store = TCPStore(host, 0, is_server=True, timeout=timeout)
        where[:] = f"{host} {store.port}".encode().ljust(len(where), b"\0")
    world.Bcast([where, MPI.BYTE], root=0)
    if store is not None:
        return store
    host, port = bytes(where).rstrip(b"\0").decode().split()
    return TCPStore(host, int(port), is_server=False, timeout=timeout)


def _host_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback last (SIOCGIFADDR on every interface)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name[:15].encode())
            try:
                reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(socket.inet_ntoa(reply[20:24]))
    return sorted(found, key=lambda address: address.startswith("127.")) or ["127.0.0.1"]
