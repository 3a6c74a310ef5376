"""examples/train_gpt2.py, the README's Python example, trains: it runs to the end with the
tiny config and its loss falls."""

import csv
import os
import subprocess
import sys

import harness


def test_example_trains_and_loss_falls(tmp_path):
    losses = tmp_path / "loss.csv"
    run = subprocess.run(
        [sys.executable, os.path.join(harness.ROOT, "examples", "train_gpt2.py"), "--steps", "15",
         "--log-every", "5", "--loss-csv", str(losses), "--save", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "train_gpt2: 15 steps" in run.stdout
    with open(losses, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 16))
    first = sum(float(r["loss"]) for r in rows[:3]) / 3
    last = sum(float(r["loss"]) for r in rows[-3:]) / 3
    assert last < first - 0.3, (first, last)
    assert os.path.exists(tmp_path / "ckpt" / "latest")
