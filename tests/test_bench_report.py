"""The benchmark suite's report helpers (benchmarks/report.py): the bytes each rank must send for
the data placement a method assumes (``ideal_bytes``), and the scaling table beside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.report import aggregate, ideal_bytes, ideal_time, render_scaling  # noqa: E402

M = 1_000_000  # model bytes
ROW = {"model_bytes": M, "file_bytes": M}


def _sent(scenario: str, method: str, world: int) -> tuple[float, float]:
    ideal = ideal_bytes(scenario, method, world, ROW)
    assert ideal is not None
    return ideal["sent0"], ideal["sentN"]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ideal_bytes_per_placement(world):
    w = world
    # rank 0 holds or reads the data: (w-1)/w of it leaves rank 0, the others send nothing
    for scenario, method in [("load_mem", "fsdptk"), ("load_mem", "dcp"), ("load_mem", "accelerate"),
                             ("load_st", "fsdptk_rank0_read"), ("load_st", "dcp"), ("load_st", "accelerate")]:
        assert _sent(scenario, method, w) == pytest.approx((M * (w - 1) / w, 0)), (scenario, method)
    # every rank holds the data, or reads its own slices: nothing to send
    for scenario, method in [("load_mem", "fsdptk_all"), ("load_mem", "torchtune"),
                             ("load_st", "fsdptk_shard_on_read"), ("load_st", "torchtune"),
                             ("optim_load", "torchtune")]:
        assert _sent(scenario, method, w) == (0, 0), (scenario, method)
    # gathers and saves through rank 0: each other rank sends its 1/w, rank 0 nothing
    for scenario in ("gather", "save"):
        for method in ("fsdptk", "dcp", "torchtune"):
            assert _sent(scenario, method, w) == pytest.approx((0, M / w)), (scenario, method)
    # AdamW: exp_avg and exp_avg_sq, twice the model
    for method in ("fsdptk", "dcp", "torchtune"):
        assert _sent("optim_gather", method, w) == pytest.approx((0, 2 * M / w)), method
    for method in ("fsdptk", "dcp"):
        assert _sent("optim_load", method, w) == pytest.approx((2 * M * (w - 1) / w, 0)), method
    assert ideal_bytes("ttfs", "fsdptk", w, ROW) is None


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ideal_bytes_agree_with_ideal_time(world):
    """The bytes ideal_time moves over the wire at 1 GB/s are the bytes ideal_bytes says are sent."""
    lim = {"scatter": 1.0, "gather": 1.0, "memcpy": 1e9, "file_read": 1e9, "file_read_all": 1e9, "file_write": 1e9}
    for scenario, method in [("load_mem", "fsdptk"), ("load_st", "dcp"), ("optim_load", "fsdptk")]:
        sent0, _ = _sent(scenario, method, world)
        assert ideal_time(scenario, method, world, ROW, lim) == pytest.approx(sent0 / 1e9)
    for scenario in ("gather", "save", "optim_gather"):
        _, sent_n = _sent(scenario, "fsdptk", world)
        assert ideal_time(scenario, "fsdptk", world, ROW, lim) == pytest.approx((world - 1) * sent_n / 1e9)


@pytest.mark.parametrize("name", ["main.json", "scaling.json"])
def test_committed_results_match_the_ideal_for_fsdptk(name):
    """fsdptk's measured bytes in the committed runs sit at the ideal (gloo's headers aside)."""
    path = REPO / "benchmarks" / "results" / name
    if not path.is_file():
        pytest.skip(f"{path} is not there")
    rows, _ = aggregate(json.loads(path.read_text()))
    seen = 0
    for (scenario, method, world, _size), row in rows.items():
        ideal = ideal_bytes(scenario, method, world, row)
        if not method.startswith("fsdptk") or row["status"] != "ok" or ideal is None:
            continue
        for field in ("sent0", "sentN"):
            assert row[field] == pytest.approx(ideal[field], rel=0.01, abs=2e6), (scenario, method, world, field)
        seen += 1
    assert seen >= 10


def _row(time, peak0, sent0, sent_n, status="ok"):
    return {"status": status, "model_bytes": 1e9, "file_bytes": 1e9, "time": time, "peak0": peak0,
            "sent0": sent0, "sentN": sent_n}


def test_render_scaling_table():
    rows = {("gather", "fsdptk", 2, 1.0): _row(0.4, 1.9e9, 0, 501e6),
            ("gather", "fsdptk", 4, 1.0): _row(0.5, 1.6e9, 0, 260e6),
            ("gather", "dcp", 2, 1.0): _row(1.2, 2.0e9, 500e6, 500e6),
            ("gather", "dcp", 4, 1.0): _row(None, None, None, None, status="skipped")}
    lines = render_scaling(rows, "gather").splitlines()
    assert lines[0] == ("| model GB | ranks | fsdptk s / peak r0 GB | dcp s / peak r0 GB | "
                        "fsdptk sent r0 / r>0 MB (ideal) |")
    assert lines[2] == "| 1 | 2 | 0.40 / 1.90 | 1.20 / 2.00 | 0 / 501 (0 / 500) |"
    assert lines[3] == "| 1 | 4 | 0.50 / 1.60 | skipped | 0 / 260 (0 / 250) |"


# ---------------------------------------------------------------------------------------------
# python -m benchmarks hf: both methods' clocks start from the same state
@pytest.mark.parametrize("clock", ["warm", "user"])
def test_hf_worker_preclock_imports_are_the_same_for_both_methods(tmp_path, clock):
    """The warm load clock of ``python -m benchmarks hf`` starts with the same modules imported for
    transformers' path and fsdptk's (the union of what either imports), after the same
    ``gc.collect()``; the user clock (issue 44) with the same modules too (what a script imports
    for either call): the real worker runs each method on a tiny Qwen3-MoE checkpoint (1 rank) and
    records ``sys.modules`` when the load clock starts."""
    pytest.importorskip("transformers")
    import transformers

    from benchmarks.runner import launch_workers

    ckpt = tmp_path / "ckpt"
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, num_experts=4,
        num_experts_per_tok=2)).save_pretrained(ckpt)
    seen = {}
    for method in ("transformers", "fsdptk"):
        spec = {"method": method, "dp_shard": 1, "tp": 1, "ckpt_dir": str(ckpt), "batch": [1, 4],
                "optimizer": "sgd", "skip_step": True, "save_dir": str(tmp_path / method / "saved"),
                "imports": "union" if clock == "warm" else "user", "clock": clock, "arch": "qwen3_moe",
                "record_modules": True}
        res = launch_workers(spec, 1, sys.executable, tmp_path / method, 300, module="benchmarks.hf_worker")
        assert res.status == "ok", res.error
        rank = res.ranks[0]
        seen[method] = set(rank["preclock_module_names"])
        if clock == "warm":
            assert rank["load"]["read"] > 0  # the file reads were counted
        else:  # a user's loop: the model's modeling code is imported inside the clock, by either call
            assert "transformers.models.qwen3_moe.modeling_qwen3_moe" not in seen[method]
            assert "read" not in rank["load"]
    only = {m: sorted(seen[m] - seen[o])[:10] for m, o in (("transformers", "fsdptk"), ("fsdptk", "transformers"))}
    assert seen["transformers"] == seen["fsdptk"], f"modules imported before one method's clock only: {only}"


class _Timed:
    """Targets for the phase timers: a classmethod inherited by a subclass, a plain method."""

    @classmethod
    def build(cls, n: int) -> int:
        return sum(range(n))

    def step(self, n: int) -> int:
        return n + 1


class _TimedChild(_Timed):
    pass


def test_profile_phases_time_each_step_and_restore_it():
    """``profile_hf_load --phases`` wraps each step named in its table: every step of both methods
    exists in the installed fsdptk and transformers (a rename would otherwise time nothing), the
    wrappers add up calls (an inherited classmethod is wrapped where it is defined), return what the
    step returns, and the originals come back afterwards."""
    pytest.importorskip("transformers")
    import importlib

    from benchmarks.profile_hf_load import PHASES, _install_timers

    for method, steps in PHASES.items():
        originals = []
        for module_name, owner, name, _ in steps:
            where = importlib.import_module(module_name)
            target = getattr(where, owner) if owner else where
            originals.append(getattr(target, name))
        totals: dict[str, list[float]] = {}
        restore = _install_timers(steps, totals)
        try:
            for (module_name, owner, name, _), before in zip(steps, originals):
                where = importlib.import_module(module_name)
                now = getattr(getattr(where, owner) if owner else where, name)
                assert now != before, f"{method}: {module_name}.{owner}.{name} was not wrapped"
        finally:
            restore()
        for (module_name, owner, name, _), before in zip(steps, originals):
            where = importlib.import_module(module_name)
            assert getattr(getattr(where, owner) if owner else where, name) == before

    totals = {}
    steps = [(__name__, "_TimedChild", "build", "build"), (__name__, "_Timed", "step", "step")]
    restore = _install_timers(steps, totals)
    try:
        assert _TimedChild.build(200_000) == sum(range(200_000))
        assert _TimedChild.build(10) == 45
        assert _Timed().step(1) == 2
    finally:
        restore()
    assert set(totals) == {"build", "step"}
    wall, cpu = totals["build"]
    assert wall > 0 and cpu > 0
    assert _TimedChild.build(3) == 3 and "build" not in _TimedChild.__dict__
    assert totals["build"] == [wall, cpu]  # restored: calls no longer counted


# ---------------------------------------------------------------------------------------------
# python -m benchmarks quant-save: every method's clock starts from the same state
def test_quant_save_methods_start_alike_and_fp8_writes_fewer_bytes(tmp_path):
    """The real ``quant-save`` worker on a tiny Llama (1 rank): the unquantized save, the FP8 save
    and ``save_file`` of the FP8 files' tensors start their clocks with the same modules imported
    (every method's warm-up runs first in every process); the FP8 files hold e4m3 weights and are
    smaller, the limit re-writes the same bytes, and the table renders."""
    from benchmarks.quant_save import METHODS, render
    from benchmarks.runner import launch_workers

    work = tmp_path / "work"
    outputs = {m: str(work / m) for m in METHODS}
    runs, seen = {}, {}
    for method in ("unquantized", "fp8", "save_file_fp8"):
        spec = {"model": "llama", "size": 0.002, "dtype": "float32", "method": method, "writers": 1,
                "work_dir": str(work), "outputs": outputs, "record_modules": True}
        res = launch_workers(spec, 1, sys.executable, tmp_path / "runs" / method, 300, module="benchmarks.quant_save")
        assert res.status == "ok", res.error
        seen[method] = set(res.ranks[0].pop("preclock_modules"))
        runs[method] = [{"status": res.status, "error": res.error, "ranks": res.ranks}]
    assert seen["unquantized"] == seen["fp8"] == seen["save_file_fp8"]
    rank0 = {m: r[0]["ranks"][0] for m, r in runs.items()}
    assert "F8_E4M3" in rank0["fp8"]["dtypes"] and "F8_E4M3" not in rank0["unquantized"]["dtypes"]
    assert rank0["fp8"]["file_bytes"] < 0.75 * rank0["unquantized"]["file_bytes"]  # fp32 embeddings and head kept
    assert rank0["save_file_fp8"]["dtypes"] == rank0["fp8"]["dtypes"]
    assert abs(rank0["save_file_fp8"]["file_bytes"] - rank0["fp8"]["file_bytes"]) < 64 * 1024  # headers differ
    table = render({"model": "llama", "dtype": "float32", "repeats": 1,
                    "cells": [{"world": 1, "writers": 1, "runs": runs}]})
    assert "| fsdptk fp8 |" in table and "| save_file (fp8 bytes) |" in table


# ---------------------------------------------------------------------------------------------
# python -m benchmarks hf-probe (issue 44): the harness as a mode of its own
def test_hf_probe_spread_and_ratios_pair_runs_by_repeat():
    """Median and range of single runs (judged by :mod:`statistics`), per-run ratios paired by
    repeat (a repeat one method lacks is left out, never paired with another repeat), and the
    per-cell summary of both, failed runs listed and left out of the figures."""
    import random
    import statistics as st

    from benchmarks.hf_probe import CellStats, pair_ratios, render, spread, summarize

    rng = random.Random(0)
    for n in (1, 2, 3, 4, 7):
        xs = [rng.uniform(0.1, 5) for _ in range(n)]
        assert spread(xs + [None]) == CellStats(st.median(xs), min(xs), max(xs), n)
    assert spread([None, None]) is None
    assert CellStats(0.82, 0.62, 1.1, 3).text("{:.2f}", "x") == "0.82x (0.62-1.10x)"
    assert pair_ratios({0: 1.0, 1: 3.0, 2: 2.0}, {0: 2.0, 2: 4.0, 3: 1.0}) == [0.5, 0.5]
    assert pair_ratios({0: 1.0, 1: None}, {0: 0.0, 1: 2.0}) == []  # no ratio over a zero or a missing value

    times = {("transformers", 0): 2.0, ("fsdptk", 0): 1.0, ("transformers", 1): 1.0, ("fsdptk", 1): 1.1,
             ("transformers", 2): 4.0, ("fsdptk", 2): 2.4}
    records = [{"mesh": "fsdp", "world": 2, "repeat": r, "method": m, "status": "ok",
                "ranks": [{"load_s": t, "peak_anon": 100 + r, "anon_after": 90},
                          {"load_s": t / 2, "peak_anon": 50, "anon_after": 50}]}
               for (m, r), t in times.items()]
    records.append({"mesh": "fsdp", "world": 2, "repeat": 3, "method": "fsdptk", "status": "timeout",
                    "error": "killed", "ranks": []})
    cell = summarize(records)[("fsdp", 2)]
    per_run = [times[("fsdptk", r)] / times[("transformers", r)] for r in range(3)]
    assert cell["ratio"]["load_s"] == CellStats(st.median(per_run), min(per_run), max(per_run), 3)
    assert cell["ratio_of_medians"]["load_s"] == st.median([1.0, 1.1, 2.4]) / st.median([2.0, 1.0, 4.0])
    assert cell["stats"]["transformers"]["peak_anon"] == CellStats(101, 100, 102, 3)  # the largest rank's
    assert cell["ratio"]["save_s"] is None and cell["failed"] == ["fsdptk r3: timeout: killed"]
    table = render({"records": records, "meta": {}})
    assert "| fsdp | 2 | **ratio** | 0.60x (0.50-1.10x) [0.55x] |" in table


def test_hf_probe_arguments_and_model_shape():
    """The probe's defaults are the issue's harness (glibc's default malloc, no collection before
    the clock, the barrier inside it, the issue's imports); its model's fp32 bytes are what
    transformers builds for that config (on meta), 2.29 GB for the issue's hidden 2048 x 10
    layers; ``--size`` takes ``python -m benchmarks hf``'s shape; each rank's environment carries
    exactly the allocator setting asked for."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    from benchmarks.hf_peer import llama_config
    from benchmarks.hf_probe import _child_env, param_bytes, parse_args, shape_of

    args = parse_args([])
    assert (args.malloc, args.gc, args.clock, args.imports, args.order, args.threads, args.worlds, args.meshes) == (
        "default", "none", "barrier", "issue", "alternate", "1", [2], ["fsdp"])
    args = parse_args(["--worlds", "2", "4", "--meshes", "fsdp", "fsdp-tp2", "--repeats", "5", "--malloc",
                       "mmap65536", "--gc", "collect", "--clock", "rank", "--save", "--layers", "3"])
    assert (args.worlds, args.meshes, args.repeats, args.malloc, args.gc, args.clock, args.save) == (
        [2, 4], ["fsdp", "fsdp-tp2"], 5, "mmap65536", "collect", "rank", True)
    with pytest.raises(SystemExit):
        parse_args(["--malloc", "jemalloc"])
    with pytest.raises(SystemExit):
        parse_args(["--size", "2", "--hidden", "512"])
    for argv in ([], ["--layers", "3", "--hidden", "512", "--heads", "8", "--kv-heads", "2", "--vocab", "1000"]):
        shape = shape_of(parse_args(argv))
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
        assert param_bytes(shape) == 4 * sum(p.numel() for p in model.parameters())
    assert round(param_bytes(shape_of(parse_args([]))) / 1e9, 2) == 2.29
    assert shape_of(parse_args(["--size", "2"])) == llama_config(2.0)

    inherited = {"MALLOC_MMAP_THRESHOLD_": "1", "MALLOC_ARENA_MAX": "2"}
    old = {k: __import__("os").environ.get(k) for k in inherited}
    __import__("os").environ.update(inherited)
    try:
        plain = _child_env(parse_args([]), 2, 1, 1234)
        mapped = _child_env(parse_args(["--malloc", "mmap65536"]), 2, 1, 1234)
    finally:
        for k, v in old.items():
            __import__("os").environ.pop(k) if v is None else __import__("os").environ.__setitem__(k, v)
    assert not any(k.startswith("MALLOC_") for k in plain)
    assert {k: v for k, v in mapped.items() if k.startswith("MALLOC_")} == {"MALLOC_MMAP_THRESHOLD_": "65536"}
    assert (plain["RANK"], plain["WORLD_SIZE"], plain["OMP_NUM_THREADS"]) == ("1", "2", "1")


def _hf_rec(method: str, repeat: int, load: float, save: float, clock: str = "warm") -> dict:
    phase = {"s": 0.0, "peak": 1, "anon": 1, "file": 1, "rss": 1, "rss0": 1, "sent": 0}
    ranks = [{"rank": r, "import_s": 1.0, "init_s": 0.1, "load": dict(phase, s=load * (1 - 0.1 * r)),
              "forward": dict(phase, s=1.0), "save": dict(phase, s=save)} for r in range(2)]
    return {"method": method, "mesh": "fsdp", "world": 2, "size_gb": 2.0, "model_bytes": 2 * 10**9,
            "repeat": repeat, "clock": clock, "status": "ok", "ranks": ranks}


def test_hf_report_shows_single_runs_beside_the_medians():
    """``python -m benchmarks hf``'s tables give each time's single-run min-max beside its median,
    and each ratio's per-run range with the two methods' runs of a repeat paired; a ``user`` clock
    gets tables of its own, its runs never mixed into the warm ones."""
    import statistics as st

    from benchmarks.hf_report import aggregate, render, run_ratios

    loads = {"transformers": [1.0, 2.0, 1.5], "fsdptk": [0.6, 1.0, 1.6]}
    records = [_hf_rec(m, r, t, 2 * t) for m, ts in loads.items() for r, t in enumerate(ts)]
    records += [_hf_rec(m, 0, 10 * t, 1.0, clock="user") for m, t in (("transformers", 1.0), ("fsdptk", 0.9))]
    rows = aggregate({"records": records})
    ours = rows[("fsdp", 2, 2.0, "fsdptk")]
    assert (ours["load_s"], ours["range"]["load_s"], ours["runs"]) == (1.0, (0.6, 1.6), 3)
    per_run = [a / b for a, b in zip(loads["fsdptk"], loads["transformers"])]
    assert run_ratios({"records": records})[("fsdp", 2, 2.0)]["load_s"] == per_run
    assert run_ratios({"records": records}, "user")[("fsdp", 2, 2.0)]["load_s"] == [0.9]
    table = render({"records": records})
    assert "| fsdp | 2 | 2.00 | fsdptk | 1.00 (0.60-1.60) |" in table
    ratio = st.median(loads["fsdptk"]) / st.median(loads["transformers"])
    assert f"| fsdp | 2 | 2.00 | {ratio:.2f} ({min(per_run):.2f}-{max(per_run):.2f}) |" in table
    user = table[table.index("As a user's loop sees it"):]
    assert "| fsdp | 2 | 2.00 | fsdptk | 9.00 |" in user and "| fsdp | 2 | 2.00 | **0.90** |" in user  # 0.7 missed


def test_hf_probe_import_self_seconds_add_up_to_the_interpreters_cumulative_time():
    """``--importtime``'s sum of self times over the modules an import brought in equals the
    cumulative time the interpreter itself reports for that import (``python -X importtime``)."""
    import subprocess

    from benchmarks.hf_probe import import_self_seconds

    log = subprocess.run([sys.executable, "-X", "importtime", "-c", "import json"], capture_output=True,
                         text=True, check=True).stderr
    rows = [line[len("import time:"):].split("|") for line in log.splitlines()
            if line.startswith("import time:") and "self [us]" not in line]
    end = max(i for i, r in enumerate(rows) if r[2].strip() == "json")
    start = end
    while start > 0 and rows[start - 1][2].startswith("  "):  # the modules json brought in
        start -= 1
    subtree = {r[2].strip() for r in rows[start:end + 1]}
    assert len(subtree) > 3
    # the interpreter rounds each line to a microsecond: at most 1 us per module apart
    assert import_self_seconds(log, subtree) == pytest.approx(int(rows[end][1]) / 1e6, abs=1e-6 * len(subtree))
    assert import_self_seconds(log, set()) == 0.0
