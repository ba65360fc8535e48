"""The report of ``bench gpu``: ratios, parameter checks, the issue's targets, tables and a plot.

``complete(doc)`` adds to the parent's document what follows from the rows: each training
row's ratio to DDP over Gloo and to the ceiling, its parameter check (its digest against DDP
over Gloo's: "equal" or "differs"), each staged size's ratios, and ``verdicts``: every target of
issue 34, "met", "not met" or "unmeasured" with why. A stand-in run measures no GPU target:
all are "unmeasured", and every number carries the label "stand-in, not a GPU".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_setup import EXACT, LABELS, MODES, STANDIN
from gpu_staged import KIND_LABELS, KINDS

__all__ = ["complete", "plot", "render"]

TARGET_BYTES = 100 << 20  # the staged targets are at 100 MiB


def complete(doc: dict[str, Any]) -> None:
    """Ratios, parameter checks and verdicts, in place (see the module docstring)."""
    rows = {r["key"]: r for r in doc["rows"]}
    gloo, ceiling = _rate(rows.get("ddp_gloo")), _rate(rows.get("ceiling"))
    reference = (rows.get("ddp_gloo") or {}).get("digest")
    for key, row in rows.items():
        rate = _rate(row)
        row["vs_ddp_gloo"] = rate / gloo if rate and gloo else None
        row["of_ceiling"] = rate / ceiling if rate and ceiling else None
        row["param_check"] = _check(key, row.get("digest"), reference)
    for entry in doc["staged"]:
        ms = entry["ms"]
        entry["staged_vs_host"] = _ratio(ms.get("ours_staged"), ms.get("ours_host"))
        entry["staged_vs_gloo"] = _ratio(ms.get("ours_staged"), ms.get("gloo"))
    doc["verdicts"] = _verdicts(doc, rows)


def _rate(row: dict[str, Any] | None) -> float | None:
    return None if not row or row.get("status") != "ok" else row.get("steps_per_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _check(key: str, digest: str | None, reference: str | None) -> str:
    if key == "ceiling":
        return "n/a"  # no averaging at all: its parameters are rank 0's own
    if key == "ddp_gloo":
        return "reference" if digest else "unmeasured"
    if digest is None or reference is None:
        return "unmeasured"
    return "equal" if digest == reference else "differs"


# ---- the targets ------------------------------------------------------------------------------


def _verdict(target: str, met: bool | None, measured: str, why: str = "") -> dict[str, Any]:
    verdict = "unmeasured" if met is None else "met" if met else "not met"
    return {"target": target, "verdict": verdict, "measured": measured, "why": why}


def _at_least(rows: dict[str, Any], key: str, field: str, bound: float) -> tuple[bool | None, str]:
    value = rows.get(key, {}).get(field)
    return (None, "-") if value is None else (value >= bound, f"{value:.2f}")


def _verdicts(doc: dict[str, Any], rows: dict[str, Any]) -> dict[str, Any]:
    """Every target of the issue (see the module docstring)."""
    found: dict[str, Any] = {}
    for name, key, field, bound, target in (
        ("backward_vs_gloo", "backward", "vs_ddp_gloo", 1.1, "backward >= 1.1x DDP over Gloo"),
        ("backward_vs_ceiling", "backward", "of_ceiling", 0.9,
         "backward >= 90% of the no-communication ceiling"),
        ("forward_vs_gloo", "forward", "vs_ddp_gloo", 1.0, "forward >= DDP over Gloo"),
        ("double_buffer_vs_gloo", "double_buffer", "vs_ddp_gloo", 1.0,
         "double_buffer >= DDP over Gloo"),
        ("ddp_asyncreduce_vs_gloo", "ddp_asyncreduce", "vs_ddp_gloo", 1.1,
         "DDP over asyncreduce >= 1.1x DDP over Gloo"),
    ):  # fmt: skip
        found[name] = _verdict(target, *_at_least(rows, key, field, bound))
    checks = [rows.get(k, {}).get("param_check", "unmeasured") for k in EXACT]
    exact = None if "unmeasured" in checks else all(c == "equal" for c in checks)
    found["exact"] = _verdict("blocking, backward, forward bit for bit equal to DDP over Gloo",
                              exact, ", ".join(checks))  # fmt: skip
    found.update(_staged_verdicts(doc))
    found["no_host_syncs"] = _syncs_verdict(rows)
    found["nccl"] = _nccl_verdict(rows)
    if doc["standin"]:
        for verdict in found.values():
            verdict.update(verdict="unmeasured", why=f"{STANDIN}: a GPU target")
    return found


def _staged_verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = next((e for e in doc["staged"] if e["bytes"] == TARGET_BYTES), {})
    host, gloo = entry.get("staged_vs_host"), entry.get("staged_vs_gloo")
    return {
        "staged_vs_host": _verdict("staged 100 MiB <= 1.2x our host allreduce",
                                   None if host is None else host <= 1.2,
                                   "-" if host is None else f"{host:.2f}x"),
        "staged_vs_gloo": _verdict("staged 100 MiB <= 0.7x Gloo on the CUDA tensor",
                                   None if gloo is None else gloo <= 0.7,
                                   "-" if gloo is None else f"{gloo:.2f}x"),
    }  # fmt: skip


def _syncs_verdict(rows: dict[str, Any]) -> dict[str, Any]:
    counts = [(k, (rows.get(k, {}).get("counts") or {}).get("syncs")) for k in MODES]
    measured = ", ".join(f"{k} {'-' if s is None else f'{s:g}'}" for k, s in counts)
    values = [s for _, s in counts]
    met = None if None in values else all(s == 0 for s in values)
    return _verdict("zero host syncs per step on the training thread (DataParallel, every mode)",
                    met, measured)  # fmt: skip


def _nccl_verdict(rows: dict[str, Any]) -> dict[str, Any]:
    target = "with 2 GPUs: DataParallel over torch/NCCL within 5% of DDP over NCCL, and exact"
    ours, theirs = _rate(rows.get("dp_nccl")), _rate(rows.get("ddp_nccl"))
    if ours is None or theirs is None:
        why = (rows.get("dp_nccl") or {}).get("status", "not run")
        return _verdict(target, None, "-", why)
    exact = rows["dp_nccl"].get("digest") == rows["ddp_nccl"].get("digest")
    return _verdict(target, ours >= 0.95 * theirs and exact,
                    f"{ours / theirs:.2f}x, {'equal' if exact else 'differs'}")  # fmt: skip


# ---- tables ---------------------------------------------------------------------------------


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _row_line(row: dict[str, Any]) -> list[str]:
    counts = row.get("counts") or {}
    status = row.get("status", "?")
    return [
        LABELS.get(row["key"], row["key"]),
        _num(row.get("steps_per_s"), ".2f"),
        _num(row.get("vs_ddp_gloo"), ".2f") + ("x" if row.get("vs_ddp_gloo") else ""),
        _num(row.get("of_ceiling"), ".0%"),
        _num(row.get("hidden_share"), ".0%"),
        row.get("param_check", "-") if status == "ok" else "-",
        _num(counts.get("to_host"), "g"),
        _num(counts.get("to_device"), "g"),
        _num(counts.get("syncs"), "g"),
        _num(counts.get("reads"), "g"),
        status,
    ]


def _table(headers: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    last = len(headers) - 1
    out = ["  ".join(h.ljust(w) if i in (0, last) else h.rjust(w) for i, (h, w) in
                     enumerate(zip(headers, widths, strict=True))).rstrip()]  # fmt: skip
    for line in lines:
        cells = [c.ljust(w) if i in (0, last) else c.rjust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=True))]  # fmt: skip
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def render(doc: dict[str, Any]) -> str:
    """The report: what was measured where, the training rows, the staged rows, the targets."""
    s = doc["settings"]
    head = [
        f"bench gpu: {doc['measured_on']}",
        f"{doc['machine_line']}",
        f"model {doc.get('model', s['model'])}, batch {s['batch']} per rank, {s['ranks']} ranks; "
        f"{s['rounds']} rounds x {s['steps']} steps per row, interleaved, after {s['warmup']} "
        f"warm-up steps; counts over {s['count_steps']} more steps",
    ]
    if doc["standin"]:
        head.append(f"EVERY NUMBER BELOW IS THE CPU STAND-IN'S ({STANDIN}), never a GPU's")
    headers = ["row", "steps/s", "vs DDP Gloo", "of ceiling", "hidden", "params",
               "to host/step", "back/step", "syncs/step", "reads/step", "status"]  # fmt: skip
    rows = _table(headers, [_row_line(r) for r in doc["rows"]]) + (
        "\nparams: the final parameters' digest against DDP over Gloo's (same seed, data and "
        "steps);\ndouble_buffer applies each step's average one step late, so it differs by "
        "design"
    )
    parts = ["\n".join(head), rows, _staged_table(doc), _verdict_lines(doc)]
    return "\n\n".join(parts)


def _staged_table(doc: dict[str, Any]) -> str:
    from harness import format_size

    headers = ["size", *(KIND_LABELS[k] for k in KINDS), "staged/host", "staged/Gloo"]
    lines = []
    for e in doc["staged"]:
        cells = [_num(e["ms"].get(k), ".3f") for k in KINDS]
        lines.append([format_size(e["bytes"]), *cells, _num(e.get("staged_vs_host"), ".2f"),
                      _num(e.get("staged_vs_gloo"), ".2f")])  # fmt: skip
    errors = [f"  {format_size(e['bytes'])} {k}: {v}" for e in doc["staged"]
              for k, v in e.get("errors", {}).items()]  # fmt: skip
    title = "staged allreduce, median ms, slowest rank" + (f" ({STANDIN})" if doc["standin"]
                                                           else "")  # fmt: skip
    body = _table(headers, lines) if lines else "(not measured)"
    return "\n".join([title, body, *errors])


def _verdict_lines(doc: dict[str, Any]) -> str:
    lines = ["targets (issue 34):"]
    for v in doc["verdicts"].values():
        why = f" ({v['why']})" if v["why"] else ""
        lines.append(f"  {v['verdict']:<10} {v['target']}: {v['measured']}{why}")
    return "\n".join(lines)


# ---- plot -----------------------------------------------------------------------------------


def plot(path: Path, doc: dict[str, Any]) -> None:
    """Steps/s per training row, and the staged rows' median ms per size."""
    from harness import format_size, pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    ok = [r for r in doc["rows"] if r.get("status") == "ok"]
    left.barh([LABELS.get(r["key"], r["key"]) for r in ok], [r["steps_per_s"] for r in ok])
    left.invert_yaxis()
    left.set_xlabel("steps/s (higher is better)")
    left.set_title(f"training, {doc.get('model', '')}"[:70])
    width = 0.8 / len(KINDS)
    for i, kind in enumerate(KINDS):
        xs = [j + i * width for j in range(len(doc["staged"]))]
        right.bar(xs, [e["ms"].get(kind) or 0.0 for e in doc["staged"]], width,
                  label=KIND_LABELS[kind])  # fmt: skip
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(doc["staged"]))],
                     [format_size(e["bytes"]) for e in doc["staged"]])  # fmt: skip
    right.set_yscale("log")
    right.set_ylabel("median ms (lower is better)")
    right.set_title("staged allreduce and its parts")
    right.legend(fontsize=7)
    fig.suptitle(f"bench gpu: {doc['measured_on']}")
    from harness import save_figure

    save_figure(plt, fig, path)
