"""Requests (request.py) on their own: a Future that makes its condition only when someone
needs one, so completing it from one thread while others wait, watch or add callbacks must
never lose a wake-up. Each race is run many times with threads started at random moments."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from typing import Any

import pytest

from asyncreduce import request as request_module
from asyncreduce.request import CallbackRunner, Request, wait_any

RUNNER = CallbackRunner("test-request")
ROUNDS = 300


@pytest.fixture(autouse=True, params=["lazy", "future's own"])
def condition_made(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test twice: with the condition made on first use (this Python), and with
    Future's own __init__ (the fallback for a Python whose Future has other fields)."""
    if request.param != "lazy":
        monkeypatch.setattr(request_module, "_LAZY", False)


def test_a_request_makes_its_condition_late_only_where_futures_have_the_fields_it_sets() -> None:
    if request_module._LAZY:  # (this Python's Future, unless the fixture turned it off)
        assert set(vars(concurrent.futures.Future())) == request_module._FIELDS
    made = _request()
    assert (made._made_condition is None) is request_module._LAZY
    made.set_result(1)
    assert made.result() == 1 and made.done()


def _request(i: int = 0) -> Request[Any]:
    return Request(f"allreduce #{i}", RUNNER)


def _soon(fn: Any, *args: Any) -> threading.Thread:
    """Run ``fn`` on a thread after a random sleep (0 to 0.2 ms), while this thread goes on
    after a random sleep of its own, so either may come first."""

    def later() -> None:
        time.sleep(random.random() * 2e-4)
        fn(*args)

    thread = threading.Thread(target=later)
    thread.start()
    time.sleep(random.random() * 2e-4)
    return thread


def _both_orders(first: list[bool]) -> None:
    """The rounds saw the completion come first, and the waiter."""
    assert 0 < sum(first) < len(first), f"completed first in {sum(first)} of {len(first)} rounds"


@pytest.mark.parametrize("how", ["result", "exception", "concurrent.futures.wait", "wait_any"])
def test_a_waiter_racing_the_completion_always_wakes(how: str) -> None:
    random.seed(how)
    first = []
    for i in range(ROUNDS):
        request = _request(i)
        completer = _soon(request.set_result, i)
        first.append(request.done())
        if how == "result":
            assert request.result(timeout=10) == i
        elif how == "exception":
            assert request.exception(timeout=10) is None
        elif how == "concurrent.futures.wait":
            done, _ = concurrent.futures.wait([request], timeout=10)
            assert done == {request}
        else:
            assert wait_any([_request(), request], timeout=10) == (1, i)
        completer.join()
        assert request.done() and request.result() == i
    _both_orders(first)


def test_a_callback_racing_the_completion_runs_exactly_once() -> None:
    random.seed(1)
    for i in range(ROUNDS):
        request, calls = _request(i), []
        fired = threading.Event()
        completer = _soon(request.set_result, i)
        request.add_done_callback(lambda r, c=calls, f=fired: (c.append(r.result()), f.set()))
        completer.join()
        assert fired.wait(10)
        time.sleep(0)
        assert calls == [i]


def test_an_error_racing_a_waiter_is_raised_and_a_second_completion_refused() -> None:
    random.seed(2)
    first = []
    for i in range(ROUNDS):
        request = _request(i)
        completer = _soon(request.set_exception, ValueError(f"failed #{i}"))
        first.append(request.done())
        with pytest.raises(ValueError, match=f"failed #{i}$"):
            request.result(timeout=10)
        completer.join()
        with pytest.raises(concurrent.futures.InvalidStateError):
            request.set_result(0)
    _both_orders(first)
    quiet = _request()  # completed before anyone looked: no condition was ever made
    quiet.set_result(1)
    with pytest.raises(concurrent.futures.InvalidStateError):  # (either path's own words)
        quiet.set_result(2)
    assert quiet.result() == 1 and quiet.exception() is None


def test_a_request_is_never_cancelled_and_times_out_while_pending() -> None:
    request = _request()
    assert not request.cancel() and not request.cancelled() and request.running()
    with pytest.raises(TimeoutError, match="not complete after 0.01 s"):
        request.wait(0.01)
    request.set_result("x")
    assert request.wait() == "x" and request.done() and not request.running()
