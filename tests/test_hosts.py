"""Multi-host runs on simulated hosts (fsdptk.testing.hosts): 2 hosts x 2 ranks, 1 Gbit/s links.

One ``torchrun`` launch per host runs every scenario on both meshes in sequence
(``tests/hosts_worker.py``): FSDP over all 4 ranks and HSDP (replicate across the hosts, shard
within each). Each step is checked bit for bit against the single-process reference on every rank,
and the bytes that crossed between the hosts (the sum of both links' ``tx_bytes``, read by one rank
per host between barriers) are held against the least the mesh allows, plus an allowance measured
on this setup (see ``ALLOWANCE``). The same launch then runs the peers' calls (accelerate's FSDP2
load, gather and save; transformers' distributed ``from_pretrained`` and ``save_pretrained`` beside
``fsdptk.hf``) on small models, each step checked and held to the bytes its formula (read from the
peer's code) predicts. A second launch kills a host while the others load.

Needs root (network namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from fsdptk.testing.hosts import Hosts, HostsUnavailable, hosts_unavailable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "hosts_worker.py"
HOSTS, PER_HOST = 2, 2
LAYERS, DIM = 8, 1024  # 8 x Linear(1024, 1024) fp32: S = 33,587,200 bytes
S = LAYERS * (DIM * DIM + DIM) * 4
SCENARIOS = ["noop", "load", "shard_on_read", "gather", "save", "save_host", "stream_host", "optim_load",
             "optim_gather"]

# Bytes the mesh cannot avoid sending between hosts (H hosts, K ranks each, rank 0 holds or
# receives the full state): FSDP over H*K ranks: the shards of the other hosts' ranks,
# S * (H-1)/H; HSDP (replicate across hosts): every other host's replica needs all of S on a load,
# (H-1) * S, and a gather needs nothing (rank 0's host holds a whole replica). The optimizer moves
# AdamW's two state tensors per parameter (2 S; the 0-d ``step`` tensors are left out: 4 bytes each).
MINIMUM = {
    ("fsdp", "noop"): 0, ("fsdp", "load"): S * (HOSTS - 1) / HOSTS, ("fsdp", "shard_on_read"): 0,
    ("fsdp", "gather"): S * (HOSTS - 1) / HOSTS, ("fsdp", "save"): S * (HOSTS - 1) / HOSTS,
    ("fsdp", "save_host"): S * (HOSTS - 1) / HOSTS, ("fsdp", "stream_host"): S * (HOSTS - 1) / HOSTS,
    ("fsdp", "optim_load"): 2 * S * (HOSTS - 1) / HOSTS,
    ("fsdp", "optim_gather"): 2 * S * (HOSTS - 1) / HOSTS,
    ("hsdp", "noop"): 0, ("hsdp", "load"): S * (HOSTS - 1), ("hsdp", "shard_on_read"): 0,
    ("hsdp", "gather"): 0, ("hsdp", "save"): 0, ("hsdp", "save_host"): 0, ("hsdp", "stream_host"): 0, ("hsdp", "optim_load"): 2 * S * (HOSTS - 1),
    ("hsdp", "optim_gather"): 0,
}
# One writer per host (``save_host``): the same total as one writer, but spread over the links. With
# FSDP each host's writer writes about 1/H of the files and receives (H-1)/H of their bytes from
# the other hosts: S (H-1)/H^2 into every host, against S (H-1)/H into rank 0's host for one writer.
BUSIEST_RX = {("fsdp", "save"): S * (HOSTS - 1) / HOSTS, ("fsdp", "save_host"): S * (HOSTS - 1) / HOSTS**2,
              ("fsdp", "stream_host"): S * (HOSTS - 1) / HOSTS**2}
# Measured on this setup (1 Gbit/s tbf links, veth with TSO): Ethernet/IP/TCP headers and ACKs add
# 0.2-0.5 % to the data; fsdptk's metadata exchange and per-bucket status agreements 20-40 KB per
# call; the measuring barriers about 5 KB (the ``noop`` step). Allowed: 2 % of the minimum + 256 KiB.
ALLOWANCE_FRACTION, ALLOWANCE_BYTES = 0.02, 256 * 1024


def _skip_reason() -> str | None:
    return hosts_unavailable()


needs_hosts = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


@pytest.fixture(scope="module")
def hosts():
    with Hosts(HOSTS, rate="1gbit") as h:
        yield h


def _write_checkpoints(work: Path) -> str:
    """Each host's own copy of the safetensors directory (the single-process reference)."""
    sys.path.insert(0, str(HERE))
    from hosts_worker import reference_state
    from safetensors.torch import save_file

    ref = reference_state(LAYERS, DIM, torch.float32)
    for h in range(HOSTS):
        d = work / f"host{h}" / "ckpt"
        d.mkdir(parents=True)
        save_file(ref, d / "model.safetensors", metadata={"format": "pt"})
    return str(work / "host{host}" / "ckpt")


