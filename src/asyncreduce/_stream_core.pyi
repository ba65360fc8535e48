"""Types of the C stream look (``_stream_core.pyx``; see its docstring)."""

from typing import Final

FRAME: Final[int]
NOTHING: Final[int]
OTHER: Final[int]
END: Final[int]
PART: Final[int]

def take(
    fd: int, head: bytes, room: memoryview, whole: int, seconds: float, offset: int = 0
) -> tuple[int, int]: ...
