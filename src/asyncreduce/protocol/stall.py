"""The stall inspector: which ranks have not posted an operation that others wait on.

An operation pending here for longer than ``after`` seconds (``ASYNCREDUCE_STALL_WARNING``,
default 60, 0 turns it off) makes this rank ask every other rank, with one small INQUIRY frame,
what it knows of that key: pending there, never posted there, done, or failed. Once all have
answered (or a few seconds passed), one warning names the operation and the ranks that never
posted it, the diagnostic Horovod users rely on, without a coordinator: any rank can ask.
Each operation is asked about once per ``after`` seconds, so a long stall warns again.

The session sends the questions (wire.Ask) and passes on the answers (wire.Answer); this class
keeps the questions and words the warning. Times are passed in (monotonic seconds).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from ..errors import ranks_phrase
from .wire import ANSWERS, DONE, FAILED, NOT_POSTED, PENDING

__all__ = ["StallInspector"]

log = logging.getLogger("asyncreduce.stall")

_ANSWER_WAIT = 3.0  # seconds to wait for every answer before warning with what came


@dataclass
class _Question:
    label: str
    posted_at: float
    asked_at: float
    answers: dict[int, int] = field(default_factory=dict)


class StallInspector:
    """Questions asked about stalled operations, and the warnings their answers give."""

    def __init__(self, rank: int, world_size: int, after: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.after = after
        self._asked: dict[tuple[bytes, int], _Question] = {}
        self._last_asked: dict[tuple[bytes, int], float] = {}
        self.reports: deque[str] = deque(maxlen=100)  # the warnings given, newest last

    def due(self, key: tuple[bytes, int], started: float, now: float) -> bool:
        """Whether to ask about an operation started (monotonic) at ``started``."""
        if self.after <= 0 or now - started < self.after or key in self._asked:
            return False
        return now - self._last_asked.get(key, -1e18) >= self.after

    def asked(self, key: tuple[bytes, int], label: str, started: float, now: float) -> None:
        self._asked[key] = _Question(label, started, now)
        self._last_asked[key] = now
        if len(self._last_asked) > 4096:
            self._last_asked.pop(next(iter(self._last_asked)))

    def answered(self, key: tuple[bytes, int], peer: int, answer: int, now: float) -> None:
        question = self._asked.get(key)
        if question is not None and answer in ANSWERS:
            question.answers[peer] = answer
            if len(question.answers) == self.world_size - 1:
                self._report(key, now)

    def forget(self, key: tuple[bytes, int]) -> None:
        """The operation ended here: no warning for it any more."""
        self._asked.pop(key, None)

    def overdue(self, now: float) -> None:
        """Warn with partial answers about questions asked too long ago."""
        for key, question in list(self._asked.items()):
            if now - question.asked_at > _ANSWER_WAIT:
                self._report(key, now)

    def _report(self, key: tuple[bytes, int], now: float) -> None:
        question = self._asked.pop(key)
        by_answer: dict[int, list[int]] = {}
        for peer, answer in sorted(question.answers.items()):
            by_answer.setdefault(answer, []).append(peer)
        silent = sorted(set(range(self.world_size)) - set(question.answers) - {self.rank})
        waited = now - question.posted_at
        parts = [f"stall: {question.label} posted on rank {self.rank} {waited:.0f} s ago"]
        if NOT_POSTED in by_answer:
            parts.append(f"never posted by {ranks_phrase(by_answer[NOT_POSTED])}")
        for answer in (PENDING, DONE, FAILED):
            if answer in by_answer:
                parts.append(f"{ANSWERS[answer]} on {ranks_phrase(by_answer[answer])}")
        if silent:
            parts.append(f"no answer from {ranks_phrase(silent)}")
        message = "; ".join(parts)
        self.reports.append(message)
        log.warning("%s", message)
