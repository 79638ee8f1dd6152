"""examples/weight_sync.py runs as a user runs it (``python examples/weight_sync.py``): 2 trainer
ranks stream their weights into a separate inference process, whose logits equal the trainer's after
every sync (the example exits nonzero otherwise)."""

from __future__ import annotations

import os
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
    assert "[inference] 3 syncs, the logits equal after each" in out
    assert out.rstrip().endswith("[weight_sync] OK"), out
    assert not list(tmp_path.iterdir())  # no downloads, no files written
