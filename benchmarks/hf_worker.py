"""One rank of one ``python -m benchmarks hf`` run: load, first forward, a training step, save.

Run as ``python -m benchmarks.hf_worker SPEC.json`` by :func:`benchmarks.runner.launch_workers`
(``RANK`` / ``WORLD_SIZE`` / ``MASTER_PORT`` in the environment; every run is fresh processes).
The spec names the method (``transformers`` or ``fsdptk``), the mesh (``dp_shard`` x ``tp``), the
checkpoint directory, the batch and the output directory. Phases, each timed on this rank from the
call to its return (max over ranks is taken by the driver), with a barrier between phases:

1. imports and ``init_process_group`` (gloo): reported, not part of the load. The spec's
   ``imports``: ``union`` (the warm figure) imports :data:`UNION_MODULES` before the clock for
   both methods, so neither load pays for imports the other did not; ``own`` (the cold figure)
   imports only the method's entry point, and the run reports the time from the process start to
   the loaded model (``cold_loaded_s``: imports, process group, build, load) and to the first
   finished step (``cold_step_s``). ``gc.collect()`` runs before every clock; the driver reads the
   checkpoint's files into the page cache before every run, so both methods start from it hot.
   ``imports: user`` with ``clock: user`` (issue 44, what a user's loop sees): both methods import
   :data:`USER_IMPORTS` (what a script imports at its top for either call), no ``gc.collect()``, no
   read counter around ``safe_open``, and each phase is ``barrier, clock, call, barrier, clock``;
2. load: ``AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(
   fsdp_size, tp_size[, ep_size]))`` or ``fsdptk.hf.from_pretrained(path, dims=ParallelDims(dp_shard, tp,
   ep=ep))``;
3. first forward (``no_grad``) on a fixed batch: rank 0 writes the logits for the driver's check;
4. one training step (the optimizer built right after the load, before the first forward, or
   after it with the spec's ``optimizer_after: forward``): forward with labels, backward, ``AdamW(lr=0).step()`` (the spec's
   ``optimizer``; ``sgd`` is ``SGD(lr=0)``): it writes every parameter, as any step does, and
   leaves the values, so the saved tensors can be compared bit for bit; AdamW also allocates its
   two moments, as a real first step does; ``zero_grad(set_to_none=True)``;
5. save: ``model.save_pretrained(dir)`` or ``fsdptk.save_safetensors(model, dir)``.

Bytes read from the checkpoint's files over the load are counted on every rank (every tensor
either method reads through ``safetensors.safe_open``: ``load.read``).

After each phase: RSS, ``RssAnon``, ``RssFile`` and ``VmHWM`` (reset through
``/proc/self/clear_refs`` at the start of the phase) from ``/proc/self/status``; after the step
also ``RssAnon`` once glibc's ``malloc_trim(0)`` gave freed heap back (the live memory); over the
load and the save, bytes sent (``wchar``, minus the bytes of the files this rank wrote).
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # the process's start, as near as Python sees it (the cold clock)

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

__all__ = ["main", "status_bytes", "preclock_imports", "import_names", "UNION_MODULES", "USER_IMPORTS"]

# What a "warm" run imports before any clock starts, whichever method it runs: the union of what
# either load imports on its own (transformers' distributed path and fsdptk.hf), so neither
# method's timed load pays for imports the other has already paid (tests/test_bench_report.py
# checks that the modules loaded when the load clock starts are the same for both methods).
UNION_MODULES = (
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp", "torch.distributed.device_mesh", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict", "safetensors", "safetensors.torch",
    "transformers", "transformers.modeling_utils", "transformers.core_model_loading",
    "transformers.conversion_mapping", "transformers.distributed", "transformers.distributed.fsdp",
    "transformers.distributed.tensor_parallel", "transformers.integrations.accelerate", "accelerate",
    "fsdptk", "fsdptk.hf", "fsdptk.hf.pretrained", "fsdptk.checkpoint", "fsdptk.conversions",
    "fsdptk.sharding", "fsdptk.tp", "fsdptk.activation", "fsdptk.mesh", "fsdptk.state_dict",
    "fsdptk._plans.hf_convert", "fsdptk._plans.hf_tp", "fsdptk._engine",
)


# What a user's script imports at its top for either call (issue 44's harness, the ``user`` clock):
# the same for both methods; what either call imports on first use (transformers' modeling code)
# is inside the clock. ``a:b`` is ``from a import b``.
USER_IMPORTS = ("torch", "torch.distributed", "transformers", "transformers:AutoModelForCausalLM",
                "transformers.distributed:DistributedConfig", "fsdptk", "fsdptk.hf", "fsdptk.sharding",
                "fsdptk.checkpoint", "fsdptk.tp")


def import_names(names: tuple[str, ...]) -> None:
    """Import each ``module`` or ``module:attribute`` of ``names`` (an attribute of a lazy
    package such as ``transformers`` is imported when it is read)."""
    import importlib

    for name in names:
        module, _, attr = name.partition(":")
        mod = importlib.import_module(module)
        if attr:
            getattr(mod, attr)


def preclock_imports(spec: dict[str, Any]) -> None:
    """Import what the run's clock must not pay for: the union (``imports: union``, the warm
    figure, the same for both methods), or only the method's own entry point (``imports: own``,
    the cold figure, measured from the process start)."""
    import importlib

    import torch  # noqa: F401

    if spec.get("imports") == "user":
        import_names(USER_IMPORTS)
    elif spec.get("imports", "union") == "union":
        for name in UNION_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:  # an optional module of another release: absent for both methods
                pass
        arch = spec.get("arch")
        if arch:  # the model's own modeling module, which either load imports when it builds
            importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    elif spec["method"] == "transformers":
        import transformers  # noqa: F401
        from transformers.distributed import DistributedConfig  # noqa: F401
    else:
        import fsdptk.hf  # noqa: F401


class _CountingSlice:
    """A safetensors slice that counts the bytes of every piece read from it."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self._inner, self._counter = inner, counter

    def __getitem__(self, index: Any) -> Any:
        t = self._inner[index]
        self._counter[0] += t.numel() * t.element_size()
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CountingHandle:
    """A ``safe_open`` handle that counts the tensor bytes read through it."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self._inner, self._counter = inner, counter

    def get_tensor(self, key: str) -> Any:
        t = self._inner.get_tensor(key)
        self._counter[0] += t.numel() * t.element_size()
        return t

    def get_slice(self, key: str) -> Any:
        return _CountingSlice(self._inner.get_slice(key), self._counter)

    def __enter__(self) -> Any:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def count_file_reads() -> list[int]:
    """Count the tensor bytes this process reads from safetensors files (both methods open them
    with ``safetensors.safe_open``): returns the one-element counter."""
    import sys as _sys

    import safetensors

    counter = [0]
    real = safetensors.safe_open

    def opener(*args: Any, **kwargs: Any) -> Any:
        return _CountingHandle(real(*args, **kwargs), counter)

    safetensors.safe_open = opener
    for mod in list(_sys.modules.values()):  # modules that imported the name itself
        if getattr(mod, "safe_open", None) is real and getattr(mod, "__name__", "").startswith("transformers"):
            mod.safe_open = opener
    return counter

_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def status_bytes() -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``VmHWM`` of this process (bytes)."""
    with open("/proc/self/status") as f:
        text = f.read()
    out = {}
    for name in _FIELDS:
        m = re.search(rf"^{name}:\s+(\d+) kB", text, re.M)
        out[name] = int(m.group(1)) * 1024 if m else -1
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS (Linux >= 4.0)


