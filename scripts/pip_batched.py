"""Install requirements with pip in batches of bounded download size (the CUDA-build legs).

pip keeps every wheel one command downloads in its temporary directory until that command ends,
so installing a CUDA build of torch (about 3 GB of wheels unpacking to 5.5 GB) or vLLM (4 GB of
wheels unpacking to 9.5 GB) in one command needs the unpacked environment plus all its wheels on
disk at once. This resolves once (``pip install --dry-run --report``: the exact set pip would
install), asks the index for each wheel's size (a HEAD request; a wheel whose size it cannot learn
gets a batch of its own), installs the set in batches of at most ``--max-mb`` of wheels without
their dependencies (every batch constrained to the resolved versions), and ends with the
requirements themselves, which then find everything they need installed. The peak is the unpacked
environment plus one batch. An interrupted install is picked up where it stopped: packages
already installed are skipped, and the requirements are installed last.

Run it with the target environment's Python; extra pip options go after ``--``::

    .venv-vllm/bin/python scripts/pip_batched.py vllm==0.33.0
    .venv-newest/bin/python scripts/pip_batched.py torch==2.15.0
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# this project's machines list local wheel directories that do not hold every package; pip warns
# once per package, a few hundred lines that say nothing about the install
_NOISE = "WARNING: Location '"


@dataclass(frozen=True)
class Wheel:
    """One package of the resolved set."""

    name: str
    version: str
    url: str
    size: int | None  # bytes; None when the index did not say


def _size(url: str, tries: int = 4) -> int | None:
    # http(s) from the index, file:// from a local wheel directory: urllib answers both
    for k in range(tries):
        try:
            req = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(req, timeout=30) as r:
                length = r.headers.get("Content-Length")
                return int(length) if length else None
        except (OSError, ValueError):
            time.sleep(0.5 * 2**k)
    return None


def batches(wheels: list[Wheel], max_bytes: int) -> list[list[Wheel]]:
    """Greedy first-fit, largest first; a wheel of unknown size or over the bound goes alone."""
    out: list[list[Wheel]] = []
    room: list[int] = []
    for w in sorted(wheels, key=lambda w: -(w.size if w.size is not None else max_bytes + 1)):
        if w.size is None or w.size >= max_bytes:
            out.append([w])
            room.append(0)
            continue
        for i, left in enumerate(room):
            if w.size <= left:
                out[i].append(w)
                room[i] -= w.size
                break
        else:
            out.append([w])
            room.append(max_bytes - w.size)
    return out


def _pip(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], stderr=subprocess.PIPE, text=True, check=False)
    err = "".join(line for line in proc.stderr.splitlines(True) if not line.startswith(_NOISE))
    sys.stderr.write(err)
    if proc.returncode:
        raise SystemExit(f"[pip-batched] pip {' '.join(args)} failed (exit {proc.returncode})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requirements", nargs="+")
    ap.add_argument("--max-mb", type=int, default=512, help="wheels downloaded by one pip command")
    ap.add_argument("--tag", default="pip-batched", help="the prefix of this script's messages")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        report_path, pins = Path(tmp) / "report.json", Path(tmp) / "pins.txt"
        print(f"[{args.tag}] resolving {' '.join(args.requirements)}", flush=True)
        _pip(
            [
                "install",
                "-q",
                "--no-cache-dir",
                "--dry-run",
                "--ignore-installed",
                "--report",
                str(report_path),
                *extra,
                *args.requirements,
            ]
        )
        report = json.loads(report_path.read_text())
        items = [
            (i["metadata"]["name"], i["metadata"]["version"], i["download_info"]["url"]) for i in report["install"]
        ]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            sizes = list(ex.map(_size, [url for _, _, url in items]))
        wheels = [Wheel(n, v, u, s) for (n, v, u), s in zip(items, sizes, strict=True)]
        pins.write_text("".join(f"{w.name}=={w.version}\n" for w in wheels))
        wanted = {r.split("==")[0].split("[")[0].strip().lower().replace("_", "-") for r in args.requirements}
        todo = [w for w in wheels if w.name.lower().replace("_", "-") not in wanted]
        plan = batches(todo, args.max_mb << 20)
        known = sum(w.size for w in wheels if w.size is not None)
        print(
            f"[{args.tag}] {len(wheels)} packages, {known >> 20} MB of wheels"
            f" ({sum(w.size is None for w in wheels)} of unknown size), in {len(plan) + 1} pip"
            f" commands of at most {args.max_mb} MB each",
            flush=True,
        )
        for batch in plan:
            _pip(
                [
                    "install",
                    "-q",
                    "--no-cache-dir",
                    "--no-deps",
                    "-c",
                    str(pins),
                    *extra,
                    *(f"{w.name}=={w.version}" for w in batch),
                ]
            )
        _pip(["install", "-q", "--no-cache-dir", "-c", str(pins), *extra, *args.requirements])


if __name__ == "__main__":
    main()
