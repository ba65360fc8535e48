"""Types of the C stream look (``_stream_core.pyx``; see its docstring)."""

from typing import Final

FRAME: Final[int]
NOTHING: Final[int]
OTHER: Final[int]
END: Final[int]
PART: Final[int]
UNSENT: Final[int]
COMBINED: Final[int]
MAX_HEAD: Final[int]

def take(
    fd: int, head: bytes, room: memoryview, whole: int, seconds: float, offset: int = 0
) -> tuple[int, int]: ...
def combines(dtype: int, op: int) -> bool: ...
def swap(
    fd: int,
    head: bytes,
    payload: memoryview,
    room: memoryview,
    seconds: float,
    into: memoryview | None = None,
    dtype: int = 0,
    op: int = 0,
    incoming_first: bool = False,
) -> tuple[int, int, int]: ...
def swaps(
    fds: tuple[int, ...],
    rooms: tuple[memoryview, ...],
    steps: tuple[int, ...],
    firsts: tuple[bool, ...],
    head: bytes,
    step_at: int,
    payload: memoryview,
    seconds: float,
    into: memoryview | None = None,
    dtype: int = 0,
    op: int = 0,
) -> tuple[int, int, int, int]: ...