# A launch that outlives this is hung, not slow: on an idle 2-core machine each launch takes under
# a minute (41 s for the module), but beside another multi-process job it can take several times
# that, so the limit is generous (pytest-timeout's 600 s per test stays the outer bound).
_LAUNCH_TIMEOUT_S = float(os.environ.get("FSDPTK_HOSTS_TIMEOUT", "540"))


def _spec(work: Path, **kw) -> Path:
    out = work / "out"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"layers": LAYERS, "dim": DIM, "dtype": "float32", "meshes": ["fsdp", "hsdp"],
            "methods": ["fsdptk"], "scenarios": SCENARIOS, "repeats": 1, "ckpt": "", "out_dir": str(out),
            **kw}
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    return path


_PEERS_MISSING = [m for m in ("accelerate", "transformers") if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def launched(hosts, tmp_path_factory):
    """One launch on the hosts: fsdptk's scenarios on the Linear model, then (when accelerate and
    transformers are installed) the peers' on the small models. Returns each run's work directory
    (``None`` for the peers when they are not installed) and the HF model's bytes."""
    work = tmp_path_factory.mktemp("hosts")
    runs = [json.loads(_spec(work, ckpt=_write_checkpoints(work)).read_text())]
    peers, hf_bytes = None, 0
    if not _PEERS_MISSING:
        peers = work / "peers"
        peer_spec, hf_bytes = _peer_spec(peers)
        runs.append(peer_spec)
    spec = work / "launch.json"
    spec.write_text(json.dumps({"out_dir": str(work / "out"), "runs": runs}))
    done = hosts.torchrun([str(WORKER), str(spec)], nproc_per_node=PER_HOST,
                          env={**_env(), "HF_HUB_OFFLINE": "1"}, timeout=_LAUNCH_TIMEOUT_S)
    for r in done:
        assert r.returncode == 0, f"host {r.host} exited {r.returncode}:\n{r.stderr[-4000:]}"
    return {"fsdptk": work, "peers": peers, "hf_model_bytes": hf_bytes}


@pytest.fixture(scope="module")
def scenario_steps(launched):
    """{(mesh, scenario): {"crossed": bytes, "seconds": max over ranks, "checks": {...}}}."""
    work = launched["fsdptk"]
    steps: dict = defaultdict(lambda: {"crossed": 0, "busiest_rx": 0, "seconds": 0.0, "checks": set(), "ranks": 0})
    for f in sorted((work / "out").glob("rank*.json")):
        for rec in json.loads(f.read_text()):
            step = steps[(rec["mesh"], rec["scenario"])]
            step["seconds"] = max(step["seconds"], rec["seconds"])
            step["checks"].add(rec["check"])
            step["ranks"] += 1
            if rec["before"] is not None:  # local rank 0 of each host read its link
                step["crossed"] += rec["after"]["tx_bytes"] - rec["before"]["tx_bytes"]
                step["busiest_rx"] = max(step["busiest_rx"], rec["after"]["rx_bytes"] - rec["before"]["rx_bytes"])
    print("\n(mesh, scenario): bytes crossed (minimum), into the busiest host, seconds")
    for key, step in sorted(steps.items()):
        print(f"{key}: {step['crossed']:,} ({MINIMUM[key]:,.0f}), {step['busiest_rx']:,}, {step['seconds']:.3f} s")
    return dict(steps)


def _check_step(steps: dict, mesh: str, scenario: str) -> None:
    step = steps[(mesh, scenario)]
    assert step["ranks"] == HOSTS * PER_HOST
    assert step["checks"] == {"ok"}, f"{mesh} {scenario}: {step['checks']}"
    least = MINIMUM[(mesh, scenario)]
    most = least * (1 + ALLOWANCE_FRACTION) + ALLOWANCE_BYTES
    assert least <= step["crossed"] <= most, (
        f"{mesh} {scenario}: {step['crossed']:,} bytes crossed between the hosts; the mesh needs "
        f"{least:,.0f} and the allowance stops at {most:,.0f}")


MESHES = pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])


