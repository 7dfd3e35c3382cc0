"""benchmarks/ddp_overhead.py still runs and reports its figures (tiny settings; no timing is
asserted). Beside tests/test_benchmarks.py, which covers the single-process scripts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "ddp_overhead.py")


def test_ddp_overhead_reports_fit_against_the_same_job_first_then_a_loop_computing_nothing():
    # 1280 samples: 20 batches of 32 per rank and epoch, so 30 steps are one epoch and a partial one
    done = subprocess.run([sys.executable, SCRIPT, "--steps", "30", "--repeats", "2", "--samples", "1280", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert list(out["us_per_step"]) == ["raw+metrics", "raw", "fit", "fit-every-step", "fit-unagreed"]
    assert all(math.isfinite(s["median"]) and s["median"] > 0 for s in out["us_per_step"].values())
    assert list(out["against"]) == ["raw+metrics", "raw"]  # the same job first
    assert out["ratio"] == out["against"]["raw+metrics"]["ratio"]
    for against in out["against"].values():
        assert len(against["paired"]) == 2 and math.isfinite(against["ratio"]) and against["ratio"] > 0
        assert math.isfinite(against["added_us_per_step"])
    # the same-job loop reads its running loss and accuracy at each epoch's end, the partial last one's too,
    # on both ranks in every timed round (a loop that never read them would do less than fit)
    assert out["metric_reads_per_run"] == [[2, 2], [2, 2]]
    assert math.isfinite(out["every_step_minus_fit_us_per_step"])
    assert out["settings"]["steps"] == 30 and out["machine"]["torch_threads"] == 1
    assert out["calibration"] is None


def test_ddp_overhead_calibrates_what_a_microsecond_of_cpu_per_step_costs_and_times_world_size_invariant():
    done = subprocess.run([sys.executable, SCRIPT, "--steps", "20", "--repeats", "2", "--samples", "1280",
                           "--no-ab", "--calibrate", "20000", "--invariant", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert list(out["us_per_step"]) == ["raw+metrics", "raw", "fit", "raw+cpu", "fit-elastic", "fit-invariant"]
    inv = out["invariant"]
    assert all(math.isfinite(inv[key]["ratio"]) for key in ("against_fit", "against_elastic", "elastic_against_fit"))
    params = 32 * 64 + 64 + 64 * 10 + 10  # the benchmark MLP: one all_to_all and one all_gather of half of it
    assert inv["gradient_floats"] == params and inv["ring_bytes_per_step"] == params * 4
    assert inv["bytes_per_step"] == 2 * (-(-params // 2)) * 4
    cal = out["calibration"]
    assert cal["cpu_us_per_step"] == 20000 and math.isfinite(cal["added_us_per_step"])
    assert cal["wall_per_cpu"] == cal["added_us_per_step"] / 20000
    # not a speed claim: each step spins until perf_counter has moved 20 ms, so no step of
    # raw+cpu can take less; a step of this MLP alone takes a few ms (fails without the spin)
    assert out["us_per_step"]["raw+cpu"]["min"] >= 20000


def test_ddp_overhead_refuses_a_negative_calibration():
    done = subprocess.run([sys.executable, SCRIPT, "--calibrate", "-1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--calibrate must be a non-negative number of µs, got -1.0" in done.stderr


def test_replica_check_reports_a_checks_cost_against_a_step_and_its_collectives():
    script = os.path.join(os.path.dirname(SCRIPT), "replica_check.py")
    done = subprocess.run([sys.executable, script, "--steps", "20", "--repeats", "1", "--samples", "1280", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert list(out["us_per_step"]) == ["off", "every-50", "every-1"]
    assert all(math.isfinite(us) and us > 0 for us in out["us_per_step"].values())
    assert out["all_gathers_per_check"] == 1  # every check: one all_gather (20 with every-1, none with every-50)
    assert math.isfinite(out["us_per_check"]) and out["check_over_step"] > 0
    assert sorted(out["overhead"]) == ["every-1", "every-50"]
