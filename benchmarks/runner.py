"""Launch one benchmark run: ``world`` fresh processes, wait, collect each rank's result.

Every run is a new set of interpreters (``python -m benchmarks.worker``), so peak RSS is the
operation's and never an earlier run's. Ranks find each other through MASTER_ADDR/MASTER_PORT on
loopback (gloo on CPU; NCCL with rank r on GPU r for ``--device cuda``). A run whose rank fails is killed after a short grace period (its peers may be
blocked in a collective); a run past its time limit is killed and reported as a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RunOutcome", "launch_workers", "launch_ttfs", "free_port", "REPO"]

REPO = Path(__file__).resolve().parent.parent
_GRACE_S = 10.0


@dataclass
class RunOutcome:
    status: str  # "ok" | "error" | "timeout"
    ranks: list[dict] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    log: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(world: int, rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p]),
        PYTHONUNBUFFERED="1",
    )
    return env


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # each worker leads its own session
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _wait(procs: list[subprocess.Popen], timeout: float, stop=None) -> tuple[str, float]:
    start = time.perf_counter()
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        now = time.perf_counter()
        if stop is not None and stop():
            _kill(procs)
            return "ok", now - start
        if all(c is not None for c in codes):
            return ("ok" if all(c == 0 for c in codes) else "error"), now - start
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > _GRACE_S:
            _kill(procs)
            return "error", now - start
        if now - start > timeout:
            _kill(procs)
            return "timeout", now - start
        time.sleep(0.05)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def launch_workers(spec: dict, world: int, python: str, out_dir: Path, timeout: float, *,
                   module: str = "benchmarks.worker") -> RunOutcome:
    """Run ``module`` (default ``benchmarks.worker``) on ``world`` ranks with ``spec``; results
    from ``out_dir`` (``rank<r>.json`` of each rank)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, out_dir=str(out_dir))
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([python, "-m", module, str(spec_path)], cwd=REPO,
                                      env=_env(world, rank, port), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    try:
        status, wall = _wait(procs, timeout)
    finally:
        _kill(procs)
        for log in logs:
            log.close()
    ranks, errors = [], []
    for rank in range(world):
        f = out_dir / f"rank{rank}.json"
        if f.is_file():
            r = json.loads(f.read_text())
            ranks.append(r)
            if r.get("error"):
                errors.append(f"rank {rank}: {r['error']}")
        else:
            ranks.append({"rank": rank, "missing": True})
    if status == "ok" and errors:
        status = "error"
    if status == "error" and not errors and all(not r.get("missing") for r in ranks):
        status = "ok"  # every rank wrote its result; a crash after that (at exit) does not matter
    error = "; ".join(errors[:2]) or None
    if status == "timeout":
        error = f"killed after {timeout:.0f} s" + (f" ({error})" if error else "")
    elif status == "error" and not error:
        error = "a rank exited without a result: " + _tail(out_dir / "rank0.log", 600).strip().splitlines()[-1:][0] \
            if _tail(out_dir / "rank0.log") else "a rank exited without a result"
    return RunOutcome(status, ranks, error, wall, _tail(out_dir / "rank0.log"))


_STEP1 = re.compile(r"step\s+1/\d+")
_PEAKS = re.compile(r"peak RSS MiB per rank \[([^\]]*)\]")


def launch_ttfs(world: int, python: str, out_dir: Path, ckpt_dir: Path, timeout: float,
                device: str = "cpu") -> RunOutcome:
    """Time ``examples/train_llama.py`` from launch to its "step 1" log line (rank 0's stdout).

    One optimizer step on a batch of 1 x 32 tokens, so the time is dominated by start-up:
    interpreter and imports, process group, meta model, shard_model, loading the checkpoint,
    the first forward/backward/step. Peak RSS per rank is the one the example logs at step 1.
    The processes are killed once the line is seen (the checkpoint the example then saves is
    not part of this scenario).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["examples/train_llama.py", "--init-from", str(ckpt_dir), "--out-dir", str(out_dir / "run"),
            "--no-resume", "--steps", "1", "--log-every", "1", "--save-every", "1", "--batch-size", "1",
            "--seq-len", "32", "--no-progress", "--device", device]
    port = free_port()
    seen: dict[str, object] = {}
    start = time.perf_counter()
    procs, logs = [], []
    for rank in range(world):
        if rank == 0:
            p = subprocess.Popen([python, *args], cwd=REPO, env=_env(world, rank, port), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        else:
            logs.append(open(out_dir / f"rank{rank}.log", "w"))
            p = subprocess.Popen([python, *args], cwd=REPO, env=_env(world, rank, port), stdout=logs[-1],
                                 stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
    lines: list[str] = []

    def reader() -> None:
        for line in procs[0].stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "t" not in seen and _STEP1.search(line):
                seen["t"] = time.perf_counter() - start
                m = _PEAKS.search(line)
                if m:
                    seen["peaks"] = [float(x) for x in m.group(1).split(",") if x.strip()]

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        status, wall = _wait(procs, timeout, stop=lambda: "t" in seen)  # what follows step 1 is not timed
    finally:
        _kill(procs)
        for log in logs:
            log.close()
    th.join(timeout=5)
    (out_dir / "rank0.log").write_text("".join(lines))
    tail = "".join(lines)[-3000:]
    if "t" not in seen:
        err = [ln.strip() for ln in lines if ln.strip()][-1:] or ["no output"]
        return RunOutcome("error" if status != "timeout" else "timeout", [], f"no 'step 1' line: {err[0][:500]}",
                          wall, tail)
    peaks = seen.get("peaks") or []
    ranks = [{"rank": r, "time_s": seen["t"], "peak_rss": int(p * 2**20), "baseline_peak_rss": None,
              "sent_bytes": None, "check": "ok" if status == "ok" else f"after step 1: {status}"}
             for r, p in enumerate(peaks)] or [{"rank": 0, "time_s": seen["t"], "check": "no peak RSS in log"}]
    return RunOutcome("ok", ranks, None, wall, tail)
