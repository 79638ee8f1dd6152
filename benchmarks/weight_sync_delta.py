"""``python -m benchmarks weight-sync --delta``: only what changed after an optimizer step
(``weight_source(..., track_changes=True).iter_patches()``, issue 50), beside a full pass, the
wire and the comparison's own memory traffic.

The model is ``weight-sync``'s (:func:`benchmarks.weight_sync.build_model`: a transformers
``--model llama`` or ``qwen3-moe`` of about ``--size`` GB of fp32 parameters, FSDP2 over every rank,
one unit per decoder layer, shards uniform in [0, 1); ``--init-std S``: normal with std ``S``
instead). Its fp32 parameters are the master weights. Two sources are made on it, both with
``dtype=torch.bfloat16`` and one owner (rank 0): ``tracked = weight_source(model, dtype=bf16,
track_changes=True)`` and ``full = weight_source(model, dtype=bf16)`` (no baseline: what a trainer
without patches streams). ``tracked`` is seeded with one ``iter_full`` pass.

Steps. For each learning rate of ``--lrs``, from the same initial weights, a fresh
``torch.optim.AdamW(model.parameters(), lr)`` (other arguments torch's defaults) takes ``--steps``
steps on random gradients: each parameter's ``.grad`` is set to a DTensor of the parameter's
placements whose local shard is ``torch.randn`` from a generator seeded by (``--seed``, step,
rank), so no forward or backward is run and every learning rate sees the same gradients. A step
of about ``lr`` changes the bf16 bits of an element with probability about ``lr`` / (bf16's
spacing at that value): uniform [0, 1) weights have a spacing of 2^-9..2^-8 over three quarters
of their elements, so the changed fraction at a given ``lr`` is lower than that of a trained model's
weights (std about 0.02, spacing about 2^-13): ``--init-std 0.02`` for those.

What is timed after each step, on the same post-step weights, every method from the same state
(the pre-step weights ``pre`` and post-step weights ``post``: clones of every rank's local
shards, taken around the step):

- ``patch``: ``tracked.iter_patches()``, driven to its end on every rank, rank 0 dropping each
  patch. A patch pass moves the baseline to the weights it compared, so before each repetition
  the baseline is put back to the pre-step weights: the shards are overwritten
  with ``pre``, ``tracked.iter_full()`` runs to its end (untimed: its compare makes the baseline
  ``pre``'s bf16 bits and its completion clears anything uncertain), the shards are overwritten
  with ``post``, then the clock runs around ``iter_patches`` alone. Every repetition therefore
  compares the same two states and sends the same patches (the element count is checked equal
  across repetitions). That untimed re-seeding pass is timed on its own as ``tracked full``: a
  full pass that also compares and updates the baseline.
- ``full``: ``full.iter_full()`` on ``post`` (the untracked source), rank 0 dropping each tensor.
- ``raw``: exactly the bytes of the patches' indices and values (4 + 2 bytes per changed element)
  that each non-owner rank holds, sent to rank 0 in one message per rank (no message from a rank
  with no change), into buffers allocated once per step (rank 0 posts every receive, then waits):
  the wire alone, no comparison, no packing, no names.
- ``compare``: each rank casts each of its local shards to bf16 and compares it bit for bit with a
  bf16 copy of ``pre`` kept once per step (``(a.view(torch.int16) != b.view(torch.int16))``, then
  ``count_nonzero``), no communication: the memory traffic every holder's comparison costs.

Each method runs between two barriers and is timed on the slowest rank (``weight-sync``'s
``_measure``: also peak RSS above the RSS before, ``VmHWM`` reset through ``/proc/self/clear_refs``,
and the bytes each rank received over TCP); the table gives the minimum over ``--repeats``,
interleaved (patch, full, raw, compare, patch, ...), after one untimed round of each on the first
step. Per world and step: the changed fraction (patch elements yielded on rank 0 / the Hub
tensors' elements), the patch bytes, the four times and the ratios ``patch / (compare + raw)``
(issue 50's target: at most 1.2) and ``patch / full`` (at most 0.2 wherever under 5 % of the
elements changed), and a check: the compare's changed elements summed over the ranks equal the
patch elements, and (``--check``, on by default, untimed) rank 0 applies one pass's patches to the
tensors of the ``pre`` full pass and gets the ``post`` full pass bit for bit.

Memory per rank (per world): the baseline the tracker keeps (``tracked._tracker``'s ``base`` and
``full`` tensors), the peak RSS above before during a patch pass and during a full pass (max over
the repetitions), and one bucket (``bucket_bytes``) for comparison.

``--profile PREFIX``: after each step's timed repetitions, one more (untimed) patch pass, seeded as
above, runs under ``cProfile`` on rank 0 (``PREFIX.w<ranks>.lr<lr>.s<step>.prof``).

``--hosts H --per-host K --rate 1gbit``: the same on ``H`` simulated hosts of ``K`` ranks
(:class:`fsdptk.testing.hosts.Hosts`: network namespaces on a bridge, each link shaped to
``--rate`` both ways; needs root), launched with ``torchrun`` (this module's ``__main__``), instead
of ``--worlds`` on loopback.

Examples::

    python -m benchmarks weight-sync --delta --size 0.01 --worlds 2 --repeats 1   # smoke
    python -m benchmarks weight-sync --delta --model llama --size 1 --worlds 2 4 --json ws_delta.json
    python -m benchmarks weight-sync --delta --size 0.5 --hosts 2 --per-host 2 --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from .weight_sync import _MMAP_THRESHOLD, _measure, build_model, model_config, spawn

__all__ = ["main", "render", "run_local", "run_hosts"]

REPO = Path(__file__).resolve().parent.parent
METHODS = ["patch", "full", "raw", "compare", "tracked_full"]
_WIRE = torch.bfloat16
PATCH_TARGET = 1.2  # issue 50: patch pass within 1.2x (compare + raw)
FULL_TARGET = 0.2  # ... and at most 0.2x the full pass where under 5 % of the elements changed
SPARSE = 0.05


# ----------------------------------------------------------------------------------------------
# one rank
def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def _set_grads(params: list[torch.nn.Parameter], seed: int, step: int, rank: int) -> None:
    """Random gradients of each parameter's placements (a fixed seed per step and rank)."""
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    for p in params:
        g = torch.randn(_local(p).shape, generator=gen, dtype=p.dtype)
        if isinstance(p, DTensor):
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                        run_check=False)
        else:
            p.grad = g


