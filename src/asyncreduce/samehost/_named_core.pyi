"""Types of the C named-slot steps (_named_core.pyx; named.NativeNamedSlots uses them)."""

from typing import Any

class NamedCore:
    def __init__(
        self, rank: int, regions: list[Any], start: int, slots: int, fields: int,
        heads_bytes: int, acks_bytes: int, slot_bytes: int,
    ) -> None: ...  # fmt: skip
    def publish(
        self, slot: int, generation: int, header: Any, k0: int, k1: int, instance: int,
        data: Any | None,
    ) -> None: ...  # fmt: skip
    def withdraw(self, slot: int, generation: int) -> None: ...
    def fold(
        self, k0: int, k1: int, instance: int, slot: int, found: Any, header: Any, out: Any
    ) -> int: ...
    def wait(self, found: Any, seconds: float) -> bool: ...
    def release(self) -> None: ...