@needs_hosts
@MESHES
def test_rank0_load_sends_each_shard_across_once(scenario_steps, mesh):
    _check_step(scenario_steps, mesh, "load")


@needs_hosts
@MESHES
def test_shard_on_read_with_local_copies_sends_no_tensor_data(scenario_steps, mesh):
    _check_step(scenario_steps, mesh, "shard_on_read")


@needs_hosts
@MESHES
def test_gather_to_rank0(scenario_steps, mesh):
    _check_step(scenario_steps, mesh, "gather")


@needs_hosts
@MESHES
def test_save_safetensors(scenario_steps, mesh):
    _check_step(scenario_steps, mesh, "save")


@needs_hosts
@MESHES
def test_save_with_one_writer_per_host(scenario_steps, mesh):
    """``writers="host"``: the same bytes across hosts in total (none with HSDP: each host's writer
    gathers from its own replica), and with FSDP half as many into the busiest host's link."""
    _check_step(scenario_steps, mesh, "save_host")
    if mesh == "fsdp":
        for scenario in ("save", "save_host"):
            least = BUSIEST_RX[(mesh, scenario)]
            got = scenario_steps[(mesh, scenario)]["busiest_rx"]
            assert least <= got <= least * (1 + ALLOWANCE_FRACTION) + ALLOWANCE_BYTES, (scenario, got, least)


@needs_hosts
@MESHES
def test_weight_source_with_one_owner_per_host(scenario_steps, mesh):
    """``weight_source(owners="host")`` (issue 41): the first rank of each host owns about 1/H of
    the tensors and each is gathered to its owner only: the bytes of the save with one writer per
    host (none across hosts with HSDP; with FSDP 1/H^2 of the model into the busiest host)."""
    _check_step(scenario_steps, mesh, "stream_host")
    if mesh == "fsdp":
        least = BUSIEST_RX[(mesh, "stream_host")]
        got = scenario_steps[(mesh, "stream_host")]["busiest_rx"]
        assert least <= got <= least * (1 + ALLOWANCE_FRACTION) + ALLOWANCE_BYTES, (got, least)


@needs_hosts
@MESHES
def test_optimizer_state_load_and_gather(scenario_steps, mesh):
    _check_step(scenario_steps, mesh, "optim_load")
    _check_step(scenario_steps, mesh, "optim_gather")


@needs_hosts
def test_measurement_overhead_is_small(scenario_steps):
    """The barriers around a step (measured with nothing in between) stay far below the allowance."""
    for mesh in ("fsdp", "hsdp"):
        assert scenario_steps[(mesh, "noop")]["crossed"] < 32 * 1024


# ---------------------------------------------------------------------------------------------
# a host killed while the others load


@pytest.fixture(scope="module")
def killed_host(hosts, tmp_path_factory):
    """Load in a loop on 2 x 2 ranks; once every rank finished one load, kill the host that does
    not hold rank 0 (SIGKILL of all its processes). Returns the lost ranks, the kill time and what
    each surviving rank wrote (exception, message, time) within 15 s."""
    work = tmp_path_factory.mktemp("kill")
    spec = _spec(work, scenarios=["kill_load"], meshes=["fsdp"])
    out = work / "out"
    launch = hosts.launch([str(WORKER), str(spec)], nproc_per_node=PER_HOST, env=_env())
    try:
        deadline = time.time() + 120
        while len(list(out.glob("loading-rank*"))) < HOSTS * PER_HOST:
            codes = launch.poll()
            assert time.time() < deadline and all(c is None for c in codes), f"no load started: {codes}"
            time.sleep(0.05)
        host_of = {int(p.name.removeprefix("loading-rank")): int(p.read_text()) for p in out.glob("loading-rank*")}
        victim = next(h for h in range(HOSTS) if h != host_of[0])
        lost = sorted(r for r, h in host_of.items() if h == victim)
        survivors = sorted(r for r, h in host_of.items() if h != victim)
        time.sleep(0.2)
        killed_at = launch.kill_host(victim)
        wait_until = killed_at + 15
        while time.time() < wait_until and not all((out / f"rank{r}.json").exists() for r in survivors):
            time.sleep(0.05)
        raised = {r: json.loads((out / f"rank{r}.json").read_text()) for r in survivors
                  if (out / f"rank{r}.json").exists()}
    finally:
        launch.stop()  # the survivors' torchrun agents would wait minutes for the lost node
    report = {r: (round(x["raised_at"] - killed_at, 2), x["exc_type"], x["message"][:300]) for r, x in raised.items()}
    print(f"\nkilled host {victim} (ranks {lost}); survivors {survivors}: {report}")
    return {"lost": lost, "survivors": survivors, "raised": raised, "killed_at": killed_at}


