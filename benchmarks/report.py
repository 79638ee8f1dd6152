"""Turn run records into tables (markdown), ratios, limits, plots, and the results page.

Per (scenario, method, world, size), over the repeats:
- time: the operation between barriers, max over ranks; median and min-max over repeats;
- peak RSS: OS high-water mark at the end of the operation, rank 0 and the max over ranks > 0,
  with the baseline (high-water mark just before) and the delta (what the operation added);
- sent: bytes rank 0 / the busiest other rank wrote to sockets during the operation, beside the
  bytes the method's data placement requires (see :func:`ideal_bytes`);
- limit: the time the operation would take at the measured physical bandwidths, for the data
  placement the method assumes (see :func:`ideal_time`), and measured time's share of it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from .hf_report import hf_section
from .markers import GPU_BEGIN, GPU_END
from .methods import METHODS, PEERS, SCENARIO_TITLES, SCENARIOS

__all__ = ["aggregate", "render_tables", "write_docs", "ideal_time", "ideal_bytes", "plot_scaling",
           "render_scaling", "gpu_section", "render_gpu_section", "write_gpu_section"]

MB = 1e6


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(results: dict) -> tuple[dict, dict]:
    """``(rows, limits)``: rows keyed by (scenario, method, world, size), limits by (world, size)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for rec in results["records"]:
        groups[(rec["scenario"], rec["method"], rec["world"], rec["size_gb"])].append(rec)
    rows, limits = {}, {}
    for key, recs in groups.items():
        scenario = key[0]
        ok = [r for r in recs if r["status"] == "ok"]
        if scenario == "limits":
            if ok:
                names = ok[0]["ranks"][0]["limits"].keys()
                limits[key[2:]] = {n: _med([r["ranks"][0]["limits"][n] for r in ok]) for n in names}
            continue
        row = {"n": len(ok), "runs": len(recs), "status": recs[0]["status"] if not ok else "ok",
               "error": next((r["error"] for r in recs if r.get("error")), None),
               "model_bytes": recs[0]["model_bytes"], "file_bytes": recs[0].get("file_bytes")}
        if ok:
            times = [max(x.get("time_s") or 0.0 for x in r["ranks"]) for r in ok]
            row.update(time=_med(times), tmin=min(times), tmax=max(times))
            r0 = [r["ranks"][0] for r in ok]
            rest = [r["ranks"][1:] for r in ok]
            row["peak0"] = _med([x.get("peak_rss") for x in r0])
            row["base0"] = _med([x.get("baseline_peak_rss") for x in r0])
            row["peakN"] = _med([max((x.get("peak_rss") or 0) for x in rs) for rs in rest if rs])
            row["baseN"] = _med([max((x.get("baseline_peak_rss") or 0) for x in rs) for rs in rest if rs])
            row["delta0"] = _med([_delta(x) for x in r0])
            row["deltaN"] = _med([max(ds) for rs in rest if rs for ds in [[d for d in map(_delta, rs) if d is not None]] if ds])
            row["cuda0"] = _med([x.get("cuda_peak") for x in r0])  # None on CPU runs
            row["cudaN"] = _med([max(x.get("cuda_peak") or 0 for x in rs) for rs in rest if rs]) \
                if row["cuda0"] is not None else None
            row["sent0"] = _med([x.get("sent_bytes") for x in r0])
            row["sent_all"] = _med([sum(x.get("sent_bytes") or 0 for x in r["ranks"]) for r in ok]) \
                if any(x.get("sent_bytes") is not None for x in r0) else None
            row["sentN"] = _med([max((x.get("sent_bytes") or 0) for x in rs) for rs in rest if rs]) \
                if any(x.get("sent_bytes") is not None for rs in rest for x in rs) else None
            row["written"] = [_med([r["ranks"][i].get("file_write_bytes") for r in ok])
                              for i in range(len(r0 and ok[0]["ranks"]))] \
                if any(x.get("file_write_bytes") is not None for x in r0) else None
            checks = [x.get("check") for r in ok for x in r["ranks"] if x.get("check")]
            row["check"] = "ok" if checks and all(c == "ok" for c in checks) else \
                next((c for c in checks if c != "ok"), "-")
        rows[key] = row
    return rows, limits


def _delta(x: dict):
    if x.get("peak_rss") is None or x.get("baseline_peak_rss") is None:
        return None
    return x["peak_rss"] - x["baseline_peak_rss"]


_RANK0_SOURCE = {"fsdptk", "dcp", "accelerate", "fsdptk_rank0_read"}