def _load(shards: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, s in zip(shards, saved):
            t.copy_(s)


def _drain(pairs: Any) -> int:
    n = 0
    for _name, t in pairs:  # the owner drops each tensor on arrival
        n += t.numel() * t.element_size()
    return n


def _seconds(m: dict[str, float]) -> float:
    return float(m["seconds"])


class _Step:
    """The methods of one step, on this rank (buffers and kept copies made here, once)."""

    def __init__(self, ctx: dict[str, Any], pre: list[torch.Tensor], post: list[torch.Tensor]) -> None:
        self.ctx, self.pre, self.post = ctx, pre, post
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.kept = [t.to(_WIRE) for t in pre]  # the compare's baseline: pre's bf16 copy, kept once
        self.changed = self.compare()  # this rank's changed elements (the cross-check, untimed)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([self.changed], dtype=torch.int64))
        self.counts = [int(c) for c in counts]
        per = [6 * c for c in self.counts]  # int32 index + bf16 value per changed element
        self.raw_bytes = sum(per[1:])
        if self.rank == 0:
            self.bufs = [(r, torch.empty(per[r], dtype=torch.uint8)) for r in range(1, self.world) if per[r]]
        else:
            self.bufs = [(0, torch.ones(per[self.rank], dtype=torch.uint8))] if per[self.rank] else []
        self.patch_elements: list[int] = []

    def compare(self) -> int:
        n = 0
        for t, b in zip(self.ctx["shards"], self.kept):
            n += int(torch.count_nonzero(t.to(_WIRE).view(torch.int16) != b.view(torch.int16)))
        return n

    def raw(self) -> int:
        if self.rank == 0:
            for w in [dist.irecv(b, src=r) for r, b in self.bufs]:
                assert w is not None
                w.wait()
            return self.raw_bytes
        for _, b in self.bufs:
            dist.send(b, dst=0)
        return 0

    def seed(self) -> None:
        """The baseline back to ``pre`` (untimed here): ``pre`` in, a tracked full pass, ``post`` in."""
        _load(self.ctx["shards"], self.pre)
        self.ctx["seed_runs"].append(_measure(lambda: _drain(self.ctx["tracked"].iter_full())))
        _load(self.ctx["shards"], self.post)

    def patch(self) -> int:
        n = nbytes = 0
        for p in self.ctx["tracked"].iter_patches():  # rank 0 drops each patch
            n += p.indices.numel()
            nbytes += p.indices.numel() * p.indices.element_size() + p.values.numel() * p.values.element_size()
        self.patch_elements.append(n)
        return nbytes

    def full(self) -> int:
        return _drain(self.ctx["full"].iter_full())

    def check(self) -> dict[str, Any]:
        """Untimed: one pass's patches applied on rank 0 to the ``pre`` full pass give the ``post``
        full pass bit for bit."""
        tracked, full = self.ctx["tracked"], self.ctx["full"]
        _load(self.ctx["shards"], self.pre)
        before = {name: t for name, t in tracked.iter_full()}  # rank 0: every Hub tensor, pre
        _load(self.ctx["shards"], self.post)
        applied = 0
        for p in tracked.iter_patches():
            before[p.name].view(-1)[p.indices.long()] = p.values
            applied += p.indices.numel()
        wrong: list[str] = []
        for name, t in full.iter_full():
            if not torch.equal(t.view(torch.int16), before.pop(name).view(torch.int16)):
                wrong.append(name)
        return {"applied": applied, "wrong": wrong}


def _step_runs(ctx: dict[str, Any], step: _Step, repeats: int, warmup: bool) -> dict[str, Any]:
    fns = {"patch": step.patch, "full": step.full, "raw": step.raw, "compare": step.compare}
    if warmup:
        step.seed()
        for fn in fns.values():
            fn()
        step.seed()  # the warm-up's patch pass moved the baseline
        step.patch_elements.clear()
    ctx["seed_runs"] = []
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in fns}
    for _ in range(repeats):
        step.seed()
        for name, fn in fns.items():
            runs[name].append(_measure(fn))
    runs["tracked_full"] = ctx["seed_runs"]
    out: dict[str, Any] = {"runs": runs, "changed_local": step.changed, "counts": step.counts,
                           "patch_elements": step.patch_elements, "raw_bytes": step.raw_bytes}
    if ctx["check"]:
        out["check"] = step.check()
    if ctx["profile"]:  # untimed: one more patch pass under cProfile on rank 0
        import cProfile

        step.seed()
        prof = cProfile.Profile()
        if step.rank == 0:
            prof.enable()
        step.patch()
        if step.rank == 0:
            prof.disable()
            prof.dump_stats(f"{ctx['profile']}.w{step.world}.lr{ctx['lr']:g}.s{ctx['step']}.prof")
    return out


