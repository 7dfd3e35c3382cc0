"""The example scripts run as a user runs them, briefly (a few dozen steps, a tiny model): char_lm.py in one
process, and under ``torchrun --nproc-per-node=2``; the rerun of the finished command resumes
and has nothing left to train. The Hugging Face ones: hf_pretrain_lm.py stopped by SIGTERM and
resumed by the same command (and under torchrun), hf_lora.py over its model, hf_classifier.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests import forked

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "char_lm.py")
TINY = ["--epochs", "2", "--batches-per-epoch", "12", "--val-batches", "2", "--d-model", "32", "--layers", "1",
        "--heads", "2", "--seq-len", "32", "--batch-size", "8", "--max-chars", "200000", "--sample", "20"]


def run(args, tmp_path, launcher=()):
    """``[*launcher, char_lm.py, ...]``; without a launcher ``python char_lm.py ...``, forked from
    tests/forked.py's server (a fresh process without a fresh interpreter's imports)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    if not launcher:
        return forked.run(SCRIPT, [*TINY, "--model-dir", tmp_path / "run", *args], env=env, cwd=str(tmp_path),
                          timeout=500)
    return subprocess.run([*launcher, SCRIPT, *TINY, "--model-dir", str(tmp_path / "run"), *args],
                          capture_output=True, text=True, env=env, timeout=500, cwd=tmp_path)


def planned(stdout):
    found = re.findall(r"process\(es\): (\d+) optimizer steps each", stdout)
    assert len(found) == 1, stdout  # printed once: the rank is known before fit
    return int(found[0])


