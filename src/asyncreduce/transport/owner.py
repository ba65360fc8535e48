"""Who owns the other end of a TCP connection on this host: one user's ranks, not another's.

Theory of operation. Loopback (and this host's own address) is open to every user of the host,
and without a secret nothing else tells a rank from another user's process on a port it took
first (a port derived from the job id is predictable). ``SO_PEERCRED`` answers for Unix
sockets only (for TCP it says uid -1), so the kernel is asked who holds the other end's
socket: sock_diag, one exact netlink lookup (about 12 us), or where that is missing
/proc/net/tcp{,6} (every socket of the namespace: 10 ms with 10,000 open). Our own end is looked
up first and must be found, else that way of asking does not work here and nothing is said.
``other_user`` is the verdict a server (listener.py) and ``check_peer_user`` the one a client
(rendezvous/client.py) act on, once per connection. Across hosts nobody can tell: only a
secret helps there.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct

from ..errors import UsageError

__all__ = ["check_peer_user", "other_user", "peer_uid"]

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Owner = tuple[int, int]  # (uid, inode) of a socket; inode 0: no process holds it any more
_V4_MAPPED = b"\0" * 10 + b"\xff\xff"  # an IPv4 address as an IPv6 socket has it: ::ffff:a.b.c.d
_NL_HEAD = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_DIAG_REQUEST = struct.Struct("=BBBBI2s2s16s16sI8s")  # inet_diag_req_v2 and its sockid
_DIAG_OWNER = struct.Struct("=II")  # uid and inode in an inet_diag_msg, at _DIAG_OWNER_AT
_DIAG_OWNER_AT = _NL_HEAD.size + 4 + 48 + 12
_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_ERROR, _NLM_F_REQUEST = 4, 20, 2, 1
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")  # the slow way: every socket of this namespace


def _address(host: str) -> _Address:
    found = ipaddress.ip_address(host.split("%", 1)[0])
    mapped = found.ipv4_mapped if isinstance(found, ipaddress.IPv6Address) else None
    return mapped or found


def _diag(local: tuple[_Address, int], remote: tuple[_Address, int]) -> _Owner | None:
    """(uid, inode) of this namespace's TCP socket with these two ends, asked of the kernel
    (sock_diag: one exact lookup); None if there is none; OSError if it cannot be asked."""
    six = 6 in (local[0].version, remote[0].version)

    def packed(address: _Address) -> bytes:
        raw = address.packed
        return (_V4_MAPPED + raw if six and len(raw) == 4 else raw).ljust(16, b"\0")

    body = _DIAG_REQUEST.pack(
        socket.AF_INET6 if six else socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF,
        local[1].to_bytes(2, "big"), remote[1].to_bytes(2, "big"), packed(local[0]),
        packed(remote[0]), 0, b"\xff" * 8,  # any interface; no cookie
    )  # fmt: skip
    head = _NL_HEAD.pack(_NL_HEAD.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.send(head + body)
        reply = nl.recv(4096)
    if _NL_HEAD.unpack_from(reply)[1] == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", reply, _NL_HEAD.size)[0]
        if code == errno.ENOENT:
            return None
        raise OSError(code, os.strerror(code))
    uid, inode = _DIAG_OWNER.unpack_from(reply, _DIAG_OWNER_AT)
    return int(uid), int(inode)


def _hex(table: str, address: _Address, port: int) -> bytes | None:
    """How ``table`` writes an endpoint: the address's 32-bit words in host order, in hex."""
    if table.endswith("6"):
        packed = address.packed if address.version == 6 else _V4_MAPPED + address.packed
    elif address.version == 4:
        packed = address.packed
    else:
        return None
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return ("".join(f"{word:08X}" for word in words) + f":{port:04X}").encode()


def _table(local: tuple[_Address, int], remote: tuple[_Address, int]) -> _Owner | None:
    """What ``_diag`` says, read from /proc/net/tcp{,6} (every row: slow on a busy host)."""
    readable = False
    for table in _TABLES:
        ours, theirs = _hex(table, *local), _hex(table, *remote)
        try:
            with open(table, "rb") as f:
                rows = f.read()
        except OSError:
            continue
        readable = True
        at = -1 if ours is None or theirs is None else rows.find(b": %s %s " % (ours, theirs))
        if at >= 0:  # sl: local remote state queues timer retransmits uid timeout inode
            fields = rows[at : rows.find(b"\n", at)].split()
            return int(fields[7]), int(fields[9])
    if not readable:
        raise OSError("no /proc/net/tcp")
    return None


def _lookup(sock: socket.socket) -> tuple[bool, _Owner | None]:
    """(whether the other end of ``sock`` is on this host and can be looked up, and if so
    its (uid, inode), None when no socket is there). On this host: a loopback address, or
    this end's own address. Our own end is looked up first: it must be found, else the way
    of asking does not work here (sock_diag, then /proc/net/tcp; neither: nothing to say)."""
    try:
        mine, theirs = sock.getsockname(), sock.getpeername()
        here, there = (_address(mine[0]), mine[1]), (_address(theirs[0]), theirs[1])
    except (OSError, ValueError):
        return False, None
    if not there[0].is_loopback and there[0] != here[0]:
        return False, None
    for ask in (_diag, _table):
        try:
            if ask(here, there) is not None:
                return True, ask(there, here)
        except (OSError, ValueError, IndexError, struct.error):
            continue
    return False, None


def peer_uid(sock: socket.socket) -> int | None:
    """The uid that owns the other end of ``sock`` if it is on this host and found, else None."""
    owner = _lookup(sock)[1]
    return None if owner is None else owner[0]


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def other_user(sock: socket.socket, *, held: bool = False) -> str | None:
    """Why the other end of ``sock`` is not this user's, or None: "uid N (name)" of another
    user of this host; with ``held`` (a server: the client's socket must be held by a
    process), also an end on this host that no process holds (closed before its bytes are
    read, which would hide its owner) or that cannot be found."""
    looked, owner = _lookup(sock)
    if not looked:
        return None
    if owner is None or held and owner[1] == 0:
        return "no process (its socket is closed or gone)" if held else None
    return None if owner[0] == os.geteuid() else _user(owner[0])


def check_peer_user(sock: socket.socket, who: str) -> None:
    """UsageError when ``who``, at the other end of ``sock``, is another user of this host."""
    other = other_user(sock)
    if other is not None:
        raise UsageError(
            f"{who} belongs to another user of this host ({other}; this rank runs as "
            f"{_user(os.geteuid())}): someone else holds that port, maybe taken first because "
            "it is predictable (derived from the job id). Refusing it; set MASTER_PORT to a "
            "free port, and ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE) on every rank"
        )