def _body(args: argparse.Namespace) -> dict[str, Any]:
    """Everything one rank does; the results of rank 0's view are gathered on rank 0."""
    from fsdptk.hf import weight_source

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    config = model_config(args.model, args.size)
    model = build_model(config, 1)
    params = list(model.parameters())
    shards = [_local(p) for p in params]
    if args.init_std is not None:
        gen = torch.Generator().manual_seed(1000 + rank)
        with torch.no_grad():
            for t in shards:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * args.init_std)
    tracked = weight_source(model, dtype=_WIRE, track_changes=True)
    full = weight_source(model, dtype=_WIRE)
    total = sum(math.prod(m.shape) for m in tracked.metadata)
    init = [t.clone() for t in shards]
    _drain(tracked.iter_full())  # the first pass: the baseline
    ctx = {"shards": shards, "tracked": tracked, "full": full, "check": args.check, "seed_runs": [],
           "profile": args.profile}
    rows = []
    warmup = True
    for lr in args.lrs:
        _load(shards, init)
        opt = torch.optim.AdamW(params, lr=lr)
        pre = init
        for s in range(args.steps):
            _set_grads(params, args.seed, s, rank)
            opt.step()
            opt.zero_grad(set_to_none=True)
            post = [t.clone() for t in shards]
            ctx.update(lr=lr, step=s + 1)
            res = _step_runs(ctx, _Step(ctx, pre, post), args.repeats, warmup)
            warmup = False
            res.update(lr=lr, step=s + 1)
            rows.append(res)
            pre = post
        del opt
    tracker = tracked._tracker
    assert tracker is not None
    baseline = (sum(t.numel() * t.element_size() for t in tracker.base.values())
                + sum(t.numel() * t.element_size() for t in tracker.full.values()))
    mine = {"rows": rows, "baseline_bytes": baseline, "shard_bytes": sum(t.numel() * t.element_size() for t in shards)}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone, "world": world, "total_elements": total, "bucket_bytes": tracked._bucket_bytes,
            "model_bytes": sum(p.numel() * p.element_size() for p in params), "layers": config.num_hidden_layers,
            "hidden": config.hidden_size, "hub_tensors": len(tracked.metadata)}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = _body(args)
    if rank == 0:
        q.put(res)
    dist.barrier()
    os._exit(0)  # as weight_sync.py: gloo's teardown sometimes aborts, and nothing after the results matters