def _trim_heap() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return -1


def _files_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


def _phase(fn, dist, *, sent: bool = False, user: bool = False) -> tuple[Any, dict[str, Any]]:
    """Run ``fn`` between barriers; this rank's time, memory after, peak over, bytes written.

    ``user`` (the ``user`` clock, issue 44): no ``gc.collect()`` before it, and the barrier after
    the call inside the clock (``barrier, clock, fn(), barrier, clock``: the slowest rank's time,
    as a user's loop sees it); otherwise ``gc.collect()``, and the rank's own call time."""
    import gc

    if not user:
        gc.collect()
    dist.barrier()
    _reset_peak()
    rss0 = status_bytes()["VmRSS"]
    w0 = _wchar()
    t0 = time.perf_counter()
    result = fn()
    if user:
        dist.barrier()
    seconds = time.perf_counter() - t0
    w1 = _wchar()
    mem = status_bytes()
    rec: dict[str, Any] = {"s": seconds, "rss": mem["VmRSS"], "anon": mem["RssAnon"], "file": mem["RssFile"],
                           "peak": mem["VmHWM"], "rss0": rss0}
    if sent:
        rec["written"] = w1 - w0
    if not user:
        dist.barrier()
    return result, rec


def _run(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    import gc

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    preclock_imports(spec)
    import transformers  # both methods use it (fsdptk.hf builds the model with it)

    method, dp_shard, tp, ep = spec["method"], spec["dp_shard"], spec["tp"], spec.get("ep", 1)
    if method == "transformers":
        from transformers.distributed import DistributedConfig

        def load():
            config = DistributedConfig(fsdp_size=dp_shard, tp_size=tp,
                                       **({"ep_size": ep} if ep > 1 else {}))
            extra = {}
            if spec.get("quant") == "fp8":  # transformers' dequantizing load of an FP8 release
                extra["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
            return transformers.AutoModelForCausalLM.from_pretrained(spec["ckpt_dir"], distributed_config=config,
                                                                     **extra)

        def save(model, out):
            model.save_pretrained(out)
            if spec.get("save_clock") == "durable" and rank == 0:  # its files on disk, as fsdptk's commit does
                _fsync_tree(Path(out))
    else:
        import fsdptk
        from fsdptk.hf import from_pretrained

        def load():
            return from_pretrained(spec["ckpt_dir"], dims=fsdptk.ParallelDims(dp_shard=dp_shard, tp=tp, ep=ep))

        def save(model, out):
            fsdptk.save_safetensors(model, out)
    rec: dict[str, Any] = {"rank": rank, "import_s": time.perf_counter() - _T_START, "before": status_bytes(),
                           "imports": spec.get("imports", "union")}
    user = spec.get("clock") == "user"  # a user's loop: no read counter, no collection before the clocks
    reads = None if user else count_file_reads()
    t0 = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rec["init_s"] = time.perf_counter() - t0
    if not user:
        gc.collect()
    rec["preclock_modules"] = len(sys.modules)
    if spec.get("record_modules"):
        rec["preclock_module_names"] = sorted(sys.modules)

    model, rec["load"] = _phase(load, dist, sent=True, user=user)
    if reads is not None:
        rec["load"]["read"] = reads[0]
    rec["cold_loaded_s"] = time.perf_counter() - _T_START  # process start -> loaded model

    def make_optimizer() -> torch.optim.Optimizer:
        if spec.get("optimizer", "adamw") == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.0)
        return torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: written (p -= 0 * u), values kept

    early = spec.get("optimizer_after", "load") == "load"
    optimizer = make_optimizer() if early else None
    batch = torch.randint(3, model.config.vocab_size, tuple(spec["batch"]),
                          generator=torch.Generator().manual_seed(7))

    def forward():
        with torch.no_grad():
            out = model(input_ids=batch).logits
        return out.full_tensor() if hasattr(out, "full_tensor") else out

    logits, rec["forward"] = _phase(forward, dist, user=user)
    out_dir = Path(spec["out_dir"])
    if rank == 0:
        torch.save(logits, out_dir / "logits.pt")
    del logits
    rec["load_forward_s"] = rec["load"]["s"] + rec["forward"]["s"]
    optimizer = optimizer or make_optimizer()

    def step():
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    if spec.get("skip_step"):  # load-focused repeats: the step is compute, minutes at 4 GB
        return _save_phase(rec, spec, rank, dist, save, model)
    rec["loss"], rec["step"] = _phase(step, dist, user=user)
    rec["cold_step_s"] = time.perf_counter() - _T_START  # process start -> first finished step
    if spec.get("skip_save"):  # a cold run (its figures are the two above), or a run without a save
        rec["load"]["sent"] = rec["load"]["written"]
        return rec
    names = {id(p): n for n, p in model.named_parameters()}
    # a parameter the step did not reach (no gradient, so no optimizer state): it would never train
    rec["step"]["params_without_state"] = sorted(
        names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state)
    _trim_heap()  # what the step left live, without the freed heap glibc keeps (reported beside)
    rec["step"]["anon_trimmed"] = status_bytes()["RssAnon"]
    return _save_phase(rec, spec, rank, dist, save, model)


def _fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory`` and the directories themselves."""
    for path in sorted(directory.rglob("*")) + [directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _save_phase(rec: dict[str, Any], spec: dict[str, Any], rank: int, dist: Any, save: Any, model: Any
                ) -> dict[str, Any]:
    save_dir = Path(spec["save_dir"])
    if spec.get("save_clock", "as-is") != "as-is":
        # the disk's write-back queue empty for both methods (the previous runs' files, this run's
        # logits): without it, a save that only fills the page cache (transformers') runs faster or
        # slower with what earlier runs left dirty, one that fsyncs (fsdptk's) waits for it
        os.sync()
    _, rec["save"] = _phase(lambda: save(model, save_dir), dist, sent=True, user=spec.get("clock") == "user")
    rec["save"]["files"] = _files_bytes(save_dir) if rank == 0 else 0
    rec["save"]["sent"] = rec["save"]["written"] - rec["save"]["files"]
    rec["load"]["sent"] = rec["load"]["written"]
    return rec


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(spec["out_dir"]) / f"rank{rank}.json"
    try:
        rec = _run(spec, rank, world)
    except Exception as e:  # noqa: BLE001 - reported to the driver, which marks the run failed
        traceback.print_exc()
        out.write_text(json.dumps({"rank": rank, "error": f"{type(e).__name__}: {e}"[:2000]}))
        sys.stdout.flush()
        os._exit(1)
    out.write_text(json.dumps(rec))
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: gloo's teardown can abort at exit (benchmarks/worker.py)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:][0]))