def ideal_time(scenario: str, method: str, world: int, row: dict, lim: dict | None) -> float | None:
    """Seconds the operation needs at the measured bandwidths (``None`` when not defined).

    - rank 0 holds or reads the data: its share for the others must leave rank 0, (w-1)/w x bytes
      at the scatter bandwidth (plus, when read from the file, the read: the larger of the two,
      as a pipelined loader overlaps them);
    - every rank holds the data: each copies its 1/w (memcpy); every rank reads the file: its 1/w
      of the file, all at once (aggregate read bandwidth);
    - gathers: (w-1)/w x bytes into rank 0 at the gather bandwidth; save: the larger of that
      and writing the file;
    - optimizer (AdamW): twice the model bytes (exp_avg, exp_avg_sq).
    """
    if not lim:
        return None
    m = row["model_bytes"]
    f = row.get("file_bytes") or m
    frac = (world - 1) / world
    gb = 1e9
    if scenario == "load_mem":
        return m * frac / (lim["scatter"] * gb) if method in _RANK0_SOURCE else m / world / (lim["memcpy"] * gb)
    if scenario == "load_st":
        if method in _RANK0_SOURCE:
            return max(f / (lim["file_read"] * gb), m * frac / (lim["scatter"] * gb))
        return f / (lim["file_read_all"] * gb)
    if scenario == "gather":
        return m * frac / (lim["gather"] * gb)
    if scenario == "save":
        return max(m * frac / (lim["gather"] * gb), f / (lim["file_write"] * gb))
    if scenario == "optim_gather":
        return 2 * m * frac / (lim["gather"] * gb)
    if scenario == "optim_load":
        return 2 * m * frac / (lim["scatter"] * gb) if method in _RANK0_SOURCE else 2 * m / world / (lim["memcpy"] * gb)
    return None


def ideal_bytes(scenario: str, method: str, world: int, row: dict) -> dict | None:
    """Bytes each rank must send for the data placement the method assumes (``None`` when not defined).

    Returns ``{"sent0": ..., "sentN": ..., "placement": ...}``: what rank 0 must send and what each
    rank > 0 must send (the busiest of them, as ``sentN`` of :func:`aggregate` is), in bytes, with
    ``m`` the model's bytes (parameters, not the file) and ``w`` the world size. The placements are
    those of :func:`ideal_time`:

    - rank 0 holds or reads the data (``load_mem`` / ``load_st`` with a method of ``_RANK0_SOURCE``):
      every other rank's share must leave rank 0, (w-1)/w x m from rank 0, 0 from the others;
    - every rank holds the data (``fsdptk_all``, torchtune) or reads its own slices from the file
      (shard-on-read): each keeps its 1/w, nothing needs to be sent;
    - gather, and save through rank 0: each rank > 0 sends its 1/w x m to rank 0, rank 0 sends 0;
    - optimizer (AdamW): the same for twice the model bytes (exp_avg, exp_avg_sq): ``optim_gather``
      2 x m / w from each rank > 0; ``optim_load`` 2 x (w-1)/w x m from rank 0 when rank 0 holds
      the full state, 0 when every rank does (torchtune).
    """
    m = row["model_bytes"]
    frac = (world - 1) / world
    rank0 = method in _RANK0_SOURCE
    if scenario in ("load_mem", "load_st"):
        if rank0:
            return {"sent0": m * frac, "sentN": 0.0, "placement": "rank 0 holds/reads"}
        held = "each rank reads its slices" if method.endswith("shard_on_read") else "every rank holds/reads"
        return {"sent0": 0.0, "sentN": 0.0, "placement": held}
    if scenario in ("gather", "save"):
        return {"sent0": 0.0, "sentN": m / world if world > 1 else 0.0, "placement": "gather to rank 0"}
    if scenario == "optim_gather":
        return {"sent0": 0.0, "sentN": 2 * m / world if world > 1 else 0.0, "placement": "gather to rank 0"}
    if scenario == "optim_load":
        if rank0:
            return {"sent0": 2 * m * frac, "sentN": 0.0, "placement": "rank 0 holds"}
        return {"sent0": 0.0, "sentN": 0.0, "placement": "every rank holds"}
    return None


def _mb(x) -> str:
    return "-" if x is None else f"{x / MB:,.0f}"


def _s(x) -> str:
    return "-" if x is None else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def _sorted_keys(rows: dict) -> list[tuple]:
    order = {s: i for i, s in enumerate(SCENARIOS)}

    def mkey(scenario, method):
        names = list(METHODS.get(scenario, {"fsdptk": None}))
        return names.index(method) if method in names else 99

    return sorted(rows, key=lambda k: (-k[2], k[3], order.get(k[0], 99), mkey(k[0], k[1]), k[1]))


