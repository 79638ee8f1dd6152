"""Simulated hosts on one Linux machine: network namespaces joined by a shaped switch.

Multi-host behaviour (which bytes cross between machines, what happens when a machine dies) cannot
be seen on loopback: every rank of a single-machine run talks through ``lo``. :class:`Hosts`
builds ``n`` *hosts*, each a network namespace with one interface ``eth0`` and its own address in
a private /24, plugged into a bridge that lives in a namespace of its own (the *switch*). Nothing
is created in the caller's namespace, so no address, route or interface outside the hosts it made
is touched, and deleting the namespaces removes every link. Optional ``tc netem`` shaping gives
each host's link a rate and a latency, both ways.

Commands run inside a host with ``ip netns exec``, so every process of a host shares that host's
``eth0``: ranks of one host talk to each other over the namespace's loopback (not counted), and
only traffic between hosts passes ``eth0``, whose kernel counters (``tx_bytes``, ``rx_bytes``)
therefore measure exactly what crossed between hosts (headers included). A worker can read its own
host's counters with :func:`link_stats` (``/sys`` inside the namespace is the namespace's).

:meth:`Hosts.torchrun` starts one ``torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d``
per host, the rendezvous store on host 0's address, gloo bound to ``eth0``
(``GLOO_SOCKET_IFNAME``), and returns one :class:`HostRun` per host with the bytes its link sent
and received during the run. :meth:`Hosts.launch` starts the same without waiting, so that a test
can kill a host (:meth:`Launch.kill_host`) half-way through.

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``), ``ip`` (iproute2) and, for shaping, ``tc``
with the ``netem`` qdisc; :func:`hosts_unavailable` says why not, without changing anything.
Teardown (context manager exit, :meth:`Hosts.close`, and an ``atexit`` hook for a parent that
exits without closing) kills the processes left in the namespaces and deletes them; namespaces
left by a process that was itself killed (``SIGKILL``) are deleted by the next :class:`Hosts`
started on the machine (their names carry the creating process id, checked to be gone).
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HostRun",
    "Hosts",
    "HostsUnavailable",
    "Launch",
    "LinkStats",
    "hosts_unavailable",
    "link_stats",
]

IFNAME = "eth0"  # the one interface of every host (inside its own namespace)
_PREFIX = "fsdptk-"
_NAME_RE = re.compile(r"^fsdptk-(\d+)-(\d+)-(h\d+|sw)$")
_counter = itertools.count()


class HostsUnavailable(RuntimeError):
    """Simulated hosts cannot be created here (not root, no namespaces, no ``ip``/``tc``)."""


@dataclass(frozen=True)
class LinkStats:
    """Kernel counters of one host's link (its ``eth0``), or the difference of two readings.

    Attributes:
        tx_bytes: bytes the host sent to the other hosts (Ethernet frames: headers included).
        rx_bytes: bytes the host received from them.
        tx_packets: frames sent (a TSO/GSO super-frame counts once).
        rx_packets: frames received.
    """

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: LinkStats) -> LinkStats:
        return LinkStats(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                         self.tx_packets - other.tx_packets, self.rx_packets - other.rx_packets)


@dataclass(frozen=True)
class HostRun:
    """What one host did during :meth:`Hosts.torchrun` (or a :class:`Launch`).

    Attributes:
        host: the host index (0 holds the rendezvous store).
        address: the host's address on the simulated network.
        returncode: the exit status of the host's ``torchrun`` (negative: killed by that signal).
        stdout: its standard output (all local ranks; torchrun's ``--tee`` is not used).
        stderr: its standard error.
        link: bytes and frames the host's link sent and received while the command ran.
        seconds: wall seconds from the start of the launch to this host's exit.
    """

    host: int
    address: str
    returncode: int
    stdout: str
    stderr: str
    link: LinkStats
    seconds: float


def link_stats(ifname: str = IFNAME, netns: str | None = None) -> LinkStats:
    """Read an interface's counters: of this process's namespace, or of ``netns`` (root only).

    Inside a host (a process started by :class:`Hosts`), ``link_stats()`` reads that host's link
    from ``/sys/class/net/eth0/statistics``: all ranks of a host share it, so one rank per host
    (``LOCAL_RANK == 0``) reading it between barriers measures what a step sent across hosts.

    Args:
        ifname: the interface (default ``eth0``, the link of a simulated host).
        netns: a namespace name to read from outside it (``ip -n NETNS -s -j link``); ``None``:
            this process's own namespace.

    Returns:
        LinkStats: the counters now (cumulative since the interface was created).

    Examples:
        >>> stats = link_stats("lo")
        >>> stats.tx_bytes >= 0
        True
    """
    if netns is None:
        base = Path("/sys/class/net") / ifname / "statistics"
        values = {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets",
                                                           "rx_packets")}
        return LinkStats(**values)
    out = _ip(["-n", netns, "-s", "-j", "link", "show", "dev", ifname])
    stats = json.loads(out)[0]["stats64"]
    return LinkStats(stats["tx"]["bytes"], stats["rx"]["bytes"], stats["tx"]["packets"],
                     stats["rx"]["packets"])


def hosts_unavailable(*, shaping: bool = True) -> str | None:
    """Why :class:`Hosts` cannot run here, or ``None`` when it can. Changes nothing.

    Args:
        shaping: also require ``tc`` (for ``rate`` / ``delay``).

    Returns:
        ``None``, or a sentence naming what is missing (root, ``ip``, ``tc``, network namespaces).

    Examples:
        >>> reason = hosts_unavailable()
        >>> reason is None or isinstance(reason, str)
        True
    """
    if sys.platform != "linux":
        return f"simulated hosts need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return (f"simulated hosts need root (network namespaces, veth links, tc); running as uid "
                f"{os.geteuid()}")
    for tool in ("ip",) + (("tc",) if shaping else ()):
        if shutil.which(tool) is None:
            return f"simulated hosts need `{tool}` (iproute2), not found on PATH"
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces (/proc/self/ns/net is missing)"
    return None


def _ip(args: Sequence[str], *, check: bool = True) -> str:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed ({res.returncode}): "
                               f"{res.stderr.strip()}")
    return res.stdout


def _tc(netns: str, dev: str, rate: str | None, delay: str | None) -> None:
    """Shape ``dev``'s egress: ``tbf`` for a rate alone, ``netem`` when a delay is asked for."""
    if delay:  # netem delays (and, with rate, also shapes); deep enough never to drop
        qdisc = ["netem", "limit", "100000", "delay", delay] + (["rate", rate] if rate else [])
    else:  # a token bucket: a burst above the largest GSO frame (64 KiB), a queue that never drops
        qdisc = ["tbf", "rate", rate or "", "burst", "256kb", "limit", "64mb"]
    res = subprocess.run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *qdisc],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise HostsUnavailable(
            f"`tc qdisc replace dev {dev} root {' '.join(qdisc)}` in {netns} failed: "
            f"{res.stderr.strip()}" + (" (delay needs the kernel's sch_netem; rate alone uses "
                                       "sch_tbf)" if delay else ""))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


