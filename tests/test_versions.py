"""The supported range is the tested range (issue 21).

pyproject.toml declares a Python floor, classifiers and a floor for each dependency; CI runs two
legs (scripts/legs.env): the *pinned* leg on the floor Python with every dependency at its declared
floor (scripts/floors.txt, a pip constraints file), and the *newest* leg on the newest Python with
the newest torch release. These tests keep the three files in step, check that the leg running
them has what it claims, and that no standard-library API newer than the floor is used anywhere in
the package (vermin), so a declared-but-untested version cannot come back.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _legs() -> dict[str, str]:
    out = {}
    for line in (SCRIPTS / "legs.env").read_text().splitlines():
        m = re.fullmatch(r"([A-Z_]+)=(\S+)", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _floor_pins() -> dict[str, Version]:
    pins = {}
    for line in (SCRIPTS / "floors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"scripts/floors.txt: '{line}' is not an exact pin (name==version)"
            pins[name.strip().lower()] = Version(version.strip())
    return pins


def _declared_floors() -> dict[str, Version]:
    """``name -> floor`` of every requirement with a ``>=`` in dependencies and the test extra."""
    project = _pyproject()["project"]
    floors = {}
    for spec in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(spec)
        for s in req.specifier:
            assert s.operator in (">=", "==", "<", "!="), f"{spec}: use >= for a floor"
            if s.operator == ">=":
                floors[req.name.lower()] = Version(s.version)
    return floors


def _minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def test_declared_python_range_is_the_tested_range() -> None:
    legs, project = _legs(), _pyproject()["project"]
    assert project["requires-python"] == f">={legs['PINNED_PYTHON']}", (
        f"requires-python is {project['requires-python']!r} but the pinned leg runs Python "
        f"{legs['PINNED_PYTHON']} (scripts/legs.env): the floor must be the tested one")
    lo, hi = _minor(legs["PINNED_PYTHON"]), _minor(legs["NEWEST_PYTHON"])
    expected = {f"Programming Language :: Python :: 3.{m}" for m in range(lo[1], hi[1] + 1)}
    listed = {c for c in project["classifiers"] if re.fullmatch(r".*:: Python :: 3\.\d+", c)}
    assert listed == expected, f"classifiers {sorted(listed)} != the tested range {sorted(expected)}"
    assert lo <= sys.version_info[:2] <= hi, (sys.version, legs)


def test_every_declared_floor_is_what_the_pinned_leg_installs() -> None:
    floors, pins = _declared_floors(), _floor_pins()
    assert "torch" in floors, "pyproject.toml must give torch a floor"
    untested = {n: str(v) for n, v in floors.items() if pins.get(n) != v}
    assert not untested, (
        f"floors {untested} are declared but scripts/floors.txt pins "
        f"{ {n: str(pins.get(n)) for n in untested} }: the pinned leg must install each floor")
    stray = sorted(set(pins) - set(floors))
    assert not stray, f"scripts/floors.txt pins {stray}, which pyproject.toml gives no floor"


def _installed(name: str) -> Version:
    return Version(Version(md.version(name)).public)  # "2.13.0+cpu" -> 2.13.0


def test_this_leg_runs_what_it_claims() -> None:
    """scripts/test.sh names the leg (FSDPTK_LEG); the interpreter and the releases installed
    must be that leg's, or CI would be testing something other than what is declared."""
    leg = os.environ.get("FSDPTK_LEG")
    if leg is None:
        pytest.skip("not run through scripts/test.sh (FSDPTK_LEG unset): no leg to check")
    legs = _legs()
    if leg == "pinned":
        assert sys.version_info[:2] == _minor(legs["PINNED_PYTHON"]), sys.version
        wrong = {n: (str(v), str(_installed(n))) for n, v in _floor_pins().items()
                 if _installed(n) != v}
        assert not wrong, f"pinned leg: (floor, installed) differ for {wrong}"
    elif leg == "newest":
        assert sys.version_info[:2] == _minor(legs["NEWEST_PYTHON"]), sys.version
        assert _installed("torch") == Version(legs["NEWEST_TORCH"]), md.version("torch")
    else:
        pytest.fail(f"FSDPTK_LEG must be pinned or newest, got {leg!r}")


def _vermin(target: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", f"--target={target}-", "--violations", "--no-tips",
         str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


def test_no_standard_library_api_newer_than_the_declared_floor(tmp_path: Path) -> None:
    floor = _legs()["PINNED_PYTHON"]
    # the check can fail: a 3.12-only call is found
    probe = tmp_path / "probe.py"
    probe.write_text("import itertools\nbatches = itertools.batched([1, 2, 3], 2)\n")
    caught = _vermin(floor, probe)
    assert caught.returncode != 0 and "itertools.batched" in caught.stdout, caught.stdout
    found = _vermin(floor, ROOT / "fsdptk")
    assert found.returncode == 0, f"fsdptk uses APIs newer than Python {floor}:\n{found.stdout}"