def test_char_lm_in_one_process_and_its_rerun(tmp_path):
    proc = run([], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert planned(proc.stdout) == 24
    assert "Train finished" in proc.stdout and ": 2 epochs, 24 batches." in proc.stdout
    assert "Greedy sample:\ndef " in proc.stdout
    assert "UserWarning" not in proc.stderr  # the schedule fits the plan
    files = sorted(os.listdir(tmp_path / "run"))
    assert "model-best.pt" in files and "model-epoch2batch24.pt" in files and "history.csv" in files

    again = run([], tmp_path)  # the same command: the run is finished
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to resume" in again.stderr + again.stdout and "val_loss" in again.stdout.split("Train finished")[1]


@pytest.mark.distributed
def test_char_lm_under_torchrun_with_two_processes(tmp_path):
    proc = run([], tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"])
    # the script's work is done and printed before exit; a gloo process may still abort while the
    # interpreter tears down (torch 2.13), which torchrun reports as a failure: the output decides
    teardown = "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or teardown, proc.stderr[-3000:]
    assert planned(proc.stdout) == 24  # each process: its half of the data, 12 batches an epoch
    assert proc.stdout.count("Training begin") == 1 and "2 processes" in proc.stdout
    assert ": 2 epochs, 24 batches." in proc.stdout
    assert proc.stdout.count("Greedy sample:") == 1


# -- the Hugging Face examples (docs/transformers.md) ----------------------------------------------
HF_TINY = ["--epochs", "2", "--batches-per-epoch", "8", "--val-batches", "2", "--files", "6", "--vocab", "400",
           "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "8", "--buffer", "64"]


def run_example(name, args, tmp_path, launcher=None, **popen):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    command = [*(launcher or [sys.executable]), os.path.join(ROOT, "examples", name), *args]
    if popen:
        return subprocess.Popen(command, env=env, cwd=tmp_path, **popen)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=500, cwd=tmp_path)


def test_hf_pretrain_lm_stopped_by_sigterm_resumes_then_lora_adapts_it(tmp_path):
    import signal
    import time

    args = [*HF_TINY, "--model-dir", "run", "--checkpoint-every", "3", "--batches-per-epoch", "40"]  # time to stop
    proc = run_example("hf_pretrain_lm.py", args, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    while not list((tmp_path / "run").glob("model-epoch*batch*.pt")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]  # stopped at a step boundary, that step saved
    assert "SIGTERM" in err + out and "Train finished" not in out

    again = run_example("hf_pretrain_lm.py", args, tmp_path)  # the same command resumes
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from" in again.stderr + again.stdout and ": 2 epochs, 80 batches (" in again.stdout
    assert "val_perplexity" in again.stdout and "Greedy sample: 'def" in again.stdout
    assert "before its .shuffle()" not in err + again.stderr  # the tokenizing .map draws nothing: no warning
    assert os.path.exists(tmp_path / "run" / "final" / "config.json")

    lora = run_example("hf_lora.py", ["--base", "run/final", "--lines", "200", "--epochs", "1", "--model-dir", "lora"],
                       tmp_path)
    assert lora.returncode == 0, lora.stderr[-3000:]
    assert "(the adapter)" in lora.stdout and "same logits: True" in lora.stdout
    assert os.path.exists(tmp_path / "lora" / "adapter" / "adapter_model.safetensors")


def test_hf_classifier_fine_tunes_and_resumes_bitwise_after_sigterm(tmp_path):
    """DataCollatorWithPadding over a datasets.Dataset given with batch_size; the README's
    promise: SIGTERM, then the same command, gives the run that was never stopped (its tokenizer
    saved with the run: the rerun tokenizes with the same vocabulary)."""
    import shutil
    import signal
    import time

    import torch

    from estimatorch.checkpoint import load_weights

    args = ["--epochs", "3", "--lines", "60", "--batch-size", "8", "--vocab", "400", "--hidden", "32", "--layers", "1"]
    proc = run_example("hf_classifier.py", [*args, "--model-dir", "run"], tmp_path, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    while not list((tmp_path / "run").glob("model-epoch*batch*.pt")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # in epoch 2 of 3
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]  # stopped at a step boundary, that step saved
    assert "SIGTERM" in err + out and "Train finished" not in out
    shutil.copytree(tmp_path / "run" / "tokenizer", tmp_path / "never-stopped" / "tokenizer")
    reference = run_example("hf_classifier.py", [*args, "--model-dir", "never-stopped"], tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    again = run_example("hf_classifier.py", [*args, "--model-dir", "run"], tmp_path)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from" in again.stderr + again.stdout
    resumed, whole = load_weights(str(tmp_path / "run")), load_weights(str(tmp_path / "never-stopped"))
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert again.stdout.split("Validation:")[1] == reference.stdout.split("Validation:")[1]
    assert "val_accuracy" in again.stdout and "'import json'" in again.stdout and "Train finished" in again.stdout


@pytest.mark.distributed
def test_hf_pretrain_lm_under_torchrun_with_two_processes(tmp_path):
    proc = run_example("hf_pretrain_lm.py", [*HF_TINY, "--model-dir", "run"], tmp_path,
                       launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"])
    teardown = "terminate called without an active exception" in proc.stderr  # see the char_lm test
    assert proc.returncode == 0 or teardown, proc.stderr[-3000:]
    assert proc.stdout.count("Training begin") == 1 and "2 processes" in proc.stdout
    assert ": 2 epochs, 16 batches." in proc.stdout and proc.stdout.count("Greedy sample:") == 1


def test_weight_averaging_compares_the_trained_weights_with_their_average(tmp_path):
    """examples/weight_averaging.py, briefly: both runs train the same bits (the script checks),
    the table has a row per epoch, and the end compares the two weights on the same data."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = forked.run(os.path.join(ROOT, "examples", "weight_averaging.py"),
                      ["--epochs", "2", "--batches-per-epoch", "20", "--hidden", "32", "--max-chars", "50000",
                       "--decay", "0.9", "--val-windows", "500"], env=env, cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("EMAHandler(0.9, warmup=True):\n")[1].splitlines()
    assert table[0].startswith("epoch") and [row.split()[0] for row in table[1:3]] == ["1", "2"]
    assert "(val on the EMA weights)" in proc.stdout
    assert re.search(r"at the end: val_loss \d+\.\d+ \(trained weights\) -> \d+\.\d+ \(average\)", proc.stdout)