def _delete_netns(netns: str) -> None:
    """Kill what still runs in ``netns`` (processes this module started there), then delete it."""
    for _ in range(3):
        pids = _netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    subprocess.run(["ip", "netns", "delete", netns], capture_output=True, check=False)
    shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)


def _remove_stale() -> None:
    """Delete namespaces of earlier :class:`Hosts` whose creating process no longer exists."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _delete_netns(name)


class Launch:
    """A command running on every host (from :meth:`Hosts.launch`); :meth:`wait` collects it.

    Attributes:
        procs: the ``subprocess.Popen`` of each host's command (``ip netns exec ...``).
        started: ``time.time()`` when the commands were started.
    """

    def __init__(self, hosts: Hosts, procs: list[subprocess.Popen], before: list[LinkStats],
                 logs: list[tuple[Path, Path]]) -> None:
        self._hosts = hosts
        self.procs = procs
        self._before = before
        self._logs = logs
        self.started = time.time()
        self._ended: dict[int, float] = {}

    def kill_host(self, host: int) -> float:
        """Kill every process of ``host`` with SIGKILL at once, as a machine that loses power.

        The kernel then closes their sockets, so peers see the connections reset. Returns the
        ``time.time()`` of the kill.
        """
        t = time.time()
        for pid in _netns_pids(self._hosts.netns[host]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return t

    def cut_link(self, host: int) -> float:
        """Take ``host``'s link down (a pulled cable: no reset reaches the peers). Returns the time."""
        t = time.time()
        _ip(["-n", self._hosts.netns[host], "link", "set", IFNAME, "down"])
        return t

    def poll(self) -> list[int | None]:
        """Each host's exit status so far (``None``: still running)."""
        codes = [p.poll() for p in self.procs]
        for i, c in enumerate(codes):
            if c is not None and i not in self._ended:
                self._ended[i] = time.time()
        return codes

    def stop(self) -> list[HostRun]:
        """Kill every host's processes now and collect what they did (never raises).

        After a host was killed, the survivors' ``torchrun`` agents wait in their exit barrier for
        the lost node (minutes): a test reads what the ranks wrote, then stops the launch.
        """
        for host in range(len(self.procs)):
            self.kill_host(host)
        for p in self.procs:
            p.wait()
        return self.wait()

    def wait(self, timeout: float | None = None) -> list[HostRun]:
        """Wait for every host's command; kill all of them ``timeout`` seconds after this call.

        Returns:
            list[HostRun]: one per host, with the link counters' difference over the run.

        Raises:
            TimeoutError: the commands outlived ``timeout``; every host's processes are killed
                first (the message carries the tails of their outputs).
        """
        deadline = None if timeout is None else time.time() + timeout
        timed_out = False
        while any(c is None for c in self.poll()):
            if deadline is not None and time.time() > deadline:
                timed_out = True
                for host in range(len(self.procs)):
                    self.kill_host(host)
                for p in self.procs:
                    p.wait()
                self.poll()
                break
            time.sleep(0.05)
        runs = []
        for i, (proc, (out, err)) in enumerate(zip(self.procs, self._logs)):
            runs.append(HostRun(
                host=i, address=self._hosts.addresses[i], returncode=proc.returncode,
                stdout=out.read_text(errors="replace"), stderr=err.read_text(errors="replace"),
                link=self._hosts.link_stats(i) - self._before[i],
                seconds=self._ended.get(i, time.time()) - self.started))
        if timed_out:
            tails = "\n".join(f"--- host {r.host} (rc {r.returncode}) ---\n{r.stderr[-3000:]}"
                              for r in runs)
            raise TimeoutError(f"the command did not finish on every host within {timeout} s; "
                               f"all hosts were killed\n{tails}")
        return runs


