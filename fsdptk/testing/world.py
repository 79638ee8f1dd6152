"""A persistent multi-process world for real ``torch.distributed`` tests (gloo on CPU, or NCCL).

Starting N Python processes that import torch and join a gloo process group costs seconds; doing it
once per test makes a multi-process suite crawl. :class:`World` starts the workers once and then runs
any number of picklable functions on every rank, returning the per-rank results. A failing rank is
raised in the caller with its remote traceback; a call that outlives its timeout kills and rebuilds
the world instead of hanging; after any failed call the process group is re-created so that a
half-finished collective cannot poison the next call.

``backend="nccl"`` gives each rank the GPU of its rank (``cuda:<rank>``) and an NCCL process group,
for the checks that need an accelerator; the default is gloo on CPU with accelerators hidden.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any

try:  # cloudpickle pickles lambdas, closures and functions of test modules by value if needed
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - cloudpickle is part of the test extra
    import pickle as _pickler
import pickle

__all__ = ["World", "RemoteError", "WorldTimeout"]

_START_TIMEOUT_S = 180.0
_BACKENDS = ("gloo", "nccl", "cuda:nccl,cpu:gloo")
_GRACE_S = 5.0  # how long the other ranks get to answer once one rank has failed


class RemoteError(RuntimeError):
    """An exception raised by a function on a rank of a :class:`World`.

    Attributes:
        rank: the rank that raised.
        exc_type: the exception class name on that rank (e.g. ``"ValueError"``).
        message: ``str()`` of the remote exception.
        remote_traceback: the formatted traceback from the worker.
        original: the remote exception object when it could be unpickled, else ``None``.
        per_rank: the outcome of every rank: a result or a :class:`RemoteError` (only set on the
            error raised by :meth:`World.run`; ``None`` on the per-rank entries).
    """

    def __init__(
        self,
        rank: int,
        exc_type: str,
        message: str,
        remote_traceback: str,
        original: BaseException | None = None,
    ) -> None:
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}\n--- remote traceback (rank {rank}) ---\n"
            f"{remote_traceback}"
        )
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.original = original
        self.per_rank: list[Any] | None = None


class WorldTimeout(TimeoutError):
    """A :meth:`World.run` call did not finish in time; the world was rebuilt."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_pg(rank: int, world_size: int, port: int, pg_timeout_s: float, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if "nccl" in backend:  # rank r drives cuda:r; binding it up front makes NCCL's setup eager
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
        **kwargs,
    )


def _forget_old_meshes() -> None:
    """Drop DTensor's caches after the process group was rebuilt in this worker.

    A new process group restarts torch's group numbering, and DeviceMesh equality ignores group
    names: DTensor's sharding-propagation and redistribution caches could hand a new mesh's
    tensors an output spec that still names a group of the destroyed process group ("Could not
    resolve the process group registered under the name N").
    """
    from fsdptk._core.compat import clear_dtensor_caches

    clear_dtensor_caches()


# set in a worker before torch is imported (gloo worlds): FSDP2 / DeviceMesh pick
# an accelerator whenever one is visible (then rank r asks for device r, which may not exist)
_HIDE_ACCELERATORS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "",
                      "ZE_AFFINITY_MASK": "", "ASCEND_RT_VISIBLE_DEVICES": ""}


_PRELOAD = "fsdptk.testing._preload"


def _start_context(cpu_only: bool) -> Any:
    """How a world starts its workers: forked from multiprocessing's fork server with torch
    already imported (``fsdptk.testing._preload``) for gloo-on-CPU worlds on POSIX, else spawned.

    The fork server is one per process: it is used only where it is not running yet (then its
    preload is set here) or runs with this preload, and nobody set another preload; otherwise, and
    with ``FSDPTK_WORLD_START=spawn``, workers are spawned (a fresh interpreter each). NCCL worlds
    are always spawned (a forked CUDA context is unusable).
    """
    if not cpu_only or os.environ.get("FSDPTK_WORLD_START", "forkserver") == "spawn":
        return mp.get_context("spawn")
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    preload = list(getattr(server, "_preload_modules", ["__main__"]))
    running = getattr(server, "_forkserver_pid", None) is not None
    ctx = mp.get_context("forkserver")
    if preload == [_PRELOAD]:
        return ctx
    if running or preload not in ([], ["__main__"]):  # someone else's fork server: leave it alone
        return mp.get_context("spawn")
    ctx.set_forkserver_preload([_PRELOAD])
    return ctx