@needs_hosts
def test_host_killed_during_load_receivers_raise_within_seconds(killed_host):
    """Every surviving rank other than rank 0 raises fsdptk's communication error within 10 s."""
    for r in killed_host["survivors"]:
        if r == 0:
            continue
        assert r in killed_host["raised"], f"rank {r} raised nothing within 15 s of the kill"
        rec = killed_host["raised"][r]
        assert rec["raised_at"] - killed_host["killed_at"] < 10
        assert rec["exc_type"] == "RuntimeError"
        assert f"communication with the other ranks failed on rank {r}" in rec["message"]


@needs_hosts
def test_host_killed_during_load_rank0_raises_within_seconds(killed_host):
    """Rank 0 raises too, though its send to the dead host may be half-written when the host dies
    (gloo then neither completes nor fails it: fsdptk stops waiting once another rank reports)."""
    assert 0 in killed_host["raised"], "rank 0 raised nothing within 15 s of the kill"
    rec = killed_host["raised"][0]
    assert rec["raised_at"] - killed_host["killed_at"] < 10
    assert rec["exc_type"] == "RuntimeError"
    assert "communication with the other ranks failed on rank 0" in rec["message"]


@needs_hosts
def test_host_killed_error_names_the_lost_rank(killed_host):
    """Every survivor's message names every lost rank (the roll call through the store)."""
    for rec in killed_host["raised"].values():
        for lost in killed_host["lost"]:
            assert f"rank {lost}" in rec["message"], rec["message"]
        assert "did not answer a roll call" in rec["message"], rec["message"]


# ---------------------------------------------------------------------------------------------
# the fixture itself


def _our_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(f"fsdptk-{os.getpid()}-")}


@needs_hosts
def test_teardown_after_an_error_leaves_nothing():
    before = _our_namespaces()
    with pytest.raises(KeyError), Hosts(2) as h:
        made = set(h.netns) | {h.switch_netns}
        assert made <= _our_namespaces()
        proc = h.exec(1, ["sleep", "60"])
        raise KeyError("boom")
    assert proc.poll() is not None  # killed
    assert _our_namespaces() == before
    assert not any((Path("/etc/netns") / n).exists() for n in made)


def test_clear_error_when_not_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in hosts_unavailable()
    with pytest.raises(HostsUnavailable, match="need root"):
        Hosts(2)


# ---------------------------------------------------------------------------------------------
# the peers: accelerate's FSDP2 functions on the Linear model; transformers' distributed
# from_pretrained and save_pretrained beside fsdptk.hf on a small HF Llama (benchmarks/hosts.py)

PEER_LAYERS, PEER_DIM = 4, 512  # S = 4 x (512 x 512 + 512) x 4 bytes = 4,202,496
PEER_S = PEER_LAYERS * (PEER_DIM * PEER_DIM + PEER_DIM) * 4
N = HOSTS * PER_HOST
# A step whose formula is 0 has moved up to 380 KB across the hosts here: both HF loads build
# their device meshes inside the call (17-82 KB), and now and then a step carries 250-330 KB more
# from a source not identified (docs/scale.md). On 2026-11-26 fsdptk-hf's shard-on-read step
# carried 1,103,724 and 1,104,768 bytes in two full-suite runs (one on each leg; 52-60 KB in every
# run of this test alone): about 1 MiB more, again from a source not identified. Allowed: 1.5 MiB,
# below the HF model's embedding alone (2.1 MB; S = 5 MB; rank 0 reading and sending the model
# would move S / 2 = 2.5 MB): a shard-on-read load that sent the model, or its embedding, across
# would still fail.
PEER_ZERO_ALLOWANCE = 3 * 512 * 1024


