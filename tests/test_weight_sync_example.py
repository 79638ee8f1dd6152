"""examples/weight_sync.py runs as a user runs it (``python examples/weight_sync.py``): 2 trainer
ranks stream their weights into a separate inference process, in full at the first sync and as
patches of what changed after, and the inference process's logits equal the trainer's after every
sync (the example exits nonzero otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "weight_sync.py"


def test_the_example_streams_weights_and_the_inference_logits_match(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", "--sync-every", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    synced = [line for line in out.splitlines() if line.startswith("[inference] step ")]
    assert [line.split(":")[0] for line in synced] == ["[inference] step 0", "[inference] step 1",
                                                       "[inference] step 2"], out
    assert all("logits equal to the trainer's" in line for line in synced), out
    # the first sync sends every element whole, each later one patches: both sides count the same
    applied = [re.search(r"(loaded|patched) (\d+) tensors, (\d+) of (\d+) elements", line) for line in synced]
    sent = [re.search(r"\] step (\d+): sent (\d+) (tensors|patches), (\d+) of (\d+) elements", line)
            for line in out.splitlines() if line.startswith("[trainer] step ") and " sent " in line]
    assert all(applied) and all(sent) and len(sent) == 3, out
    assert [m.group(1) for m in applied] == ["loaded", "patched", "patched"], out
    assert [m.group(3) for m in sent] == ["tensors", "patches", "patches"], out
    for a, t in zip(applied, sent):
        assert (a.group(2), a.group(3), a.group(4)) == (t.group(2), t.group(4), t.group(5)), (a.group(0), t.group(0))
        assert 0 < int(a.group(3)) <= int(a.group(4)), a.group(0)
    assert applied[0].group(3) == applied[0].group(4), applied[0].group(0)  # the first sync: everything
    assert "[inference] 3 syncs, the logits equal after each" in out
    assert out.rstrip().endswith("[weight_sync] OK"), out
    assert not list(tmp_path.iterdir())  # no downloads, no files written
