"""The local launcher, end to end: real ``python -m asyncreduce run`` processes.

Rank programs are small scripts written to ``tmp_path``. Ranks that must be stopped by the
launcher write their PID and a ``ready`` file first, so a test can wait until they are in place
and afterwards check that every one of those PIDs is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from asyncreduce import cli

LAUNCHER = [sys.executable, "-m", "asyncreduce", "run"]

# Prelude of every rank script: who am I, and a helper to announce "my PID, I am ready".
PRELUDE = """\
import os, signal, sys, time
from pathlib import Path
RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[1])
def ready():
    (OUT / f"pid{RANK}").write_text(str(os.getpid()))
    (OUT / f"ready{RANK}").write_text("")
def wait_ready(ranks):
    while not all((OUT / f"ready{r}").exists() for r in ranks):
        time.sleep(0.01)
"""


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def launch(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCHER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_all_gone(tmp_path: Path) -> None:
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert pids, "no rank wrote its pid"
    assert [pid for pid in pids if alive(pid)] == []


def wait_for(paths: list[Path], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.02)


def test_each_rank_gets_its_env_and_a_prefix(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        e = os.environ
        print(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"],
              e["MASTER_ADDR"], e["MASTER_PORT"], e["PYTHONUNBUFFERED"])
        """,
    )
    done = launch("-n", "3", str(prog), str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert len(lines) == 3
    ports = set()
    for rank, line in enumerate(lines):
        prefix, r, world, local, local_world, addr, port, unbuffered = line.split(" ")
        assert (prefix, r, local) == (f"[{rank}]", str(rank), str(rank))
        assert (world, local_world, addr, unbuffered) == ("3", "3", "127.0.0.1", "1")
        ports.add(int(port))
    assert len(ports) == 1 and 0 < ports.pop() < 65536


def test_program_args_and_master_port_are_passed_through(tmp_path: Path) -> None:
    prog = script(tmp_path, 'print(os.environ["MASTER_PORT"], *sys.argv[2:])')
    done = launch("-n", "1", "--master-port", "29555", "--", str(prog), str(tmp_path), "-n", "7")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[0] 29555 -n 7\n"


def test_stderr_lines_are_prefixed_and_stay_on_stderr(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        print(f"out{RANK}")
        print(f"err{RANK} first", file=sys.stderr)
        sys.stderr.write(f"err{RANK} no newline")
        """,
    )
    done = launch("-n", "2", str(prog), str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] out0", "[1] out1"]
    assert sorted(done.stderr.splitlines()) == [
        "[0] err0 first",
        "[0] err0 no newline",
        "[1] err1 first",
        "[1] err1 no newline",
    ]


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        ready()
        if RANK == 1:
            wait_ready([0, 2])
            raise SystemExit(3)
        time.sleep(60)
        """,
    )
    start = time.monotonic()
    done = launch("-n", "3", str(prog), str(tmp_path))
    assert time.monotonic() - start < 10
    assert done.returncode == 3
    assert "asyncreduce run: rank 1 exited with code 3; stopping the other ranks" in done.stderr
    assert_all_gone(tmp_path)


def test_elastic_a_failing_rank_is_reported_and_the_others_finish(tmp_path: Path) -> None:
    """--elastic: rank 1 fails, ranks 0 and 2 go on and exit 0 a moment later: the job's code
    is 0, and the failure is said on stderr; every rank failing gives the first one's code."""
    prog = script(
        tmp_path,
        """
        ready()
        wait_ready([0, 1, 2])
        if RANK == 1:
            raise SystemExit(3)
        time.sleep(1.0)
        (OUT / f"finished{RANK}").write_text("")
        """,
    )
    done = launch("-n", "3", "--elastic", str(prog), str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "rank 1 exited with code 3; the others go on (elastic)" in done.stderr
    assert (tmp_path / "finished0").exists() and (tmp_path / "finished2").exists()
    every = script(tmp_path, "raise SystemExit(4 + RANK)\n")
    done = launch("-n", "2", "--elastic", str(every), str(tmp_path))
    assert done.returncode in (4, 5) and done.stderr.count("the others go on") == 2, done.stderr


def test_max_restarts_starts_a_failed_rank_again_with_the_doors(tmp_path: Path) -> None:
    """--elastic --max-restarts 2: rank 1 fails on its first two starts and succeeds on the
    third; each start sees ASYNCREDUCE_RESTART count up and the same ASYNCREDUCE_DOORS, one
    host:port per rank. A third failure would have nobody to restart it; without --elastic
    the option is refused."""
    prog = script(
        tmp_path,
        """
        restart = os.environ.get("ASYNCREDUCE_RESTART", "0")
        (OUT / f"start{RANK}-{restart}").write_text(os.environ["ASYNCREDUCE_DOORS"])
        if RANK == 1 and restart != "2":
            raise SystemExit(5)
        time.sleep(1.5)
        """,
    )
    done = launch("-n", "2", "--elastic", "--max-restarts", "2", str(prog), str(tmp_path))
    assert done.returncode == 0, done.stderr
    starts = sorted(p.name for p in tmp_path.glob("start*"))
    assert starts == ["start0-0", "start1-0", "start1-1", "start1-2"], starts
    doors = {(tmp_path / name).read_text() for name in starts}
    assert len(doors) == 1 and len(doors.pop().split(",")) == 2, doors
    assert done.stderr.count("rank 1 started again") == 2, done.stderr
    refused = launch("-n", "2", "--max-restarts", "1", str(prog), str(tmp_path))
    assert refused.returncode == 2 and "--max-restarts N needs --elastic" in refused.stderr
    refused = launch("-n", "2", "--elastic", "--spare", str(prog), str(tmp_path))
    assert refused.returncode == 2 and "--spare needs --max-restarts N" in refused.stderr


def test_a_rank_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        def note(signum, frame):
            (OUT / f"term{RANK}").write_text("")
        signal.signal(signal.SIGTERM, note)
        ready()
        if RANK == 0:
            wait_ready([1])
            raise SystemExit(5)
        time.sleep(60)
        """,
    )
    start = time.monotonic()
    done = launch("-n", "2", "--grace", "0.5", str(prog), str(tmp_path))
    elapsed = time.monotonic() - start
    assert done.returncode == 5, done.stderr
    assert (tmp_path / "term1").exists(), "rank 1 never got SIGTERM"
    assert 0.5 <= elapsed < 10
    assert_all_gone(tmp_path)


def test_a_rank_killed_by_a_signal_reports_128_plus_signal(tmp_path: Path) -> None:
    prog = script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    done = launch("-n", "1", str(prog), str(tmp_path))
    assert done.returncode == 128 + signal.SIGKILL
    assert "rank 0 exited with code 137 (killed by SIGKILL)" in done.stderr


def start_launcher(tmp_path: Path, prog: Path, *args: str) -> subprocess.Popen[str]:
    """Start the launcher with 2 ranks and return once both ranks are ready."""
    launcher = subprocess.Popen(
        [*LAUNCHER, "-n", "2", *args, str(prog), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for([tmp_path / "ready0", tmp_path / "ready1"])
    except BaseException:
        stop(launcher)
        raise
    return launcher


def stop(launcher: subprocess.Popen[str], timeout: float = 10) -> str:
    """Wait for the launcher (killing it if it hangs); return its stderr."""
    try:
        return launcher.communicate(timeout=timeout)[1]
    finally:
        launcher.kill()
        launcher.communicate()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_is_forwarded_to_every_rank(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    prog = script(
        tmp_path,
        """
        def note(signum, frame):
            (OUT / f"got{RANK}").write_text(signal.Signals(signum).name)
            raise SystemExit(0)
        signal.signal(signal.SIGINT, note)
        signal.signal(signal.SIGTERM, note)
        ready()
        time.sleep(60)
        """,
    )
    launcher = start_launcher(tmp_path, prog)
    launcher.send_signal(sig)
    err = stop(launcher)
    assert launcher.returncode == code, err
    assert [(tmp_path / f"got{r}").read_text() for r in (0, 1)] == [sig.name, sig.name]
    assert_all_gone(tmp_path)


IGNORE_EVERYTHING = """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready()
    time.sleep(60)
    """


def test_ctrl_c_escalates_to_sigkill(tmp_path: Path) -> None:
    launcher = start_launcher(tmp_path, script(tmp_path, IGNORE_EVERYTHING), "--grace", "0.2")
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    err = stop(launcher)
    assert launcher.returncode == 130, err
    assert 0.4 <= time.monotonic() - start < 10  # SIGINT, 0.2 s, SIGTERM, 0.2 s, SIGKILL
    assert_all_gone(tmp_path)


def test_a_second_ctrl_c_kills_at_once(tmp_path: Path) -> None:
    launcher = start_launcher(tmp_path, script(tmp_path, IGNORE_EVERYTHING), "--grace", "30")
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    time.sleep(0.2)
    launcher.send_signal(signal.SIGINT)
    err = stop(launcher)
    assert launcher.returncode == 130, err
    assert time.monotonic() - start < 10
    assert_all_gone(tmp_path)


def test_a_command_that_is_not_python_runs_as_is(tmp_path: Path) -> None:
    done = launch("-n", "2", "sh", "-c", 'echo "$RANK of $WORLD_SIZE"')
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] 0 of 2", "[1] 1 of 2"]


def test_a_missing_command_fails_with_127() -> None:
    done = launch("-n", "2", "asyncreduce-no-such-program")
    assert done.returncode == 127
    assert "cannot start 'asyncreduce-no-such-program'" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "prog.py"], "argument -n/--nprocs: must be at least 1, got 0"),
        (["-n", "two", "prog.py"], "argument -n/--nprocs: must be an integer, got 'two'"),
        (["prog.py"], "the following arguments are required: -n/--nprocs"),
        (["-n", "2"], "missing the program to run"),
        (["-n", "2", "--"], "missing the program to run"),
        (["-n", "2", "--master-port", "70000", "prog.py"], "must be a TCP port in 1..65535"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: list[str], message: str) -> None:
    done = launch(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stdout == ""


def test_bench_without_its_module_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "asyncreduce.bench", None)  # makes the import fail
    assert cli.main(["bench", "--quick"]) == 2
    assert "asyncreduce.bench is not available" in capsys.readouterr().err


def test_bench_gets_the_rest_of_the_line_verbatim(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 4

    fake = types.ModuleType("asyncreduce.bench")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "asyncreduce.bench", fake)
    assert cli.main(["bench", "--quick", "-n", "2", "--"]) == 4
    assert seen == [["--quick", "-n", "2", "--"]]


def test_main_returns_the_code_instead_of_exiting(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err
    assert cli.main(["run", "--help"]) == 0
    assert "--nprocs" in capsys.readouterr().out
