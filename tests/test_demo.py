"""``python -m estimatorch demo``: trains, crashes a second run, resumes it, and finds it
bit-identical; bad arguments are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run([sys.executable, "-m", "estimatorch", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", ["3", "13"])  # a crash right after a checkpoint, and between two
def test_demo_resumes_bit_identically(stop_at):
    proc = _run("demo", "--epochs", "2", "--stop-at", stop_at)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bit-identical to the uninterrupted run: True" in proc.stdout
    assert f"Crashed after batch {stop_at}" in proc.stdout
    val_accuracy = float(proc.stdout.split("val_accuracy: ")[-1].split()[0])
    assert val_accuracy > 0.5  # ten classes: it learned


def test_demo_refuses_bad_arguments():
    proc = _run("demo", "--stop-at", "0")
    assert proc.returncode == 2 and "--stop-at must be a positive int, got 0" in proc.stderr


def test_the_command_line_names_its_commands():
    assert _run().returncode == 2
    proc = _run("train")
    assert proc.returncode == 2 and "unknown command 'train'" in proc.stderr
    assert "demo" in _run("--help").stdout