class Hosts:
    """``n`` simulated hosts: network namespaces on one bridge, each with its own address.

    Args:
        n: how many hosts (2 to 250).
        rate: each link's rate, each way, as ``tc`` writes it (``"1gbit"``, ``"100mbit"``);
            ``None``: unshaped (veth speed).
        delay: one-way latency added on each link, each way (``"100us"``, ``"1ms"``); ``None``:
            none. Two hosts talk over two links, so a round trip adds four times ``delay``.
        subnet: the hosts' /24 (``10.213.0.0/24`` by default): host ``i`` gets ``.i+1``. It
            exists only inside the hosts' namespaces, so parallel instances may share it.
        workdir: where the commands' outputs go (default: a new temporary directory).

    Attributes:
        n: the number of hosts.
        netns: the namespace of each host (``fsdptk-<pid>-<k>-h<i>``), then the switch's is
            ``switch_netns``.
        addresses: the address of each host.

    Raises:
        HostsUnavailable: not root, no ``ip``/``tc``, or the kernel refuses a namespace, a veth
            or a ``netem`` qdisc (the message quotes the command and its error). Anything created
            before the failure is deleted again.

    Examples:
        >>> from fsdptk.testing.hosts import Hosts
        >>> with Hosts(2, rate="1gbit") as hosts:  # root; tests/test_hosts.py runs it  # doctest: +SKIP
        ...     runs = hosts.torchrun(["train.py"], nproc_per_node=2, timeout=300)
        ...     crossed = sum(r.link.tx_bytes for r in runs)  # bytes sent between hosts
    """

    def __init__(self, n: int, *, rate: str | None = None, delay: str | None = None,
                 subnet: str = "10.213.0.0/24", workdir: str | os.PathLike | None = None) -> None:
        if not 2 <= n <= 250:
            raise ValueError(f"n must be between 2 and 250 hosts, got {n}")
        why = hosts_unavailable(shaping=bool(rate or delay))
        if why:
            raise HostsUnavailable(why)
        net = ipaddress.ip_network(subnet)
        if net.prefixlen != 24 or not net.is_private:
            raise ValueError(f"subnet must be a private /24 (e.g. 10.213.0.0/24), got {subnet}")
        self.n, self.rate, self.delay = n, rate, delay
        self.prefixlen = net.prefixlen
        tag = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.switch_netns = f"{tag}-sw"
        self.netns = [f"{tag}-h{i}" for i in range(n)]
        self.addresses = [str(net.network_address + i + 1) for i in range(n)]
        if workdir is None:
            import tempfile

            workdir = tempfile.mkdtemp(prefix=f"{tag}-")
        self.workdir = Path(workdir)
        self._closed = False
        self._launch_count = itertools.count()
        self._children: list[subprocess.Popen] = []
        _remove_stale()
        self._finalizer = weakref.finalize(self, _teardown, [self.switch_netns, *self.netns])
        atexit.register(self._finalizer)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # building and tearing down ---------------------------------------------------------------
    def _build(self) -> None:
        sw = self.switch_netns
        _ip(["netns", "add", sw])
        _ip(["-n", sw, "link", "add", "br0", "type", "bridge"])
        _ip(["-n", sw, "link", "set", "br0", "up"])
        _ip(["-n", sw, "link", "set", "lo", "up"])
        for i, (ns, addr) in enumerate(zip(self.netns, self.addresses)):
            _ip(["netns", "add", ns])
            self._write_etc(ns)
            # both ends created directly in their namespaces: nothing appears in the caller's
            _ip(["-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", IFNAME,
                 "netns", ns])
            _ip(["-n", sw, "link", "set", f"p{i}", "master", "br0"])
            _ip(["-n", sw, "link", "set", f"p{i}", "up"])
            _ip(["-n", ns, "addr", "add", f"{addr}/{self.prefixlen}", "dev", IFNAME])
            _ip(["-n", ns, "link", "set", IFNAME, "up"])
            _ip(["-n", ns, "link", "set", "lo", "up"])
            if self.rate or self.delay:
                _tc(ns, IFNAME, self.rate, self.delay)  # host -> switch
                _tc(sw, f"p{i}", self.rate, self.delay)  # switch -> host
        self._wait_reachable()

    def _write_etc(self, netns: str) -> None:
        """Names of the hosts and no name server, inside ``netns`` (``ip netns exec`` mounts
        ``/etc/netns/<netns>/*`` over ``/etc``): torch's reverse lookups of peer addresses are
        answered from the file and no DNS query is ever attempted from a host."""
        etc = Path("/etc/netns") / netns
        etc.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{a} host{i}\n" for i, a in enumerate(self.addresses))
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        (etc / "resolv.conf").write_text("# no name server on simulated hosts\n")

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait until host 0 reaches every other host (the bridge's ports come up asynchronously)."""
        deadline = time.monotonic() + timeout
        for i in range(1, self.n):
            while True:
                res = subprocess.run(["ip", "netns", "exec", self.netns[0], "ping", "-c", "1",
                                      "-W", "1", self.addresses[i]], capture_output=True, check=False)
                if res.returncode == 0:
                    break
                if shutil.which("ping") is None:  # cannot check: give the bridge a moment
                    time.sleep(1.0)
                    break
                if time.monotonic() > deadline:
                    raise HostsUnavailable(f"host {i} ({self.addresses[i]}) is not reachable from "
                                           f"host 0 after {timeout} s")
                time.sleep(0.1)

    def close(self) -> None:
        """Kill what still runs on the hosts and delete every namespace (and so every link)."""
        if self._closed:
            return
        self._closed = True
        for proc in self._children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._finalizer()
        atexit.unregister(self._finalizer)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # running ---------------------------------------------------------------------------------
    def link_stats(self, host: int) -> LinkStats:
        """The counters of ``host``'s link now (read from outside; see :func:`link_stats`)."""
        return link_stats(IFNAME, self.netns[host])

    def exec(self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
             stdout=None, stderr=None, cwd: str | os.PathLike | None = None) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (``ip netns exec``); the caller waits for it.

        ``env`` is added to this process's environment. The process is killed by :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("these hosts are closed")
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns[host], *argv],
                                env={**os.environ, **(env or {})}, stdout=stdout, stderr=stderr,
                                cwd=cwd)
        self._children.append(proc)
        return proc

    def torchrun_argv(self, host: int, command: Sequence[str], *, nproc_per_node: int,
                      port: int = 29400, run_id: str = "fsdptk-hosts") -> list[str]:
        """The ``torchrun`` command line of ``host`` (``python -m torch.distributed.run``)."""
        return [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(self.n), "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.addresses[0]}:{port}",
                "--rdzv-id", run_id, "--rdzv-conf", f"is_host={'1' if host == 0 else '0'}",
                "--local-addr", self.addresses[host], "--max-restarts", "0", *command]

    def launch(self, command: Sequence[str], *, nproc_per_node: int,
               env: Mapping[str, str] | None = None, port: int = 29400) -> Launch:
        """Start ``torchrun ... command`` on every host and return at once (see :meth:`torchrun`)."""
        k = next(self._launch_count)
        run_id = f"{self.switch_netns}-{k}"
        env = {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONUNBUFFERED": "1", "FSDPTK_HOSTS": str(self.n), **(env or {})}
        before = [self.link_stats(i) for i in range(self.n)]
        procs, logs = [], []
        for host in range(self.n):
            out = self.workdir / f"launch{k}-host{host}.out"
            err = self.workdir / f"launch{k}-host{host}.err"
            with open(out, "wb") as fo, open(err, "wb") as fe:
                argv = self.torchrun_argv(host, command, nproc_per_node=nproc_per_node, port=port,
                                          run_id=run_id)
                procs.append(self.exec(host, argv, env={**env, "FSDPTK_HOST": str(host)},
                                       stdout=fo, stderr=fe))
            logs.append((out, err))
        return Launch(self, procs, before, logs)

    def torchrun(self, command: Sequence[str], *, nproc_per_node: int,
                 env: Mapping[str, str] | None = None, timeout: float | None = None,
                 port: int = 29400) -> list[HostRun]:
        """Run ``command`` under ``torchrun`` on every host; wait; say what each host's link moved.

        Each host runs ``python -m torch.distributed.run --nnodes N --nproc-per-node K
        --rdzv-backend c10d --rdzv-endpoint <host 0>:<port> ... command``: ``command`` is a
        script and its arguments (or ``["-m", "module", ...]``), as given to ``torchrun``. The
        environment adds ``GLOO_SOCKET_IFNAME=eth0`` (gloo talks over the host's link),
        ``OMP_NUM_THREADS=1``, ``CUDA_VISIBLE_DEVICES=""``, ``FSDPTK_HOST`` (the host index) and
        ``FSDPTK_HOSTS`` (N), then ``env``. torchrun numbers ranks host by host
        (``RANK = node_rank * K + LOCAL_RANK``), but which host gets node rank 0 is torchrun's
        choice: read ``RANK`` / ``GROUP_RANK`` in the script, not ``FSDPTK_HOST``.

        Args:
            command: what follows ``torchrun``'s own options.
            nproc_per_node: ranks per host (K).
            env: extra environment for every rank.
            timeout: seconds before every host is killed and :class:`TimeoutError` raised.
            port: the rendezvous port on host 0.

        Returns:
            list[HostRun]: one per host, in host order. A failed command is not an exception:
            check ``returncode``.
        """
        return self.launch(command, nproc_per_node=nproc_per_node, env=env,
                           port=port).wait(timeout)


def _teardown(names: list[str]) -> None:
    for name in names:
        _delete_netns(name)