def _worker_main(
    rank: int, world_size: int, port: int, conn: Connection, pg_timeout_s: float,
    cpu_only: bool = True, backend: str = "gloo",
) -> None:  # runs in the child process
    if cpu_only:
        os.environ.update(_HIDE_ACCELERATORS)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        _init_pg(rank, world_size, port, pg_timeout_s, backend)
    except BaseException as e:  # noqa: BLE001 - report any start-up failure to the parent
        conn.send(("fatal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "close":
            with contextlib.suppress(BaseException):  # closing: nothing to report to
                dist.destroy_process_group()
            return
        if kind == "reinit":
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
                os.environ["MASTER_PORT"] = str(msg[1])
                _init_pg(rank, world_size, msg[1], pg_timeout_s, backend)
                _forget_old_meshes()
                conn.send(("ready", os.getpid()))
            except BaseException as e:  # noqa: BLE001
                conn.send(("fatal", f"{type(e).__name__}: {e}"))
            continue
        # ("run", payload, sys_path)
        _, payload, sys_path = msg
        for p in sys_path:
            if p not in sys.path:
                sys.path.append(p)
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            out: tuple[Any, ...] = ("ok", _pickler.dumps(result))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            try:
                exc_blob = _pickler.dumps(e)
                pickle.loads(exc_blob)
            except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
                exc_blob = None
            out = ("err", type(e).__name__, str(e), traceback.format_exc(), exc_blob)
        try:
            conn.send(out)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable result
            conn.send(("err", type(e).__name__, f"could not send the result: {e}", "", None))


def _check_backend(backend: str, cpu_only: bool | None, world_size: int) -> None:
    """Validate :class:`World`'s ``backend`` in the caller, before any worker starts."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if "nccl" not in backend:
        return
    if cpu_only:
        raise ValueError(f"backend={backend!r} needs the GPUs: pass cpu_only=False (or leave it "
                         "None), got cpu_only=True")
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise RuntimeError(f"backend={backend!r} needs CUDA, but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    if torch.cuda.device_count() < world_size:
        raise RuntimeError(f"backend={backend!r} gives each rank its own GPU: world_size {world_size} "
                           f"needs {world_size} GPUs, torch.cuda.device_count() is "
                           f"{torch.cuda.device_count()}")
    if not dist.is_nccl_available():
        raise RuntimeError(f"backend={backend!r} needs NCCL, but torch {torch.__version__} was built "
                           "without it (torch.distributed.is_nccl_available() is False)")


def _outcome(rank: int, msg: tuple[Any, ...]) -> Any:
    """A worker's answer as a result or a :class:`RemoteError`; never raises.

    Unpickling happens here, in the caller: a result or exception whose class the caller cannot
    import must become an error for this call, not an exception that leaves the other ranks'
    answers unread in their pipes (they would be taken for the next call's results).
    """
    if msg[0] == "ok":
        try:
            return pickle.loads(msg[1])
        except Exception as e:  # noqa: BLE001
            return RemoteError(rank, type(e).__name__, f"could not unpickle the result: {e}",
                               traceback.format_exc())
    _, exc_type, message, tb, blob = msg
    try:
        original = pickle.loads(blob) if blob is not None else None
    except Exception:  # noqa: BLE001 - the text of the error is enough
        original = None
    return RemoteError(rank, exc_type, message, tb, original)


class World:
    """N persistent worker processes joined in one process group on this machine.

    Args:
        world_size: number of ranks (1 or more).
        timeout: default seconds a :meth:`run` call may take before the world is rebuilt.
        pg_timeout: seconds a collective may block inside a worker (the backend's own timeout).
        cpu_only: hide accelerators from the workers (``CUDA_VISIBLE_DEVICES=""`` and the like),
            so that code which picks a device when one is visible (FSDP2's default mesh,
            ``torch.accelerator``) behaves as on a CPU-only machine. ``False`` leaves the
            environment alone. Default (``None``): ``True`` for gloo, ``False`` for NCCL (which
            needs the GPUs; ``cpu_only=True`` with ``backend="nccl"`` is an error).
        backend: ``"gloo"`` (default: CPU tensors) or ``"nccl"``: rank ``r`` calls
            ``torch.cuda.set_device(r)`` and joins an NCCL process group bound to ``cuda:r``, so
            the machine needs CUDA and at least ``world_size`` visible GPUs.
            ``"cuda:nccl,cpu:gloo"`` (what ``get_distributed_backend("cuda",
            offload_ops_to_cpu=True)`` returns, for CPU offload) is NCCL for CUDA tensors and
            gloo for CPU tensors, with the same GPU per rank.

    How workers start: a CPU-only world's workers are forked from multiprocessing's fork server,
    which imports torch (accelerators hidden) and the modules ``FSDPTK_WORLD_PRELOAD`` names
    (comma-separated, e.g. ``transformers,peft``) once per process, so a world starts, and is
    rebuilt after a killed rank or a timeout, in a fraction of a second instead of an interpreter
    start and torch's import per worker. The fork server is one per process: where another
    preload was set for it (or it already runs with one), the workers are spawned instead, as
    they are with ``FSDPTK_WORLD_START=spawn`` and for NCCL worlds.

    Raises:
        ValueError: ``world_size`` below 1, an unknown ``backend``, or an NCCL backend with
            ``cpu_only=True``.
        RuntimeError: an NCCL backend when CUDA or NCCL is not available, or fewer GPUs are
            visible than ``world_size`` (the message names both counts); raised before any
            process starts.

    Examples:
        >>> import torch.distributed as dist
        >>> from fsdptk.testing import World
        >>> def rank_times_ten():
        ...     return dist.get_rank() * 10
        >>> with World(2) as w:  # spawns processes; tests/test_testing_world.py runs it  # doctest: +SKIP
        ...     w.run(rank_times_ten)
        [0, 10]
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 120.0,
        pg_timeout: float = 120.0,
        cpu_only: bool | None = None,
        backend: str = "gloo",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        _check_backend(backend, cpu_only, world_size)
        self.world_size = world_size
        self.backend = backend
        self.cpu_only = "nccl" not in backend if cpu_only is None else cpu_only
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self._ctx = _start_context(self.cpu_only)
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.restarts = 0  # how many times the workers were killed and started again
        self._start()

    # lifecycle -------------------------------------------------------------------------------
    def _start(self) -> None:
        port = _free_port()
        self._procs, self._conns = [], []
        for rank in range(self.world_size):
            parent, child = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, child, self.pg_timeout, self.cpu_only,
                      self.backend),
                daemon=True,
                name=f"fsdptk-world{self.world_size}-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._await_ready(_START_TIMEOUT_S, "start")

    def _await_ready(self, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self._kill()
                raise WorldTimeout(f"rank {rank} did not {what} within {timeout:.0f}s")
            try:
                msg = conn.recv()
            except EOFError:
                self._kill()
                raise RuntimeError(f"rank {rank} died during {what}") from None
            if msg[0] != "ready":
                self._kill()
                raise RuntimeError(f"rank {rank} failed to {what}: {msg[1]}")

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def _restart(self) -> None:
        self._kill()
        self.restarts += 1
        self._start()

    def _reinit_pg(self) -> None:
        """Fresh process group on the same processes; a full restart if that fails."""
        port = _free_port()
        try:
            for conn in self._conns:
                conn.send(("reinit", port))
            self._await_ready(60.0, "re-create its process group")
        except Exception:  # noqa: BLE001 - the fallback is a clean restart
            self._restart()

    def close(self) -> None:
        """Stop the workers. The world cannot be used afterwards."""
        for conn in self._conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
        self._kill()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, rank by rank."""
        return [p.pid for p in self._procs]

    # running ---------------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the results, rank by rank.

        Args:
            fn: a picklable callable (a module-level function; with cloudpickle installed, also
                lambdas and closures). It runs with the default process group initialised.
            *args: positional arguments, pickled and sent to every rank.
            timeout: seconds before the call is abandoned and the world rebuilt (default: the
                world's ``timeout``).
            return_exceptions: return a :class:`RemoteError` in the failed ranks' slots instead of
                raising.
            **kwargs: keyword arguments for ``fn``.

        Returns:
            list: one entry per rank.

        Raises:
            RemoteError: the lowest failed rank's error (``per_rank`` holds every rank's outcome).
            WorldTimeout: when some rank did not answer in time.

        Examples:
            >>> import torch, torch.distributed as dist
            >>> def total():
            ...     t = torch.ones(1) * (dist.get_rank() + 1)
            ...     dist.all_reduce(t)
            ...     return t.item()
            >>> World(2).run(total)  # spawns processes; tests/test_testing_world.py runs it  # doctest: +SKIP
            [3.0, 3.0]
        """
        if not self._procs:
            raise RuntimeError("this World is closed")
        timeout = self.timeout if timeout is None else timeout
        payload = _pickler.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send(("run", payload, list(sys.path)))

        outcomes: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        failed = False
        died: list[int] = []
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            # block until some rank answers (or dies: its end of the pipe reads EOF), no polling
            ready = wait_any([self._conns[r] for r in pending], timeout=deadline - now)
            for rank in sorted(r for r in pending if self._conns[r] in ready):
                conn = self._conns[rank]
                pending.discard(rank)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    outcomes[rank] = RemoteError(rank, "WorkerDied", f"exit code {code}", "")
                    died.append(rank)
                    failed = True
                    continue
                outcomes[rank] = _outcome(rank, msg)
                failed = failed or isinstance(outcomes[rank], RemoteError)
            if failed:  # the others get a short grace to report (they may be blocked on the failed rank)
                deadline = min(deadline, time.monotonic() + _GRACE_S)

        if pending or died:
            missing = sorted(pending)
            self._restart()
            errors = [o for o in outcomes if isinstance(o, RemoteError)]
            for rank in missing:
                outcomes[rank] = RemoteError(
                    rank, "WorldTimeout", f"no answer within {timeout:.0f}s", ""
                )
            if return_exceptions:
                return outcomes
            if errors:
                errors[0].per_rank = outcomes
                raise errors[0]
            raise WorldTimeout(
                f"{getattr(fn, '__name__', fn)!r} did not finish within {timeout:.0f}s on "
                f"rank(s) {missing}; the world was restarted"
            )
        if failed:
            self._reinit_pg()
            if not return_exceptions:
                err = next(o for o in outcomes if isinstance(o, RemoteError))
                err.per_rank = outcomes
                raise err
        return outcomes
