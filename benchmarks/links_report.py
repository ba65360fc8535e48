"""What one run of the links benchmark holds, and how it is shown: table, JSON, plot.

``Settings`` are the resolved options, ``Result`` one (library, K, rate, size) point with its
bus bandwidth and share of the link, ``Run`` all of them with the one-stream TCP checks and
what was skipped or failed. ``report`` prints the machine, the settings and the link checks,
then one ``table`` row per (hosts, rate, size, library in ``LIBS`` order); ``plot`` draws the
share of the link per library as grouped bars.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402

__all__ = ["LIBS", "Result", "Run", "Settings", "plot", "report", "table", "write_json"]

LIBS = ("asyncreduce", "gloo", "mpi")


@dataclass(frozen=True)
class Settings:
    hosts: list[int]
    rates: list[str]
    sizes: list[int]
    libs: list[str]
    min_time: float
    warmup: int
    repeats: int
    tcp_seconds: float
    timeout: float | None
    quick: bool
    mtu: int = 1500


@dataclass
class Result:
    lib: str
    hosts: int
    rate: str
    rate_bps: float
    bytes: int
    latency_us: float
    busbw_gbps: float  # GB/s
    link_share: float  # busbw / rate
    algorithm: str
    min_us: float
    repeats_us: list[float]
    iters: int
    warmup: int


@dataclass
class Run:
    settings: Settings
    results: list[Result] = field(default_factory=list)
    tcp: list[dict[str, Any]] = field(default_factory=list)  # the link checks
    skipped: dict[str, str] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    set_seconds: dict[str, float] = field(default_factory=dict)


def _render(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 4 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def table(run: Run) -> str:
    """One row per (hosts, rate, size, library)."""
    s = run.settings
    headers = ["hosts", "link", "size", "lib", "ms/op", "busbw GB/s", "busbw Gbit/s", "of link"]
    rows = []
    for hosts in s.hosts:
        for rate in s.rates:
            for nbytes in s.sizes:
                for lib in (lib for lib in LIBS if lib in s.libs and lib not in run.skipped):
                    rows.append(_row(run, hosts, rate, nbytes, lib))
    return "\n".join(_render(headers, rows))


def _row(run: Run, hosts: int, rate: str, nbytes: int, lib: str) -> list[str]:
    head = [str(hosts), rate, harness.format_size(nbytes), lib]
    found = [
        r for r in run.results if (r.hosts, r.rate, r.bytes, r.lib) == (hosts, rate, nbytes, lib)
    ]
    if not found:
        failed = any((f["lib"], f["hosts"], f["rate"]) == (lib, hosts, rate) for f in run.failures)
        return head + ["fail" if failed else "-"] * 4
    r = found[0]
    return head + [
        f"{r.latency_us / 1e3:.1f}",
        f"{r.busbw_gbps:.3f}",
        f"{r.busbw_gbps * 8:.3f}",
        f"{r.link_share:.1%}",
    ]


def report(run: Run, machine: dict[str, Any]) -> str:
    s = run.settings
    lines = [_machine_line(machine)]
    lines += [f"skipped {lib}: {why}" for lib, why in run.skipped.items()]
    lines += [f"FAILED {f['lib']} K={f['hosts']} {f['rate']}: {f['error']}" for f in run.failures]
    lines.append(
        f"settings: min-time {s.min_time} s per point, {s.repeats} repeats (median), warm-up up "
        f"to {s.warmup}{', quick' if s.quick else ''}; links: tbf both ways, MTU {s.mtu}"
    )
    for check in run.tcp:
        lines.append(
            f"link check K={check['hosts']} {check['rate']}: one TCP stream h0 -> h1 for "
            f"{check['send_s']:g} s: {check['bits_per_s'] / 1e9:.3f} Gbit/s = "
            f"{check['share']:.1%} of the rate"
        )
    lines += [
        "",
        "allreduce of float32 (sum, in place), one rank per emulated host; ms/op = median time;"
        " busbw = bytes*2(K-1)/K/time; of link = busbw / link rate",
        table(run),
    ]
    return "\n".join(lines)


def _machine_line(machine: dict[str, Any]) -> str:
    parts = [
        f"{machine.get('cores')} cores ({machine.get('cpu') or '?'})",
        f"Linux {platform.release()}",
        f"Python {machine.get('python')}",
        f"torch {machine.get('torch') or 'not installed'}",
        f"mpi4py {machine.get('mpi4py') or 'not installed'}",
        machine.get("open_mpi") or "Open MPI not found",
        f"asyncreduce {machine.get('asyncreduce')}",
    ]
    return "machine: " + "; ".join(parts + harness.load_words(machine))


def write_json(
    path: Path, run: Run, machine: dict[str, Any], argv: Sequence[str], elapsed: float
) -> None:
    document = {
        **harness.json_head("links", argv, elapsed, machine),
        "links": {"shaping": "tc tbf on both ends of each host's veth", "mtu": run.settings.mtu},
        "settings": asdict(run.settings),
        "tcp_checks": run.tcp,
        "skipped": run.skipped,
        "failures": run.failures,
        "set_seconds": run.set_seconds,
        "results": [asdict(r) for r in run.results],
    }
    harness.save_json(path, document)


def plot(path: Path, run: Run) -> None:
    """Grouped bars: share of the link per (hosts, rate, size), one bar per library."""
    plt = harness.pyplot()
    s = run.settings
    groups = [(k, r, b) for k in s.hosts for r in s.rates for b in s.sizes]
    libs = [lib for lib in LIBS if any(res.lib == lib for res in run.results)]
    width = 0.8 / max(1, len(libs))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
    for n, lib in enumerate(libs):
        shares = []
        for k, r, b in groups:
            found = [x for x in run.results if (x.lib, x.hosts, x.rate, x.bytes) == (lib, k, r, b)]
            shares.append(100 * found[0].link_share if found else 0.0)
        xs = [g + (n - (len(libs) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, shares, width, label=lib)
    tcp = {(c["hosts"], c["rate"]): 100 * c["share"] for c in run.tcp}
    for g, (k, r, _) in enumerate(groups):
        if (k, r) in tcp:
            label = "one TCP stream" if g == 0 else None
            ax.hlines(tcp[(k, r)], g - 0.45, g + 0.45, colors="k", linestyles="dashed", label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"K={k}\n{r}\n{harness.format_size(b)}" for k, r, b in groups])
    ax.set_ylabel("allreduce bus bandwidth, % of link rate")
    ax.set_ylim(0, 120)
    ax.set_title("allreduce across emulated hosts (tbf-shaped veth links)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper center", ncol=len(libs) + 1, fontsize="small")
    harness.save_figure(plt, fig, path)
