"""loadtests/bench_gpu.py's own plumbing (its stages run on a GPU; DRY=1 checks them on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_device_fault_sends_the_stages_left_to_a_fresh_process(tmp_path: Path) -> None:
    # A sticky CUDA fault breaks every later call in the process: after a stage, a device that
    # no longer answers makes bench_gpu run the stages left in a new process (os.execv).
    script = ("import loadtests.bench_gpu as b\n"
              "b.device_usable = lambda: False\n"  # this process only: the new one is healthy
              f"b.main(['env', 'env', 'env', '--out', {str(tmp_path)!r}])\n")
    env = dict(os.environ, DRY="1", MODELS_DIR=str(tmp_path / "models"))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["rerun_in_new_process"] for r in rows if r.get("device_fault")] == [["env", "env"]]
    assert sum(1 for r in rows if r.get("done")) == 3
    assert sum("copy_tb_s" in r for r in rows) == 3  # every stage ran, one of them in the new process
