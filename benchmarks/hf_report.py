"""Tables, plots and the docs section of ``python -m benchmarks hf`` (see :mod:`benchmarks.hf_peer`).

The section of docs/benchmarks.md between :data:`HF_BEGIN` and :data:`HF_END` is this module's;
``python -m benchmarks --write-docs`` (the main page) keeps it as it is. Plots need matplotlib
only (imported when they are drawn).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from .markers import GPU_BEGIN
from .runner import REPO

__all__ = ["HF_BEGIN", "HF_END", "aggregate", "run_ratios", "render", "plot", "section", "hf_section", "write_docs"]

HF_BEGIN = ("<!-- hf-section: written by `python -m benchmarks hf --write-docs`; kept when the rest of the page "
            "is regenerated -->")
HF_END = "<!-- /hf-section -->"
GB, MB = 1e9, 1e6
# the targets (fsdptk / transformers): load at >= 2 GB and 2 or 4 ranks, load + first
# forward, resident anonymous memory after the first training step
LOAD_TARGET = 0.7


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _per_run(rec: dict[str, Any]) -> dict[str, float]:
    """One ok run's figures: times (max over ranks), memory and bytes of rank 0 and max of ranks > 0."""
    ranks = sorted(rec["ranks"], key=lambda r: r["rank"])
    r0, rest = ranks[0], ranks[1:] or ranks[:1]

    def both(name: str, get) -> dict[str, float]:
        return {f"{name}_r0": get(r0), f"{name}_rN": max(get(r) for r in rest)}

    out = {
        "load_s": max(r["load"]["s"] for r in ranks),
        "fwd_s": max(r["forward"]["s"] for r in ranks),
        "load_fwd_s": max(r["load"]["s"] + r["forward"]["s"] for r in ranks),
        "save_s": max(r["save"]["s"] for r in ranks) if all("save" in r for r in ranks) else None,
        "start_s": max(r["import_s"] + r["init_s"] for r in ranks),
    }
    out.update(both("load_peak", lambda r: r["load"]["peak"]))
    out.update(both("load_anon", lambda r: r["load"]["anon"]))
    out.update(both("load_file", lambda r: r["load"]["file"]))
    out.update(both("fwd_anon", lambda r: r["forward"]["anon"]))
    out.update(both("fwd_rss", lambda r: r["forward"]["rss"]))
    if all("step" in r for r in ranks):  # a run of --skip-step has none
        out["step_s"] = max(r["step"]["s"] for r in ranks)
        out.update(both("step_anon", lambda r: r["step"]["anon"]))
        out.update(both("step_rss", lambda r: r["step"]["rss"]))
        if all("anon_trimmed" in r["step"] for r in ranks):  # results of an earlier worker lack it
            out.update(both("step_live", lambda r: r["step"]["anon_trimmed"]))
        out.update(both("step_peak", lambda r: r["step"]["peak"]))
    if all("save" in r for r in ranks):  # an FP8 run saves nothing
        out.update(both("save_peak", lambda r: r["save"]["peak"]))
        out.update(both("save_above", lambda r: r["save"]["peak"] - r["save"]["rss0"]))
        out.update(both("save_sent", lambda r: r["save"]["sent"]))
    out.update(both("load_sent", lambda r: r["load"]["sent"]))
    if all("read" in r["load"] for r in ranks):  # bytes read from the files (later workers)
        out.update(both("load_read", lambda r: r["load"]["read"]))
    out["peak_any"] = max(max(r[p]["peak"] for p in ("load", "forward", "step", "save") if p in r) for r in ranks)
    return out


# the figures whose single runs' range is shown beside the median (issue 44)
_SPREAD = ("load_s", "save_s", "load_fwd_s", "load_anon_r0", "load_anon_rN")


def _range(xs: list[float | None]) -> tuple[float, float] | None:
    got = [x for x in xs if x is not None]
    return (min(got), max(got)) if got else None