def render_limits(limits: dict) -> str:
    if not limits:
        return "_no physical-limit run_\n"
    names = ["scatter", "broadcast", "gather", "all_gather", "memcpy", "file_read", "file_read_all", "file_write"]
    out = ["| ranks | model GB | buffer MB | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(names)]
    for (world, size), lim in sorted(limits.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        out.append(f"| {world} | {size:g} | {lim['buffer_GB'] * 1e3:,.0f} | "
                   + " | ".join(f"{lim[n]:.2f}" for n in names) + " |")
    return "\n".join(out) + "\n"


def render_main(rows: dict, limits: dict) -> str:
    if any(r.get("cuda0") is not None for r in rows.values()):
        return render_cuda(rows)
    out = ["| scenario | method | ranks | model GB | time s (median) | min-max s | limit s | % of limit | "
           "peak RSS r0 MB | Δ r0 MB | peak RSS r>0 MB (max) | Δ r>0 MB | sent r0 MB | sent r>0 MB | check |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in _sorted_keys(rows):
        scenario, method, world, size = key
        row = rows[key]
        if row["status"] != "ok":
            why = (row.get("error") or "").replace("|", "/").replace("\n", " ")[:220]
            out.append(f"| {scenario} | {method} | {world} | {size:g} | **{row['status']}** | | | | | | | | | | {why} |")
            continue
        ideal = ideal_time(scenario, method, world, row, limits.get((world, size)))
        pct = f"{100 * ideal / row['time']:.0f}%" if ideal and row["time"] else "-"
        chk = str(row["check"]).replace("|", "/")[:120]
        out.append(
            f"| {scenario} | {method} | {world} | {size:g} | {_s(row['time'])} | {_s(row['tmin'])}-{_s(row['tmax'])} | "
            f"{_s(ideal)} | {pct} | {_mb(row['peak0'])} | {_mb(row['delta0'])} | {_mb(row['peakN'])} | "
            f"{_mb(row['deltaN'])} | {_mb(row['sent0'])} | {_mb(row['sentN'])} | {chk} |")
    return "\n".join(out) + "\n"


def render_cuda(rows: dict) -> str:
    """The results of a ``--device cuda`` run: time, CUDA peak (above what the rank held before the
    operation, ``torch.cuda.max_memory_allocated``) and host peak RSS, rank 0 and the other ranks."""
    out = ["| scenario | method | ranks | model GB | time s (median) | min-max s | CUDA peak r0 MB | "
           "CUDA peak r>0 MB (max) | peak RSS r0 MB | peak RSS r>0 MB (max) | check |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in _sorted_keys(rows):
        scenario, method, world, size = key
        row = rows[key]
        if row["status"] != "ok":
            why = (row.get("error") or "").replace("|", "/").replace("\n", " ")[:220]
            out.append(f"| {scenario} | {method} | {world} | {size:g} | **{row['status']}** | | | | | | {why} |")
            continue
        chk = str(row["check"]).replace("|", "/")[:120]
        out.append(f"| {scenario} | {method} | {world} | {size:g} | {_s(row['time'])} | {_s(row['tmin'])}-"
                   f"{_s(row['tmax'])} | {_mb(row.get('cuda0'))} | {_mb(row.get('cudaN'))} | {_mb(row['peak0'])} | "
                   f"{_mb(row['peakN'])} | {chk} |")
    return "\n".join(out) + "\n"


def _ratio(a, b, floor: float = 0.0) -> str:
    if a is None or b is None:
        return "-"
    if b <= floor:
        return "fsdptk ~0" if a > floor else "both ~0"  # below the floor a ratio is noise
    return f"{a / b:.2f}x"


def render_ratios(rows: dict) -> str:
    """peer / fsdptk for time and peak RSS (>1: fsdptk is faster / leaner)."""
    out = ["| scenario | ranks | model GB | fsdptk method | peer | time peer/fsdptk | peak RSS r0 peer/fsdptk | "
           "peak RSS r>0 peer/fsdptk | Δ r0 peer/fsdptk | Δ r>0 peer/fsdptk | bytes sent (all ranks) peer/fsdptk |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in _sorted_keys(rows):
        scenario, method, world, size = key
        mine = rows[key]
        if not method.startswith("fsdptk") or mine["status"] != "ok":
            continue
        for peer in PEERS:
            other = rows.get((scenario, peer, world, size))
            if other is None:
                continue
            if other["status"] != "ok":
                out.append(f"| {scenario} | {world} | {size:g} | {method} | {peer} | {other['status']} | | | | | | |")
                continue
            out.append(f"| {scenario} | {world} | {size:g} | {method} | {peer} | {_ratio(other['time'], mine['time'])} | "
                       f"{_ratio(other['peak0'], mine['peak0'])} | {_ratio(other['peakN'], mine['peakN'])} | "
                       f"{_ratio(other['delta0'], mine['delta0'], 16e6)} | {_ratio(other['deltaN'], mine['deltaN'], 16e6)} | "
                       f"{_ratio(other['sent_all'], mine['sent_all'], 1e6)} |")
    return "\n".join(out) + "\n"


def render_methods() -> str:
    out = ["| scenario | method | what is timed |", "|---|---|---|"]
    for scenario, methods in METHODS.items():
        for name, m in methods.items():
            out.append(f"| {scenario} | {name} | {m.what} |")
    out.append("| ttfs | fsdptk | launch of `examples/train_llama.py` on every rank -> rank 0 logs step 1 |")
    return "\n".join(out) + "\n"


def render_writers(rows: dict) -> str:
    """The save rows with the bytes every rank wrote to files (``/proc/self/io`` ``write_bytes``):
    one writer against several (``fsdptk_w2``, ``fsdptk_w4``)."""
    out = ["| method | ranks | model GB | time s (median) | peak RSS r0 MB | Δ r0 MB | Δ r>0 MB (max) | "
           "MB written to files by rank 0, 1, ... |", "|---|---|---|---|---|---|---|---|"]
    for key in _sorted_keys(rows):
        scenario, method, world, size = key
        row = rows[key]
        if scenario != "save" or row["status"] != "ok":
            continue
        written = ", ".join(_mb(w) for w in row.get("written") or [])
        out.append(f"| {method} | {world} | {size:g} | {_s(row['time'])} | {_mb(row['peak0'])} | "
                   f"{_mb(row['delta0'])} | {_mb(row['deltaN'])} | {written or '-'} |")
    return "\n".join(out) + "\n"


def render_tables(results: dict) -> str:
    rows, limits = aggregate(results)
    writers = render_writers(rows) if any(k[0] == "save" for k in rows) else ""
    return ("\n## Physical limits (GB/s)\n\n" + render_limits(limits) + "\n## Results\n\n" + render_main(rows, limits)
            + "\n## Ratios (peer / fsdptk; > 1 means fsdptk is faster or leaner)\n\n" + render_ratios(rows)
            + ("\n## Saves: bytes written to files per rank\n\n" + writers if writers else ""))


# ----------------------------------------------------------------------------------------------
# plots and the results page
_COLORS = {"fsdptk": "tab:blue", "fsdptk_all": "tab:cyan", "fsdptk_shard_on_read": "tab:blue",
           "fsdptk_rank0_read": "tab:cyan", "dcp": "tab:orange", "torchtune": "tab:green", "accelerate": "tab:red"}


def plot(results: dict, img_dir: Path) -> list[Path]:
    """One PNG per scenario: time, peak RSS rank 0, peak RSS ranks > 0 vs model size, per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, _ = aggregate(results)
    img_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for scenario in SCENARIOS:
        keys = [k for k in rows if k[0] == scenario and rows[k]["status"] == "ok"]
        if not keys:
            continue
        worlds = sorted({k[2] for k in keys})
        methods = [m for m in list(METHODS.get(scenario, {})) + ["fsdptk"] if any(k[1] == m for k in keys)]
        methods = list(dict.fromkeys(methods))
        fig, axes = plt.subplots(3, len(worlds), figsize=(4.2 * len(worlds), 9), squeeze=False)
        for j, world in enumerate(worlds):
            for i, (field, label) in enumerate([("time", "time (s)"), ("peak0", "peak RSS rank 0 (GB)"),
                                                ("peakN", "peak RSS, max of ranks > 0 (GB)")]):
                ax = axes[i][j]
                for m in methods:
                    pts = sorted((k[3], rows[k][field]) for k in keys if k[1] == m and k[2] == world
                                 and rows[k].get(field) is not None)
                    if not pts:
                        continue
                    xs, ys = zip(*pts)
                    ys = ys if field == "time" else [y / 1e9 for y in ys]
                    ax.plot(xs, ys, marker="o", label=m, color=_COLORS.get(m),
                            linestyle="-" if m.startswith("fsdptk") else "--")
                ax.set_xlim(left=0)
                ax.set_ylim(bottom=0)
                ax.set_xlabel("model size (GB)")
                ax.set_ylabel(label)
                if i == 0:
                    ax.set_title(f"{world} ranks")
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(SCENARIO_TITLES.get(scenario, scenario))
        fig.tight_layout()
        path = img_dir / f"bench_{scenario}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _scaling_scenarios(rows: dict) -> list[str]:
    """The scenarios with results at two or more model sizes or world sizes."""
    out = []
    for scenario in SCENARIOS:
        keys = [k for k in rows if k[0] == scenario and rows[k]["status"] == "ok"]
        if len({k[2] for k in keys}) >= 2 or len({k[3] for k in keys}) >= 2:
            out.append(scenario)
    return out


def _pick_world(worlds, want: int) -> int:
    return want if want in worlds else max(worlds)


def _pick_size(sizes, want: float) -> float:
    return min(sizes, key=lambda s: (abs(s - want), -s))


def _cpus(results: dict) -> int | None:
    metas = results.get("meta", {})
    metas = metas if isinstance(metas, list) else [metas]
    cpus = [m["cpus"] for m in metas if m.get("cpus")]
    return min(cpus) if cpus else None


def _queue_note(cpus: int | None, worlds) -> str:
    """What the time over ranks means when there are more ranks than CPU cores ("" when not)."""
    if not cpus or max(worlds) <= cpus:
        return ""
    w = max(worlds)
    how = "is mostly that queue" if w >= 4 * cpus else "includes that queue"
    return (f"with more ranks than the {cpus} CPU cores, ranks queue for the cores: at {w} ranks ({w / cpus:g} per "
            f"core) the time {how}; bytes sent and peak memory do not depend on it")


def _methods_in(scenario: str, keys) -> list[str]:
    methods = [m for m in list(METHODS.get(scenario, {})) + ["fsdptk"] if any(k[1] == m for k in keys)]
    return list(dict.fromkeys(methods))


def plot_scaling(results: dict, img_dir: Path, *, world: int = 4, size: float = 1.0) -> list[Path]:
    """``bench_scaling_<scenario>.png`` for each scenario with results at >= 2 sizes or worlds.

    Four panels: (a) time over model size at ``world`` ranks (the largest world when ``world`` was
    not run), (b) time over ranks at ``size`` GB (the nearest size run), (c) peak RSS of rank 0
    (solid) and the max of ranks > 0 (dashed) over ranks, (d) bytes sent by rank 0 (solid) and the
    busiest other rank (dashed) over ranks, with :func:`ideal_bytes` as thin black (rank 0) and
    grey (ranks > 0) lines, one per data placement. One colour per method, as in :func:`plot`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows, _ = aggregate(results)
    cpus = _cpus(results)
    paths = []
    for scenario in _scaling_scenarios(rows):
        keys = [k for k in rows if k[0] == scenario and rows[k]["status"] == "ok"]
        w_at = _pick_world({k[2] for k in keys}, world)
        s_at = _pick_size({k[3] for k in keys}, size)
        at_size = [k for k in keys if k[3] == s_at]
        worlds = sorted({k[2] for k in at_size})
        methods = _methods_in(scenario, keys)
        img_dir.mkdir(parents=True, exist_ok=True)
        fig, axes = plt.subplots(1, 4, figsize=(19, 4.8), squeeze=False)
        ax_size, ax_rank, ax_mem, ax_sent = axes[0]

        def line(ax, pts, m, style, label):
            pts = sorted(p for p in pts if p[1] is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", color=_COLORS.get(m), linestyle=style, label=label,
                        zorder=3 if m.startswith("fsdptk") else 2)  # fsdptk on top where lines coincide

        for m in methods:
            style = "-" if m.startswith("fsdptk") else "--"
            line(ax_size, [(k[3], rows[k]["time"]) for k in keys if k[1] == m and k[2] == w_at], m, style, m)
            line(ax_rank, [(k[2], rows[k]["time"]) for k in at_size if k[1] == m], m, style, m)
            for field, st, lab in [("peak0", "-", m), ("peakN", "--", None)]:
                line(ax_mem, [(k[2], rows[k][field] and rows[k][field] / 1e9) for k in at_size if k[1] == m],
                     m, st, lab)
        sent = [rows[k][f] for k in at_size for f in ("sent0", "sentN") if rows[k].get(f) is not None]
        ideals: dict[tuple, list[str]] = {}
        for m in methods:
            per = {k[2]: ideal_bytes(scenario, m, k[2], rows[k]) for k in at_size if k[1] == m}
            if any(v is None for v in per.values()) or not per:
                continue
            for field in ("sent0", "sentN"):
                curve = tuple(sorted((w, v[field]) for w, v in per.items() if v is not None))
                label = next(v["placement"] for v in per.values() if v is not None)
                ideals.setdefault((field, curve), [])
                if label not in ideals[(field, curve)]:
                    ideals[(field, curve)].append(label)
        scale, unit = (1e9, "GB") if max(sent + [v for (_, c) in ideals for _, v in c], default=0) >= 1e9 else (MB, "MB")
        for m in methods:
            for field, st, lab in [("sent0", "-", m), ("sentN", "--", None)]:
                line(ax_sent, [(k[2], rows[k].get(field) and rows[k][field] / scale) for k in at_size if k[1] == m],
                     m, st, lab)
        for (field, curve), labels in ideals.items():
            xs, ys = zip(*curve)
            who = "r0" if field == "sent0" else "r>0"
            ax_sent.plot(xs, [y / scale for y in ys], color="black" if field == "sent0" else "grey",
                         linestyle="-" if field == "sent0" else "--", linewidth=0.8, marker="x", markersize=5,
                         label=f"ideal {who}: " + "; ".join(labels))
        note = _queue_note(cpus, worlds)
        for ax, title, xlabel, ylabel in [
            (ax_size, f"(a) time over model size, {w_at} ranks", "model size (GB)", "time (s)"),
            (ax_rank, f"(b) time over ranks, {s_at:g} GB" + (f"\n{cpus} CPU cores: ranks > {cpus} queue for them"
                                                              if note else ""),
             "ranks" + (f" (at {max(worlds)}: {max(worlds) / cpus:g} per core)" if note else ""), "time (s)"),
            (ax_mem, f"(c) peak RSS over ranks, {s_at:g} GB", "ranks",
             "peak RSS (GB): rank 0 solid, max of ranks > 0 dashed"),
            (ax_sent, f"(d) bytes sent per rank over ranks, {s_at:g} GB", "ranks",
             f"sent ({unit}): rank 0 solid, busiest rank > 0 dashed"),
        ]:
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel, fontsize=9)
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        for ax in (ax_rank, ax_mem, ax_sent):
            ax.set_xticks(worlds)
        ax_size.legend(fontsize=7)
        ax_mem.legend(handles=ax_mem.get_legend_handles_labels()[0]
                      + [Line2D([], [], color="black", linestyle="-", label="rank 0"),
                         Line2D([], [], color="black", linestyle="--", label="max of ranks > 0")], fontsize=7)
        ax_sent.legend(fontsize=6)
        fig.suptitle(f"{scenario}: {SCENARIO_TITLES.get(scenario, scenario)}" + (f"  ({note})" if note else ""),
                     fontsize=11)
        fig.tight_layout()
        path = img_dir / f"bench_scaling_{scenario}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def render_scaling(rows: dict, scenario: str) -> str:
    """One table for ``scenario``: a row per (model size, ranks); each method's time and peak RSS of
    rank 0, and each fsdptk method's bytes sent by rank 0 / the busiest other rank beside
    :func:`ideal_bytes`."""
    keys = [k for k in rows if k[0] == scenario]
    methods = _methods_in(scenario, keys)
    mine = [m for m in methods if m.startswith("fsdptk")
            and any(ideal_bytes(scenario, m, k[2], rows[k]) for k in keys if k[1] == m)]
    cells = sorted({(k[3], k[2]) for k in keys})
    out = ["| model GB | ranks | " + " | ".join(f"{m} s / peak r0 GB" for m in methods)
           + "".join(f" | {m} sent r0 / r>0 MB (ideal)" for m in mine) + " |",
           "|---|---|" + "---|" * (len(methods) + len(mine))]
    for size, world in cells:
        line = [f"{size:g}", str(world)]
        for m in methods:
            row = rows.get((scenario, m, world, size))
            if row is None:
                line.append("")
            elif row["status"] != "ok":
                line.append(row["status"])
            else:
                line.append(f"{_s(row['time'])} / {_gb(row['peak0'])}")
        for m in mine:
            row = rows.get((scenario, m, world, size))
            ideal = ideal_bytes(scenario, m, world, row) if row and row["status"] == "ok" else None
            if ideal is None:
                line.append("" if row is None else row["status"])
            else:
                line.append(f"{_mb(row['sent0'])} / {_mb(row['sentN'])} "
                            f"({_mb(ideal['sent0'])} / {_mb(ideal['sentN'])})")
        out.append("| " + " | ".join(line) + " |")
    return "\n".join(out) + "\n"


def _scaling_section(results: dict, rows: dict, pngs: list[Path], world: int, size: float) -> list[str]:
    if not pngs or (len({k[2] for k in rows}) < 2 and len({k[3] for k in rows}) < 2):
        return []
    ok = [k for k in rows if rows[k]["status"] == "ok"]
    note = _queue_note(_cpus(results), {k[2] for k in ok} or {1})
    parts = ["## Scaling\n",
             "Each figure: (a) time over model size at one world size, (b) time over ranks at one model size, "
             "(c) peak RSS of rank 0 (solid) and the max of ranks > 0 (dashed) over ranks, (d) bytes sent by "
             "rank 0 (solid) and the busiest other rank (dashed) over ranks, with the bytes the method's data "
             "placement requires as thin black (rank 0) and grey (ranks > 0) lines. "
             + (f"Time over ranks: {note}.\n" if note else "\n")]
    for p in pngs:
        scenario = p.stem[len("bench_scaling_"):]
        keys = [k for k in ok if k[0] == scenario]
        w_at = _pick_world({k[2] for k in keys}, world)
        s_at = _pick_size({k[3] for k in keys}, size)
        parts += [f"### {scenario}\n",
                  f"![{p.stem}](img/{p.name})\n",
                  f"{SCENARIO_TITLES.get(scenario, scenario)}: time over size at {w_at} ranks; time, peak RSS"
                  + (" and bytes sent" if any(rows[k].get("sent0") is not None for k in keys) else "")
                  + f" over ranks at {s_at:g} GB.\n",
                  render_scaling(rows, scenario)]
    return parts


def _load(avg) -> str:
    return "-" if not avg else " / ".join(f"{x:.1f}" for x in avg)


def write_docs(results: dict, page: Path, *, notes: str = "", sources: list[str] | None = None,
               notes_file: str | None = None, plot_world: int = 4, plot_size: float = 1.0,
               scaling_results: dict | None = None, scaling_sources: list[str] | None = None) -> list[Path]:
    """Write the results page and its plots (into ``<page dir>/img``); with results at more than one
    model size or world size, also the scaling figures (``plot_world`` ranks for the plots over
    size, ``plot_size`` GB for those over ranks) and a Scaling section.

    ``scaling_results`` (a sweep of its own, e.g. ``--scaling-json``): the scaling figures and
    section come from it alone, and the rest of the page from ``results`` (so runs of different
    engines or conditions are not mixed in one median)."""
    metas = results.get("meta", {})
    metas = metas if isinstance(metas, list) else [metas]
    if scaling_results is not None:
        smetas = scaling_results.get("meta", {})
        metas = metas + (smetas if isinstance(smetas, list) else [smetas])
    pngs = plot(results, page.parent / "img")
    sweep = results if scaling_results is None else scaling_results
    scaling = plot_scaling(sweep, page.parent / "img", world=plot_world, size=plot_size)
    rows, limits = aggregate(results)
    srows = rows if scaling_results is None else aggregate(scaling_results)[0]
    problems = [f"- {k[0]} / {k[1]} at {k[2]} ranks, {k[3]:g} GB: **{r['status']}**: {r.get('error')}"
                for k, r in sorted(rows.items()) if r["status"] != "ok"]
    parts = [
        "# Benchmarks: fsdptk beside PyTorch DCP, torchtune and accelerate\n",
        "_This page is generated by `python -m benchmarks ... --write-docs`; every number below comes from the "
        "run(s) described here; only the Notes section is written by hand._\n",
        "## How it was produced\n",
        "```\nbash benchmarks/setup_peers.sh\n" + "\n".join(f".venv-peers/bin/{m.get('command')}" for m in metas)
        + "\n```\n",
        ("The raw results: " + ", ".join(f"`{f}`" for f in [*sources, *(scaling_sources or [])]) + ". To re-render this page from them: "
         "`.venv-peers/bin/python -m benchmarks --from-json " + " ".join(sources)
         + (" --scaling-json " + " ".join(scaling_sources) if scaling_sources else "") + " --write-docs"
         + (f" --notes {notes_file}" if notes_file else "") + "`\n") if sources else "",
    ]
    for m in metas:
        vers = "; ".join(f"`{py}`: " + ", ".join(f"{k} {v}" for k, v in sorted(d.items()) if v)
                         for py, d in m.get("versions", {}).items())
        parts += [
            f"- `{m.get('command')}`: {m.get('date')}; {m.get('cpus')} CPUs, {m.get('mem_total_GB', 0):.0f} GB RAM, "
            f"{m.get('platform')}; sizes {m.get('sizes')} GB of {m.get('dtype')} parameters, world sizes "
            f"{m.get('worlds')}, {m.get('repeats')} repeat(s), {m.get('seconds', 0) / 60:.1f} min; load average "
            f"(1/5/15 min) at the end {_load(m.get('loadavg_end'))}; versions: {vers}",
        ]
    parts.append("- every run: gloo over loopback on CPU, 1 torch thread per rank, fresh processes\n")
    if notes:
        parts += ["## Notes\n", notes.strip() + "\n"]
    parts += [
        "## What is measured\n",
        "- **time**: the operation between two barriers (max over ranks), median over repeats and min-max;",
        "- **peak RSS**: `resource.getrusage(RUSAGE_SELF).ru_maxrss` of each rank after the operation "
        "(OS high-water mark of the whole process, so it includes the ~0.3-0.4 GB of an imported torch and "
        "whatever the method's setup made the rank hold, e.g. the full state dict); **Δ** = peak after minus "
        "peak before the operation;",
        "- **sent**: bytes the rank passed to write/writev during the operation (`wchar` in `/proc/self/io`; gloo "
        "sends with writev), minus the bytes of files it wrote; i.e. bytes sent over the process group;",
        "- **limit s / % of limit**: the time the same bytes take at the bandwidths measured in the same run "
        "(table below) for the data placement the method assumes (rank 0 holds/reads the data: its (w-1)/w must "
        "leave rank 0 at the scatter bandwidth; every rank holds/reads it: each copies/reads its 1/w; gathers: "
        "(w-1)/w into rank 0 at the gather bandwidth; save: that or the file write, the larger); "
        "100% = as fast as the wire allows;",
        "- **check**: after the timed part, the loaded/gathered/saved tensors' global sum of squares equals "
        "the source's (float64), dtypes match, nothing left on meta.\n",
        "### Methods\n", render_methods(),
        "## Physical limits (GB/s, same run)\n", render_limits(limits),
        "## Results\n", render_main(rows, limits),
        "## Ratios (peer / fsdptk: > 1 means fsdptk is faster or leaner)\n", render_ratios(rows),
        "## Plots\n",
    ]
    parts += [f"![{p.stem}](img/{p.name})\n" for p in pngs]
    parts += _scaling_section(sweep, srows, scaling, plot_world, plot_size)
    if problems:
        parts += ["## Runs that did not complete, or that do not apply\n", "\n".join(problems) + "\n"]
    old = page.read_text() if page.is_file() else ""
    parts.append(hf_section(old))  # ``python -m benchmarks hf --write-docs``'s own block
    parts.append(gpu_section(old))  # a GPU run's own block
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(parts))
    return [page, *pngs, *scaling]


# ----------------------------------------------------------------------------------------------
# the GPU section of the results page (``--device cuda --write-docs``); the CPU page keeps it
# (its markers live in markers.py, which hf_report.py reads too)


def _gpu_intro() -> list[str]:
    return [
        "## GPU\n",
        "The same scenarios with each rank on its own GPU (`cuda:<rank>`) over NCCL: shards are loaded onto and "
        "gathered from the GPUs, the in-memory full states every method reads are in pinned host memory, and "
        "each rank reports `torch.cuda.max_memory_allocated` over the operation (above what it held before) beside "
        "the time and its host peak RSS. One command on a machine with GPUs (world sizes: 4 and 2, or what its "
        "GPUs allow; one GPU per rank):\n",
        "```\nbash benchmarks/setup_peers.sh\n.venv-peers/bin/python -m benchmarks --device cuda --write-docs\n```\n",
        "On a machine without CUDA the command exits 1 with the reason. The GPU-only tests run with "
        "`.venv/bin/python -m pytest -m gpu` (see the testing page).\n",
        "**Several nodes.** The suite launches its ranks on one machine. A multi-node job (the example, or "
        "your own loop) is launched by `torchrun` on every node; each rank takes the GPU `LOCAL_RANK` names "
        "(the example calls `torch.cuda.set_device(LOCAL_RANK)` and joins an NCCL group):\n",
        "```\n# on each of the 2 nodes (NODE_RANK 0 and 1), 8 GPUs per node, HEAD = node 0's address\n"
        "torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\\n"
        "    --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 --rdzv-id llama-run \\\n"
        "    examples/train_llama.py --device cuda --out-dir $SHARED_DIR/llama\n```\n",
        "`$SHARED_DIR` is a directory every node sees (a shared file system): rank 0 writes the checkpoints there "
        "and every rank resumes from them.\n",
    ]


def _gpu_waiting() -> str:
    return "\n".join([GPU_BEGIN, *_gpu_intro(),
                      "_Waiting for a lent GPU: no GPU run has been made yet, so this table is empty._\n",
                      "| device | torch | CUDA | NCCL | ranks | scenario | method | time s | CUDA peak r0 MB | "
                      "CUDA peak r>0 MB | check |",
                      "|---|---|---|---|---|---|---|---|---|---|---|\n", GPU_END]) + "\n"


def gpu_section(page_text: str) -> str:
    """The GPU block of a results page, or the "waiting" block when the page has none."""
    start, end = page_text.find(GPU_BEGIN), page_text.find(GPU_END)
    if start < 0 or end < start:
        return _gpu_waiting()
    return page_text[start:end + len(GPU_END)] + "\n"


def render_gpu_section(results: dict) -> str:
    metas = results.get("meta", {})
    metas = metas if isinstance(metas, list) else [metas]
    env = [f"- `{m.get('command')}`: {m.get('date')}; {m.get('gpus')} x {m.get('gpu')} "
           f"({m.get('gpu_mem_GB', 0):.0f} GB), torch {next(iter(m.get('versions', {}).values()), {}).get('torch')}, "
           f"CUDA {m.get('cuda')}, NCCL {m.get('nccl')}; world sizes {m.get('worlds')}, sizes {m.get('sizes')} GB "
           f"of {m.get('dtype')}, {m.get('repeats')} repeat(s)" for m in metas]
    rows, limits = aggregate(results)
    return "\n".join([GPU_BEGIN, *_gpu_intro(), *env, "", render_main(rows, limits),
                      "Ratios (peer / fsdptk; > 1 means fsdptk is faster or leaner):\n", render_ratios(rows),
                      GPU_END]) + "\n"


def write_gpu_section(results: dict, page: Path) -> list[Path]:
    """Replace (or append) the GPU block of the results page with this run's tables."""
    text = page.read_text() if page.is_file() else ""
    block = render_gpu_section(results)
    start, end = text.find(GPU_BEGIN), text.find(GPU_END)
    if start >= 0 and end > start:
        text = text[:start] + block + text[end + len(GPU_END):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    return [page]