def run_local(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """The delta mode at ``world`` ranks on loopback, in fresh processes."""
    return cast(dict[str, Any], spawn(_worker, world, args))


def _torchrun_main(spec_path: str) -> None:
    """One rank under ``torchrun`` on a simulated host (``--hosts``): the spec's arguments; rank 0
    writes the results next to the spec."""
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    res = _body(argparse.Namespace(**spec["args"]))
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(res))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def run_hosts(args: argparse.Namespace) -> dict[str, Any]:
    """The delta mode on ``--hosts`` simulated hosts of ``--per-host`` ranks (root)."""
    from fsdptk.testing.hosts import Hosts

    work = Path(tempfile.mkdtemp(prefix="fsdptk-bench-ws-delta-"))
    spec = work / "spec.json"
    out = work / "out.json"
    keep = {k: v for k, v in vars(args).items() if k not in ("json",)}
    spec.write_text(json.dumps({"args": keep, "out": str(out)}))
    env = {"PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p),
           "MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD, "HF_HUB_OFFLINE": "1"}
    with Hosts(args.hosts, rate=args.rate) as hosts:
        runs = hosts.torchrun(["-m", "benchmarks.weight_sync_delta", str(spec)], nproc_per_node=args.per_host,
                              env=env, timeout=args.timeout)
    failed = [r for r in runs if r.returncode != 0]
    if failed:
        raise RuntimeError(f"host {failed[0].host} exited {failed[0].returncode}:\n{failed[0].stderr[-4000:]}")
    res = json.loads(out.read_text())
    res["links"] = [{"host": r.host, "tx_bytes": r.link.tx_bytes, "rx_bytes": r.link.rx_bytes} for r in runs]
    return res


# ----------------------------------------------------------------------------------------------
# the tables
def _best(ranks: list[dict[str, Any]], i: int, method: str) -> float:
    return min(_seconds(m) for m in ranks[0]["rows"][i]["runs"][method])


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def rows_of(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One summary per step of one world: fraction, bytes, the best times, ratios, checks."""
    ranks = res["ranks"]
    out = []
    for i, row in enumerate(ranks[0]["rows"]):
        elements = row["patch_elements"]
        changed = sum(r["rows"][i]["changed_local"] for r in ranks)
        best = {m: _best(ranks, i, m) for m in METHODS}
        problems = []
        if len(set(elements)) != 1:
            problems.append(f"patch elements differ across repetitions: {elements}")
        if elements and elements[0] != changed:
            problems.append(f"patch elements {elements[0]} != changed bf16 elements {changed}")
        check = row.get("check")
        if check is not None:
            if check["applied"] != changed:
                problems.append(f"check pass: {check['applied']} elements patched, {changed} changed")
            if check["wrong"]:
                problems.append(f"patched != full pass: {', '.join(check['wrong'][:3])}")
        fraction = changed / res["total_elements"]
        floor = best["compare"] + best["raw"]
        out.append({"lr": row["lr"], "step": row["step"], "changed": changed, "fraction": fraction,
                    "patch_bytes": 6 * changed, "seconds": best, "vs_floor": best["patch"] / floor,
                    "vs_full": best["patch"] / best["full"],
                    "meets": (best["patch"] / floor <= PATCH_TARGET,
                              None if fraction >= SPARSE else best["patch"] / best["full"] <= FULL_TARGET),
                    "check": "ok" if not problems else "; ".join(problems)})
    return out


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ok" if ok else " **over**")


def render(results: dict[str, Any]) -> str:
    """Markdown: per world, one row per (lr, step), then the memory per rank."""
    lines = []
    for key, res in results["runs"].items():
        lines += ["", f"## {results['model']} {res['model_bytes'] / 1e9:.3f} GB fp32 ({res['layers']} layers, hidden "
                      f"{res['hidden']}, {res['hub_tensors']} Hub tensors, {res['total_elements'] / 1e6:.1f} M "
                      f"elements), {key}, bf16 wire, min of {results['repeats']}", "",
                  f"| lr | step | changed | patch MB | patch s | full s | raw patch bytes s | compare s | "
                  f"patch / (compare + raw) (target <= {PATCH_TARGET}) | patch / full (target <= {FULL_TARGET} "
                  f"under {SPARSE:.0%}) | tracked full s | check |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows_of(res):
            s = r["seconds"]
            lines.append(f"| {r['lr']:g} | {r['step']} | {100 * r['fraction']:.3f} % | {r['patch_bytes'] / 1e6:.2f} "
                         f"| {s['patch']:.4f} | {s['full']:.4f} | {s['raw']:.4f} | {s['compare']:.4f} "
                         f"| {r['vs_floor']:.2f}{_mark(r['meets'][0])} | {r['vs_full']:.3f}{_mark(r['meets'][1])} "
                         f"| {s['tracked_full']:.4f} | {r['check']} |")
        ranks = res["ranks"]

        def per_rank(method: str, ranks: list[dict[str, Any]] = ranks) -> str:
            return " / ".join(_mib(max(m["peak_above"] for row in r["rows"] for m in row["runs"][method]))
                              for r in ranks)

        lines += ["", "| MiB per rank (rank 0 first) | |", "|---|---|",
                  f"| local shards (fp32) | {' / '.join(_mib(r['shard_bytes']) for r in ranks)} |",
                  f"| baseline kept (tracker's base + full) | {' / '.join(_mib(r['baseline_bytes']) for r in ranks)} |",
                  f"| peak RSS above before, patch pass (max over steps and repeats) | {per_rank('patch')} |",
                  f"| peak RSS above before, full pass | {per_rank('full')} |",
                  f"| one bucket (bucket_bytes) | {_mib(res['bucket_bytes'])} |"]
        if "links" in res:
            sent = " / ".join(f"{lk['tx_bytes'] / 1e6:.0f}" for lk in res["links"])
            lines.append(f"| whole run across the hosts' links, MB sent per host | {sent} |")
    return "\n".join(lines)


def _revision() -> dict[str, Any]:
    """The checkout's commit and whether fsdptk/ differs from it (what the numbers were measured on)."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    return {"commit": git("rev-parse", "HEAD"), "fsdptk_modified": bool(git("status", "--porcelain", "--", "fsdptk"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks weight-sync --delta",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--delta", action="store_true", help="this mode (python -m benchmarks weight-sync --delta)")
    p.add_argument("--model", choices=["llama", "qwen3-moe"], default="llama")
    p.add_argument("--size", type=float, default=1.0, help="model size in GB (1e9 bytes) of fp32 parameters")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    p.add_argument("--steps", type=int, default=1, help="AdamW steps per lr (each one measured)")
    p.add_argument("--seed", type=int, default=0, help="the random gradients' seed")
    p.add_argument("--init-std", type=float, default=None,
                   help="shards normal with this std (default: weight-sync's uniform [0, 1))")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="untimed: patches applied on rank 0 give the full pass bit for bit")
    p.add_argument("--hosts", type=int, default=None, help="simulated hosts (root): world = hosts x per-host")
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="each host link's rate, each way (tc syntax); 'none': unshaped")
    p.add_argument("--timeout", type=float, default=1800.0, help="--hosts: seconds before every host is killed")
    p.add_argument("--profile", default=None, metavar="PREFIX",
                   help="untimed: one more patch pass per step under cProfile on rank 0, to PREFIX.w<W>.lr<lr>.s<step>.prof")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    bad = [w for w in args.worlds if w < 2]
    if bad:
        p.error(f"world sizes must be >= 2, got {bad}")
    args.rate = None if args.rate == "none" else args.rate
    results: dict[str, Any] = {
        "mode": "delta", "model": args.model, "size": args.size, "repeats": args.repeats, "lrs": args.lrs,
        "steps": args.steps, "init_std": args.init_std, "runs": {},
        "command": "python -m benchmarks weight-sync " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["weight-sync"]
                                                                  else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "load_average": {"before": os.getloadavg()}, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "revision": _revision()}
    t0 = time.perf_counter()
    if args.hosts:
        from fsdptk.testing.hosts import hosts_unavailable

        why = hosts_unavailable(shaping=bool(args.rate))
        if why:
            print(f"python -m benchmarks weight-sync --delta --hosts: {why}", file=sys.stderr)
            return 1
        key = f"{args.hosts * args.per_host} ranks on {args.hosts} hosts x {args.per_host}, {args.rate or 'unshaped'} links, FSDP"
        results["runs"][key] = run_hosts(args)
    else:
        for world in args.worlds:
            results["runs"][f"{world} ranks, FSDP, loopback"] = run_local(world, args)
    results["seconds"] = time.perf_counter() - t0
    results["load_average"]["after"] = os.getloadavg()
    la = results["load_average"]
    print(render(results) + f"\n\nload average (1 min) {la['before'][0]:.2f} before, {la['after'][0]:.2f} after; "
          f"{results['seconds']:.0f} s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":  # one rank under torchrun (--hosts)
    _torchrun_main(sys.argv[1])