def _peer_formula(mesh: str, method: str, scenario: str, s: float, s_hf: float) -> float:
    """Bytes across hosts read from the peers' code (docs/scale.md): accelerate's load is a world
    broadcast ((N-K) S over gloo's tree) and then ``distribute_tensor`` from rank 0 (a scatter,
    S (H-1)/H, for FSDP; for HSDP a broadcast over dp_replicate, another (N-K) S); its gather and
    save, and transformers' save_pretrained, are DCP's ring all-gather (H (N-1)/N S for FSDP, 0 for
    HSDP); shard-on-read from each host's copy moves no tensor data."""
    if scenario in ("noop", "shard_on_read") or (mesh == "hsdp" and scenario in ("gather", "save")):
        return 0.0
    if method == "accelerate" and scenario == "load":
        return s * (N - PER_HOST) + (s * (HOSTS - 1) / HOSTS if mesh == "fsdp" else s * (N - PER_HOST))
    if method == "fsdptk-hf":
        return s_hf * (HOSTS - 1) / HOSTS
    return (s_hf if method == "transformers" else s) * HOSTS * (N - 1) / N


def _peer_spec(work: Path) -> tuple[dict, int]:
    """The peers' run (its checkpoints written under ``work``) and the HF model's bytes."""
    sys.path.insert(0, str(HERE))
    from hosts_worker import reference_state, write_hf_checkpoints
    from safetensors.torch import save_file

    ref = reference_state(PEER_LAYERS, PEER_DIM, torch.float32)
    for h in range(HOSTS):
        (work / f"host{h}" / "ckpt").mkdir(parents=True)
        save_file(ref, work / f"host{h}" / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    hf = write_hf_checkpoints(work, HOSTS, layers=1, dim=128)
    spec = _spec(work, layers=PEER_LAYERS, dim=PEER_DIM, ckpt=str(work / "host{host}" / "ckpt"),
                 methods=["accelerate", "transformers", "fsdptk-hf"], hf_ckpt=hf["hf_ckpt"], hf_ref=hf["hf_ref"],
                 scenarios=["noop", "load", "shard_on_read", "gather", "save"])
    return json.loads(spec.read_text()), hf["hf_model_bytes"]


@pytest.fixture(scope="module")
def peer_steps(launched):
    """{(mesh, method, scenario): step} of the peers' run in the launch, and the HF model's bytes."""
    work = launched["peers"]
    assert work is not None, f"not installed: {_PEERS_MISSING}"
    steps: dict = defaultdict(lambda: {"crossed": 0, "checks": set(), "ranks": 0})
    for f in sorted((work / "out").glob("rank*.json")):
        for rec in json.loads(f.read_text()):
            step = steps[(rec["mesh"], rec["method"], rec["scenario"])]
            step["checks"].add(rec["check"])
            step["ranks"] += 1
            if rec["before"] is not None:
                step["crossed"] += rec["after"]["tx_bytes"] - rec["before"]["tx_bytes"]
    print("\n(mesh, method, scenario): bytes crossed (formula)")
    for key, step in sorted(steps.items()):
        print(f"{key}: {step['crossed']:,} ({_peer_formula(*key, PEER_S, launched['hf_model_bytes']):,.0f})")
    return dict(steps), launched["hf_model_bytes"]


@needs_hosts
@pytest.mark.skipif(bool(_PEERS_MISSING), reason=f"not installed: {_PEERS_MISSING}")
def test_peers_match_the_reference_and_their_formulas(peer_steps):
    """accelerate (load, gather, save), transformers (distributed from_pretrained from each host's
    copy, save_pretrained) and fsdptk.hf run on both meshes: every step's check is ok (bit-exact;
    the HF loads' logits too) and its bytes across hosts are the formula's, within the allowance."""
    steps, s_hf = peer_steps
    expected = {("accelerate", sc) for sc in ("noop", "load", "gather", "save")}
    expected |= {(m, sc) for m in ("transformers", "fsdptk-hf") for sc in ("noop", "shard_on_read", "save")}
    for mesh in ("fsdp", "hsdp"):
        assert {(m, sc) for (me, m, sc) in steps if me == mesh} == expected
    for key, step in steps.items():
        assert step["ranks"] == N and step["checks"] == {"ok"}, (key, step["checks"])
        formula = _peer_formula(*key, PEER_S, s_hf)
        slack = formula * ALLOWANCE_FRACTION + ALLOWANCE_BYTES if formula else PEER_ZERO_ALLOWANCE
        assert formula - slack <= step["crossed"] <= formula + slack, (key, step["crossed"], formula)