def run_ratios(results: dict[str, Any], clock: str = "warm") -> dict[tuple, dict[str, list[float]]]:
    """(mesh, world, size_gb) -> per figure of :data:`_SPREAD`, the single runs' ratios fsdptk /
    transformers, the two runs of each repeat paired (they ran back to back), in repeat order."""
    runs: dict[tuple, dict[str, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for rec in results["records"]:
        if rec.get("clock", "warm") == clock and rec["status"] == "ok":
            runs[(rec["mesh"], rec["world"], rec["size_gb"])][rec["method"]][rec["repeat"]] = _per_run(rec)
    out: dict[tuple, dict[str, list[float]]] = {}
    for cell, by in runs.items():
        ours, theirs = by.get("fsdptk", {}), by.get("transformers", {})
        out[cell] = {f: [ours[r][f] / theirs[r][f] for r in sorted(ours) if r in theirs
                         and ours[r].get(f) is not None and theirs[r].get(f)] for f in _SPREAD}
    return out


def aggregate(results: dict[str, Any], clock: str = "warm") -> dict[tuple, dict[str, Any]]:
    """(mesh, world, size_gb, method) -> medians over repeats (``range``: the single runs' min and
    max of the figures in :data:`_SPREAD`), status, checks."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for rec in results["records"]:
        if rec.get("clock", "warm") != clock:  # each clock has tables of its own
            continue
        groups[(rec["mesh"], rec["world"], rec["size_gb"], rec["method"])].append(rec)
    rows = {}
    for key, recs in groups.items():
        ok = [r for r in recs if r["status"] == "ok"]
        row: dict[str, Any] = {"status": "ok" if ok else recs[0]["status"], "error": None if ok else recs[0].get("error"),
                               "model_bytes": recs[0]["model_bytes"], "runs": len(ok)}
        if ok:
            per = [_per_run(r) for r in ok]
            row.update({k: _med([p.get(k) for p in per]) for k in dict.fromkeys(k for p in per for k in p)})
            row["range"] = {k: _range([p.get(k) for p in per]) for k in _SPREAD}
        checks = [r.get("check") for r in ok]
        voids = [c["void"] for c in checks if c and c.get("void")]
        row["check"] = ("VOID: " + voids[0]) if voids else ("ok" if checks and all(checks) else "unchecked")
        untrained = sorted({n for r in ok for rank in r["ranks"] for n in rank.get("step", {}).get("params_without_state", [])})
        if untrained:  # the step gave them no gradient: an optimizer built then would never train them
            row["check"] += f"; not trained by the step: {', '.join(untrained)}"
        diffs = [c["logits_max_diff"] for c in checks if c and c.get("logits_max_diff") is not None]
        row["logits_diff"] = max(diffs) if diffs else None
        rows[key] = row
    return rows


def _sort_key(key: tuple) -> tuple:
    mesh, world, size, method = key
    return (list(MESH_ORDER).index(mesh) if mesh in MESH_ORDER else 9, world, size, method != "transformers")


MESH_ORDER = ("fsdp", "fsdp-tp2", "fsdp-ep2")


def _order(mesh: str) -> int:
    return list(MESH_ORDER).index(mesh) if mesh in MESH_ORDER else 9


def _g(x: float | None, d: int = 2) -> str:
    return "-" if x is None else f"{x / GB:.{d}f}"


def _s(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def _sr(row: dict[str, Any], field: str) -> str:
    """``median (min-max)`` of a time over the single runs (the median alone for one run)."""
    rng = (row.get("range") or {}).get(field)
    if row.get(field) is None or rng is None or row.get("runs", 1) < 2:
        return _s(row.get(field))
    return f"{_s(row[field])} ({_s(rng[0])}-{_s(rng[1])})"


def _m(x: float | None) -> str:
    return "-" if x is None else f"{x / MB:,.0f}"


_CLOCK_TITLES = {"user": "### As a user's loop sees it (the `user` clock)\n\nBoth methods import what a script "
                 "imports at its top for either call (`torch`, `transformers`' `AutoModelForCausalLM` and "
                 "`DistributedConfig`, `fsdptk.hf`, `fsdptk.sharding`, `fsdptk.checkpoint`, `fsdptk.tp`), no "
                 "`gc.collect()` before the clock, each phase timed `barrier, clock, call, barrier, clock` (the "
                 "slowest rank); what either call imports on first use (transformers' modeling code) is inside "
                 "its clock.\n"}


def render(results: dict[str, Any]) -> str:
    """The tables of a result file (markdown): the warm clock's, the user clock's when the file has
    them, then the cold table and the bytes read."""
    clocks = {r.get("clock", "warm") for r in results["records"]}
    out = _render_clock(results, "warm") if "warm" in clocks or "user" not in clocks else ""
    if "user" in clocks:
        out += "\n" + _CLOCK_TITLES["user"] + "\n" + _render_clock(results, "user")
    return out + "\n".join([""] + cold_table(results) + [""] + read_table(results)) + "\n"


def _render_clock(results: dict[str, Any], clock: str) -> str:
    rows = aggregate(results, clock)
    keys = sorted((k for k in rows if rows[k]["status"] == "ok"), key=_sort_key)
    t = ["**Time** (s; max over ranks, median over repeats; in brackets the single runs' min-max):\n",
         "| mesh | ranks | model GB | method | load | first forward | load + forward | train step | save | "
         "imports + init | runs | check |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    m = ["**Memory** (GB; rank 0 / max of the other ranks; *peak*: `VmHWM` over the phase, reset at its start; "
         "*anon*: `RssAnon` after the phase; *heap trimmed*: after glibc's `malloc_trim(0)`, the live memory):\n",
         "| mesh | ranks | model GB | method | peak over load | anon after load | file pages after load | "
         "anon after forward | anon after train step | same, heap trimmed | RSS after train step | peak over "
         "save, rank 0 (above RSS before) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    b = ["**Bytes sent** (MB; rank 0 / max of the other ranks) beside the ideal (load: 0, every rank reads its own "
         "slices of the files; save: each rank > 0 sends its 1/ranks of the model to rank 0, rank 0 sends "
         "nothing):\n",
         "| mesh | ranks | model GB | method | load | save | save, ideal per rank > 0 |",
         "|---|---|---|---|---|---|---|"]
    for k in keys:
        r = rows[k]
        head = f"| {k[0]} | {k[1]} | {r['model_bytes'] / GB:.2f} | {k[3]} |"
        check = r["check"] + (f" (logits max diff {r['logits_diff']:.1e})" if r["logits_diff"] is not None else "")
        t.append(f"{head} {_sr(r, 'load_s')} | {_s(r['fwd_s'])} | {_sr(r, 'load_fwd_s')} | {_s(r.get('step_s'))} | "
                 f"{_sr(r, 'save_s')} | {_s(r['start_s'])} | {r['runs']} | {check} |")
        m.append(f"{head} {_g(r['load_peak_r0'])} / {_g(r['load_peak_rN'])} | {_g(r['load_anon_r0'])} / "
                 f"{_g(r['load_anon_rN'])} | {_g(r['load_file_r0'])} / {_g(r['load_file_rN'])} | "
                 f"{_g(r['fwd_anon_r0'])} / {_g(r['fwd_anon_rN'])} | {_g(r.get('step_anon_r0'))} / "
                 f"{_g(r.get('step_anon_rN'))} | {_g(r.get('step_live_r0'))} / {_g(r.get('step_live_rN'))} | {_g(r.get('step_rss_r0'))} / {_g(r.get('step_rss_rN'))} | "
                 f"{_g(r.get('save_peak_r0'))} ({_g(r.get('save_above_r0'))}) |")
        b.append(f"{head} {_m(r['load_sent_r0'])} / {_m(r['load_sent_rN'])} | {_m(r.get('save_sent_r0'))} / "
                 f"{_m(r.get('save_sent_rN'))} | {_m(r['model_bytes'] / k[1])} |")
    return "\n".join(t + [""] + m + [""] + b + [""] + _ratios(rows, run_ratios(results, clock))) + "\n"


def cold_table(results: dict[str, Any]) -> list[str]:
    """What a user feels: from the process start (each method importing only its own modules) to
    the loaded model and to the first finished step (max over ranks, median over repeats)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for rec in results["records"]:
        if rec.get("clock") == "cold" and rec["status"] == "ok":
            groups[(rec["mesh"], rec["world"], rec["size_gb"], rec["method"])].append(rec)
    if not groups:
        return []
    out = ["**From the process start** (cold: each method imports only its own modules; s, max over ranks, "
           "median over repeats; ratio fsdptk / transformers):\n",
           "| mesh | ranks | model GB | method | to the loaded model | to the first finished step | runs |",
           "|---|---|---|---|---|---|---|"]
    med: dict[tuple, tuple[float | None, float | None]] = {}
    for key in sorted(groups, key=_sort_key):
        recs = groups[key]
        loaded = _med([max(r["cold_loaded_s"] for r in rec["ranks"]) for rec in recs])
        step = _med([max(r.get("cold_step_s") or 0 for r in rec["ranks"]) or None for rec in recs])
        med[key] = (loaded, step)
        gb = recs[0]["model_bytes"] / GB
        out.append(f"| {key[0]} | {key[1]} | {gb:.2f} | {key[3]} | {_s(loaded)} | {_s(step)} | {len(recs)} |")
        other = (*key[:3], "transformers")
        if key[3] == "fsdptk" and other in med:
            (a, b), (c, d) = med[key], med[other]
            ratio = lambda x, y: "-" if x is None or not y else f"{x / y:.2f}x"  # noqa: E731
            out.append(f"| | | | ratio | {ratio(a, c)} | {ratio(b, d)} | |")
    return out


def read_table(results: dict[str, Any]) -> list[str]:
    """Bytes each rank read from the checkpoint's files over the load, beside the ideal (each byte
    once per replica: the files' bytes over the ranks that hold one replica)."""
    rows = aggregate(results)
    keys = [k for k in sorted(rows, key=_sort_key) if rows[k].get("load_read_r0") is not None]
    if not keys:
        return []
    files = {(r["mesh"], r["world"], r["size_gb"]): r.get("file_bytes") for r in results["records"]}
    dims = {(r["mesh"], r["world"], r["size_gb"]): (r.get("dp_shard") or 1) * (r.get("tp") or 1)
            for r in results["records"]}
    out = ["**Bytes read from the files** over the load (MB; rank 0 / max of the other ranks) beside the ideal "
           "(the files' bytes over the ranks that hold one replica):\n",
           "| mesh | ranks | model GB | method | read | ideal per rank |", "|---|---|---|---|---|---|"]
    for k in keys:
        r = rows[k]
        fb = files.get(k[:3])
        ideal = fb / dims[k[:3]] if fb else None
        out.append(f"| {k[0]} | {k[1]} | {r['model_bytes'] / GB:.2f} | {k[3]} | {_m(r['load_read_r0'])} / "
                   f"{_m(r['load_read_rN'])} | {_m(ideal)} |")
    return out


# (label, field, the target the issue sets or None)
_RATIOS = [("load", "load_s", "<= 0.7 at >= 2 GB, 2 and 4 ranks"), ("load + first forward", "load_fwd_s", "<= 1"),
           ("train step", "step_s", None), ("save", "save_s", None),
           ("anon after load, rank 0", "load_anon_r0", "<= 1"), ("anon after load, ranks > 0", "load_anon_rN", "<= 1"),
           ("anon after train step, rank 0", "step_anon_r0", "<= 1"),
           ("anon after train step, ranks > 0", "step_anon_rN", "<= 1"),
           ("peak over save, rank 0", "save_peak_r0", None)]


def _ratio_rows(rows: dict) -> list[tuple[tuple, dict[str, float | None]]]:
    out = []
    for k in sorted(rows, key=_sort_key):
        if k[3] != "fsdptk":
            continue
        ours, theirs = rows[k], rows.get((*k[:3], "transformers"))
        if not theirs or ours["status"] != "ok" or theirs["status"] != "ok":
            continue
        out.append((k, {f: (ours[f] / theirs[f] if theirs.get(f) and ours.get(f) else None) for _, f, _ in _RATIOS}))
    return out


def _target_met(field: str, key: tuple, ratio: float) -> bool | None:
    """Whether ``ratio`` meets the issue's target for ``field`` (judged at the two decimals shown)."""
    ratio = round(ratio, 2)
    if field == "load_s":
        return ratio <= LOAD_TARGET if key[2] >= 2 and key[1] in (2, 4) else None
    if field in ("load_fwd_s", "step_anon_r0", "step_anon_rN", "load_anon_r0", "load_anon_rN"):
        return ratio <= 1.0
    return None


def _ratios(rows: dict, per_run: dict[tuple, dict[str, list[float]]] | None = None) -> list[str]:
    lines = ["**fsdptk / transformers** (< 1: fsdptk is faster or leaner; **bold**: a target of issue 24 missed; "
             "load, load + first forward and save: the ratio of the medians, in brackets the single runs' ratios' "
             "min-max, the two methods' runs of each repeat paired):\n",
             "| mesh | ranks | model GB | " + " | ".join(f"{label}" for label, _, _ in _RATIOS) + " | check |",
             "|---|---|---|" + "---|" * (len(_RATIOS) + 1),
             "| target | | | " + " | ".join(t or "" for _, _, t in _RATIOS) + " | |"]
    for k, ratios in _ratio_rows(rows):
        cells = []
        for _, f, _ in _RATIOS:
            r = ratios[f]
            met = None if r is None else _target_met(f, k, r)
            cell = "-" if r is None else f"**{r:.2f}**" if met is False else f"{r:.2f}"
            single = (per_run or {}).get(k[:3], {}).get(f) or []
            if r is not None and len(single) > 1:
                cell += f" ({min(single):.2f}-{max(single):.2f})"
            cells.append(cell)
        lines.append(f"| {k[0]} | {k[1]} | {rows[k]['model_bytes'] / GB:.2f} | " + " | ".join(cells)
                     + f" | {rows[k]['check'].split(' (')[0]} |")
    return lines


def not_ahead(rows: dict) -> list[str]:
    """Lines for the cells where fsdptk is behind transformers (ratio > 1.00 at two decimals) or
    misses a target, then one line per metric where the two are equal (1.00)."""
    out, ties = [], defaultdict(list)
    for k, ratios in _ratio_rows(rows):
        cell = f"{k[0]}, {k[1]} ranks, {rows[k]['model_bytes'] / GB:.2f} GB"
        for label, f, _ in _RATIOS:
            r = ratios[f]
            if r is None:
                continue
            met = _target_met(f, k, r)
            if round(r, 2) > 1.0:
                out.append(f"- {label}: {r:.2f} at {cell} (behind)")
            elif met is False:
                out.append(f"- {label}: {r:.2f} at {cell} (ahead, but the target is missed)")
            elif round(r, 2) == 1.0:
                ties[label].append(cell)
    total = len(_ratio_rows(rows))
    out += [f"- {label}: equal (1.00) in {len(cells)} of {total} cells" for label, cells in ties.items()]
    return out


# ----------------------------------------------------------------------------------------------
_COLORS = {"fsdptk": "tab:blue", "transformers": "tab:red"}
_STYLES = {"fsdp": "-", "fsdp-tp2": "--", "fsdp-ep2": ":"}
_PANELS = [("load_s", "load (s)", 1), ("load_fwd_s", "load + first forward (s)", 1), ("save_s", "save (s)", 1),
           ("load_peak_rN", "peak RSS over load, max of ranks > 0 (GB)", GB),
           ("step_anon_r0", "RssAnon after train step, rank 0 (GB)", GB),
           ("save_peak_r0", "peak RSS over save, rank 0 (GB)", GB)]


def _lines(ax, rows: dict, x_of, keep, field: str, scale: float) -> None:
    for method in ("fsdptk", "transformers"):
        for mesh in MESH_ORDER:
            pts = sorted((x_of(k), rows[k][field] / scale) for k in rows
                         if k[3] == method and k[0] == mesh and keep(k) and rows[k]["status"] == "ok"
                         and rows[k].get(field) is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", color=_COLORS[method], linestyle=_STYLES[mesh], label=f"{method}, {mesh}")


def plot(results: dict[str, Any], img_dir: Path, *, world: int, size: float) -> list[Path]:
    """bench_hf_size.png (over model size at ``world`` ranks), bench_hf_world.png (over ranks at
    ``size`` GB), bench_hf_bytes.png (bytes sent per rank beside the ideal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = aggregate(results)
    img_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, x_of, keep, xlabel, title in [
        ("size", lambda k: rows[k]["model_bytes"] / GB, lambda k: k[1] == world, "model size (GB of fp32)",
         f"transformers' distributed path vs fsdptk over model size, {world} ranks"),
        ("world", lambda k: k[1], lambda k: k[2] == size, "ranks",
         f"transformers' distributed path vs fsdptk over ranks, {size:g} GB model"),
    ]:
        fig, axes = plt.subplots(2, 3, figsize=(14, 8), squeeze=False)
        for ax, (field, label, scale) in zip(axes.flat, _PANELS):
            _lines(ax, rows, x_of, keep, field, scale)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        path = img_dir / f"bench_hf_{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), squeeze=False)
    for ax, (x_of, keep, xlabel, ideal, what) in zip(axes[0], [
        (lambda k: k[1], lambda k: k[2] == size, "ranks", lambda k: rows[k]["model_bytes"] / k[1], f"save, {size:g} GB"),
        (lambda k: rows[k]["model_bytes"] / GB, lambda k: k[1] == world, "model size (GB)",
         lambda k: rows[k]["model_bytes"] / k[1], f"save, {world} ranks"),
    ]):
        _lines(ax, rows, x_of, keep, "save_sent_rN", MB)
        pts = sorted({(x_of(k), ideal(k) / MB) for k in rows if keep(k) and rows[k]["status"] == "ok"})
        if pts:
            ax.plot(*zip(*pts), color="black", linestyle=":", marker="x", label="ideal: model / ranks")
        ax.set_title(f"bytes sent per rank > 0 (max), {what}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("MB")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[0][2]
    _lines(ax, rows, lambda k: k[1], lambda k: k[2] == size, "load_sent_rN", 1e3)
    ax.axhline(0, color="black", linestyle=":", label="ideal: 0 (shard on read)")
    ax.set_title(f"bytes sent per rank > 0 (max), load, {size:g} GB")
    ax.set_xlabel("ranks")
    ax.set_ylabel("kB (metadata only)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = img_dir / "bench_hf_bytes.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------
def _shown(paths: str) -> str:
    """Space-separated paths, each relative to the repository when inside it."""
    out = []
    for path in paths.split():
        p = Path(path).resolve()
        out.append(str(p.relative_to(REPO)) if p.is_relative_to(REPO) else path)
    return " ".join(out)


def _run_line(meta: dict[str, Any]) -> str:
    return (f"- `{meta['command']}`: {meta['date']}, commit {meta.get('commit')}; {meta['cpus']} CPUs, "
            f"{meta['mem_total_GB']:.0f} GB RAM, {meta['platform']}; {meta['seconds'] / 60:.1f} min; load average "
            f"(1/5/15 min) before {' / '.join(f'{x:.1f}' for x in meta['loadavg_before'])}, at the end "
            f"{' / '.join(f'{x:.1f}' for x in meta['loadavg_end'])}; sizes {meta['sizes']} GB, ranks "
            f"{meta['worlds']}, meshes {meta['meshes']}, {meta['repeats']} repeat(s); glibc "
            + (f"`MALLOC_MMAP_THRESHOLD_={meta['malloc_mmap_threshold']}` in every rank; "
               if meta.get("malloc_mmap_threshold", 0) > 0 else "default malloc; ")
            + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v))


def section(results: dict[str, Any], *, source: str, notes: str, pngs: list[Path]) -> str:
    """The docs section (markers included) of a result file."""
    metas = results["meta"] if isinstance(results["meta"], list) else [results["meta"]]  # merged files
    meta = metas[0]
    rows = aggregate(results)
    lines = [HF_BEGIN, "## transformers' distributed path, and scaling\n",
             "_Generated by `python -m benchmarks hf --write-docs` from the run below; only the notes are written by "
             "hand (benchmarks/NOTES_hf.md)._\n",
             "fsdptk's Hugging Face load and save beside transformers' own distributed path, on the same "
             "checkpoint and mesh, fresh processes for each method (gloo over loopback, one torch thread per rank):\n",
             "- *transformers*: `AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig("
             "fsdp_size=D, tp_size=T))`, then `model.save_pretrained(dir)`;",
             "- *fsdptk*: `fsdptk.hf.from_pretrained(path, dims=ParallelDims(dp_shard=D, tp=T))`, then "
             "`fsdptk.save_safetensors(model, dir)`.\n",
             "Meshes: *fsdp* (D = ranks, T = 1) and *fsdp-tp2* (D = ranks / 2, T = 2). The model: a transformers "
             "Llama (`LlamaConfig`, untied embeddings; from 0.16 GB up width 1024, 16 heads / 4 KV heads, MLP 2752, vocab "
             "16384, the number of layers set by the size) written once per size with `save_pretrained` (one safetensors file, "
             "in the page cache when the runs read it). Every rank: imports and `init_process_group` (reported, not "
             "part of the load), then between barriers, each phase timed on every rank from the call to its return "
             "(the max over ranks is shown):\n",
             "1. **load**: the call above, setup included (config, meta model, mesh, TP, FSDP, reading the weights); "
             "on the *warm* clock both methods have imported the same modules (the union of theirs and the model's "
             "modeling module) and run `gc.collect()` before it; on the *user* clock (issue 44, when the run has it: "
             "tables of their own below) they have imported only what a script imports for either call, the "
             "modeling code is imported inside the call, no collection, and the clock runs barrier to barrier;",
             f"2. **first forward**: `model(input_ids=batch)` under `no_grad`, batch {meta['batch'][0]} x "
             f"{meta['batch'][1]} tokens, the same on every rank (transformers' loaded shards are views of the file "
             "mapping, read in the first forward: compare *load + first forward*);",
             "3. **train step**: forward with labels, backward, "
             + ("`torch.optim.SGD(lr=0).step()` (it writes every parameter, as any step does, and leaves the values)"
                if meta.get("optimizer") == "sgd" else
                "`torch.optim.AdamW(lr=0).step()`, the optimizer built right after the load (it allocates its two "
                "moments and writes every parameter, as a first real step does, and leaves the values)")
             + ", `zero_grad`;",
             "4. **save**.\n",
             "Memory from `/proc/self/status` after each phase: `RssAnon` (anonymous: what the process owns), "
             "`RssFile` (pages of mapped files: the page cache, reclaimable), `VmRSS`, and the peak `VmHWM` over the "
             "phase (reset through `/proc/self/clear_refs` at its start; it counts file pages too). Bytes sent: "
             "`wchar` of `/proc/self/io` over the phase minus the bytes of the files the rank wrote (gloo sends with "
             "`writev`). **Checked in the run**: the two methods' logits after the load agree (`torch.allclose`, "
             "rtol 1e-4, atol 1e-5) and the two saved directories hold bit-identical tensors (the checkpoint's); "
             "a mismatch marks the pair **VOID**.\n",
             "```\n" + "\n".join(m["command"] for m in metas) + "\n```\n",
             f"Results: `{_shown(source)}`. Re-render this section from them: `python -m benchmarks hf --from-json "
             f"{_shown(source)} --write-docs`.\n"]
    lines += [_run_line(m) for m in metas]
    lines[-1] += "\n"
    if notes.strip():
        lines += ["### Notes\n", notes.strip() + "\n"]
    lines += ["### Results\n", render(results)]
    behind = not_ahead(rows)
    lines += ["### Where fsdptk is not ahead of transformers (from the table above)\n",
              ("\n".join(behind) if behind else "- nowhere in this run") + "\n"]
    if pngs:
        lines += ["### Plots\n", "Solid lines: FSDP; dashed: FSDP x TP. Blue: fsdptk; red: transformers.\n"]
        lines += [f"![{p.stem}](img/{p.name})\n" for p in pngs]
    problems = [f"- {k[3]}, {k[0]}, {k[1]} ranks, {k[2]:g} GB: **{r['status']}**: {r['error']}"
                for k, r in sorted(rows.items(), key=lambda kv: _sort_key(kv[0])) if r["status"] != "ok"]
    if problems:
        lines += ["### Runs skipped, failed or not applicable\n", "\n".join(problems) + "\n"]
    lines.append(HF_END)
    return "\n".join(lines) + "\n"


def hf_section(page_text: str) -> str:
    """The blocks ``python -m benchmarks hf --write-docs`` owns in ``page_text`` (the dense
    section, then the FP8 and MoE sections when present), markers included, or ``""``."""
    out = ""
    for begin, end in ((HF_BEGIN, HF_END), _markers("qwen3_moe_fp8"), _markers("qwen3_moe")):
        start, stop = page_text.find(begin), page_text.find(end)
        if 0 <= start < stop:
            out += page_text[start:stop + len(end)] + "\n\n"
    return out.rstrip("\n") + "\n" if out else ""


def write_docs(results: dict[str, Any], page: Path, *, source: str, notes: str, plot_world: int,
               plot_size: float) -> list[Path]:
    """Replace (or insert, before the GPU section) the hf section of ``page``; write its plots."""
    pngs = plot(results, page.parent / "img", world=plot_world, size=plot_size)
    block = section(results, source=source, notes=notes, pngs=pngs)
    text = page.read_text() if page.is_file() else ""
    start, end = text.find(HF_BEGIN), text.find(HF_END)
    if 0 <= start < end:
        text = text[:start] + block + text[end + len(HF_END):].lstrip("\n")
    elif GPU_BEGIN in text:
        at = text.find(GPU_BEGIN)
        text = text[:at] + block + "\n" + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    page.write_text(text)
    return [page, *pngs]


def _markers(model: str) -> tuple[str, str]:
    tag = "hf-fp8-section" if model.endswith("_fp8") else "hf-moe-section"
    return (f"<!-- {tag}: written by `python -m benchmarks hf --model {model} --write-docs`; kept when the rest "
            f"of the page is regenerated -->", f"<!-- /{tag} -->")
# the targets of the MoE row (fsdptk / transformers): load, save, memory
MOE_TARGETS = {"load_s": 0.7, "save_s": 0.5, "step_anon_r0": 1.0, "step_anon_rN": 1.0, "load_anon_r0": 1.0,
               "load_anon_rN": 1.0, "save_peak_r0": 1.0}


def moe_section(results: dict[str, Any], *, source: str, notes: str, model: str = "qwen3_moe") -> str:
    """The MoE (or FP8) section (markers included): every table of :func:`render` plus the targets."""
    metas = results["meta"] if isinstance(results["meta"], list) else [results["meta"]]
    rows = aggregate(results)
    begin, end = _markers(model)
    fp8 = model.endswith("_fp8")
    title = ("## FP8 releases dequantized on read, beside transformers\n" if fp8 else
             "## Mixture-of-Experts checkpoints in the Hub layout, beside transformers\n")
    what = ("The same Qwen3-MoE-shaped model as an FP8 release: every projection weight block-quantized "
            "(`float8_e4m3fn`, 128 x 128 blocks, float32 `weight_scale_inv`) by transformers' own quantizer "
            "(`Fp8Quantize`), `quantization_config` in `config.json`; transformers loads it with "
            "`quantization_config=FineGrainedFP8Config(dequantize=True)` beside its `distributed_config`, fsdptk "
            "with `fsdptk.hf.from_pretrained(path, dims=...)` and no extra argument (docs/layouts.md). No save "
            "(transformers re-quantizes on save, fsdptk writes the unquantized model: not comparable). "
            if fp8 else "")
    lines = [begin, title, what,
             f"_Generated by `python -m benchmarks hf --model {model} --write-docs` from the run below; only the "
             f"notes are written by hand (benchmarks/NOTES_hf_{'fp8' if fp8 else 'moe'}.md)._\n",
             "A Qwen3-MoE-shaped model (16 experts of intermediate size 512 per layer, 2 routed per token, width "
             "1024) written by `save_pretrained` in the Hub layout (one tensor per expert: `mlp.experts.<i>."
             "gate_proj.weight`, ...), loaded into the fused 3-D experts by transformers' distributed "
             "`from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=D))` and by "
             "`fsdptk.hf.from_pretrained(path, dims=ParallelDims(dp_shard=D))` (docs/layouts.md), then a first "
             "forward, one training step and the save back into the Hub layout (`save_pretrained` / "
             "`fsdptk.save_safetensors`); the phases and measures are those of the section above. The clocks "
             "are fair: a *warm* run imports the same modules for both methods (the union) before its clock and "
             "times the load call; a *cold* run imports only its method's modules and is timed from the process "
             "start to the loaded model and to the first finished step. `gc.collect()` before every clock; the "
             "checkpoint's files are read into the page cache before every run. **Checked in the run**: the same "
             "logits, and both saved directories bit-identical (the source checkpoint's tensors: the Hub layout).\n",
             "" if fp8 else "Mesh `fsdp-ep2` (issue \"Expert parallelism\"): the same model with expert parallelism "
             "over 2 ranks, `DistributedConfig(fsdp_size=D, ep_size=2)` (transformers' all-to-all dispatch) beside "
             "`ParallelDims(dp_shard=D, ep=2)` (fsdptk's, docs/expert_parallel.md); each rank then holds 1/D of "
             "the experts as whole experts, the dense weights FSDP-sharded as in `fsdp`.\n",
             "```\n" + "\n".join(m["command"] for m in metas) + "\n```\n",
             f"Results: `{_shown(source)}`.\n"]
    lines += [_run_line(m) for m in metas]
    lines += ["", render(results)]
    target = ["**Targets** (fsdptk / transformers, warm runs): load <= 0.7x, save <= 0.5x, memory <= 1x:\n",
              "| mesh | ranks | load | save | anon after load (rank 0 / others) | anon after step (rank 0 / others) | "
              "peak over save, rank 0 |", "|---|---|---|---|---|---|---|"]
    for key in sorted({k[:3] for k in rows}, key=lambda k: (k[1], _order(k[0]))):
        ours, theirs = rows.get((*key, "fsdptk")), rows.get((*key, "transformers"))
        if not ours or not theirs or ours["status"] != "ok" or theirs["status"] != "ok":
            continue

        def cell(field: str, ours=ours, theirs=theirs) -> str:
            a, b = ours.get(field), theirs.get(field)
            if a is None or not b:
                return "-"
            ratio = a / b
            return f"{ratio:.2f}" if round(ratio, 2) <= MOE_TARGETS[field] else f"**{ratio:.2f}**"

        target.append(f"| {key[0]} | {key[1]} | {cell('load_s')} | {cell('save_s')} | {cell('load_anon_r0')} / "
                      f"{cell('load_anon_rN')} | {cell('step_anon_r0')} / {cell('step_anon_rN')} | "
                      f"{cell('save_peak_r0')} |")
    lines += target + [""]
    if notes.strip():
        lines += ["### Notes\n", notes.strip() + "\n"]
    lines.append(end)
    return "\n".join(lines) + "\n"


def write_moe_docs(results: dict[str, Any], page: Path, *, source: str, notes: str,
                   model: str = "qwen3_moe") -> list[Path]:
    """Rewrite (or append) the MoE (or FP8) section of ``page``."""
    block = moe_section(results, source=source, notes=notes, model=model)
    begin, end_marker = _markers(model)
    text = page.read_text()
    start, end = text.find(begin), text.find(end_marker)
    if 0 <= start < end:
        text = text[:start] + block + text[end + len(end_marker):].lstrip("\n")
    else:
        hf_end = text.find(HF_END)
        at = hf_end + len(HF_END) if hf_end >= 0 else len(text)
        text = text[:at] + "\n\n" + block + text[at:]
    page.write_text(text)
    return [page]
