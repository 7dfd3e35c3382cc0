"""The scripts in ``benchmarks/`` still run against the library (tiny settings; no timing is
asserted, only that each produces its figures): they patch or mirror internals, and a benchmark
that rotted would be found only when someone needs its numbers."""

from __future__ import annotations

import json
import math
import os
import runpy
import sys

import pytest

from tests import forked

pytestmark = pytest.mark.slow

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _run(script: str, *args: str) -> str:
    """``python benchmarks/SCRIPT ARGS``'s stdout, forked from tests/forked.py's server (a fresh
    process without a fresh interpreter's imports; what the script starts itself starts fresh)."""
    done = forked.run(os.path.join(BENCHMARKS, script), args, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_overhead_reports_every_configuration_against_the_raw_loop():
    out = json.loads(_run("overhead.py", "--steps", "20", "--repeats", "1", "--samples", "320", "--json"))
    results = out["results"]
    assert list(results) == ["raw", "bare", "default", "default+tb+ckpt", "default+50noop"]
    assert results["raw"]["ratio"] == 1.0
    assert all(_positive(r["ratio"]) and _positive(r["us_per_step"]["median"]) for r in results.values())
    assert out["settings"]["steps"] == 20 and out["sync_warnings"] is None  # counted on CUDA only


def test_overhead_profile_ranks_the_librarys_own_functions():
    out = _run("overhead.py", "--profile", "default", "--steps", "20", "--samples", "320", "--top", "40")
    own = out.split("estimatorch's own functions by cumulative time")[1]
    assert "estimatorch/event_handlers/metric.py" in own and "(batch_end)" in own
    assert "(_loop)" not in own  # the loop itself would top a cumulative ranking and say nothing


def test_step_breakdown_times_each_piece_of_a_step():
    out = _run("step_breakdown.py", "--steps", "40", "--repeats", "1", "--samples", "320")
    assert "handler MetricHandler.batch_end" in out
    assert "sum of the pieces" in out


def test_resume_cost_measures_both_positions():
    out = json.loads(_run("resume_cost.py", "--samples", "32000032", "--repeats", "1", "--no-replay", "--json"))
    for figure in out["results"].values():
        assert _positive(figure["seconds_at_10"][0]) and _positive(figure["seconds_at_1000000"][0])
        assert _positive(figure["median_ratio"])


def test_sampler_scale_measures_both_orders_and_the_quality_figures():
    n = 100000
    out = json.loads(_run("sampler_scale.py", "--sizes", str(n), "--repeats", "1", "--json"))
    assert [r["permutation"] for r in out["results"]] == ["randperm", "feistel"]
    for figure in out["results"]:
        assert _positive(figure["first_batch_s"]["median"]) and _positive(figure["batch_1024_s"]["median"])
    randperm, feistel = out["results"]
    # randperm holds the epoch's whole order (n indices, 4 bytes each at the least); the keyed
    # bijection holds none of it: where the peak is exact (not an upper bound), it tells them apart
    if randperm["memory_exact"] and feistel["memory_exact"]:
        assert randperm["memory_bytes"] >= 4 * n > feistel["memory_bytes"]
    assert "correlation of consecutive indices" in _run("sampler_scale.py", "--quality")


def test_checkpoint_cost_compares_with_torch_save():
    out = json.loads(_run("checkpoint_cost.py", "--repeats", "1", "--json"))
    for size in out["results"].values():
        assert size["bytes"]["estimatorch"] >= size["bytes"]["raw"] > 0
        assert all(_positive(v[0]) for v in size["seconds"].values())


@pytest.fixture(scope="module")
def stall() -> dict:
    """One ``checkpoint_cost.py --stall --small`` run for the tests of its figures."""
    return json.loads(_run("checkpoint_cost.py", "--stall", "--small", "--json"))


def test_checkpoint_cost_measures_the_stall_of_a_save_synchronous_and_async(stall):
    out = stall
    steps, period = out["settings"]["steps"], out["settings"]["batch_period"]
    assert (steps, period) == (12, 4)  # steps 2 and 3 come before any save: clean steps to measure against
    assert out["settings"]["device"] == "cpu"
    assert list(out["results"]) == ["sync", "thread", "process"] == out["settings"]["modes"]
    for mode, figures in out["results"].items():
        assert figures["saves"] == steps // period == len(figures["until_durable_s"]), mode
        assert len(figures["step_with_save_s"]) == (steps - 1) // period  # the last save ends the fit
        assert all(_positive(v) for key in ("memcpy_floor_s", "save_call_s", "until_durable_s")
                   for v in figures[key]), mode
        assert figures["peak_rss_bytes"] > 0
    assert out["results"]["sync"]["staging_bytes"] == 0 and out["results"]["sync"]["waits"] == 0
    for mode in ("thread", "process"):
        assert out["results"][mode]["staging_bytes"] >= out["results"][mode]["state_bytes"] > 0


def test_checkpoint_cost_totals_a_save_as_its_stall_plus_the_extra_of_the_steps_during_its_write(stall):
    out = stall
    steps, period = out["settings"]["steps"], out["settings"]["batch_period"]
    for mode, figures in out["results"].items():
        in_flight, clean = figures["step_in_flight_s"], figures["step_clean_s"]
        # every timed step (all but the last) counted once: the first, a save's, during a write, or clean
        assert 1 + len(figures["step_with_save_s"]) + len(in_flight) + len(clean) == steps - 1, mode
        assert len(clean) >= period - 2  # the steps between the first and the first save
        costs = figures["save_costs"]
        assert [c["step"] for c in costs] == sorted(c["step"] for c in costs)
        assert all(c["step"] % period == 0 and c["step"] < steps for c in costs), mode
        assert sum(c["following_steps"] for c in costs) <= len(in_flight), mode
        for c in costs:
            assert c["total_s"] == c["stall_s"] + c["following_s"], mode
    sync = out["results"]["sync"]
    # synchronously the write is done when the save returns: no step runs during it, the total is the stall
    assert sync["step_in_flight_s"] == [] and len(sync["save_costs"]) == (steps - 1) // period
    assert all(c["following_steps"] == 0 and c["total_s"] == c["stall_s"] for c in sync["save_costs"])
    for mode in ("thread", "process"):  # a write may end after the last step
        assert len(out["results"][mode]["save_costs"]) <= (steps - 1) // period


@pytest.mark.parametrize("args, message", [
    (["--batch-period", "0"], "--batch-period must be a positive int, got 0"),
    (["--device", "bogus"], "--device must name a torch device, got 'bogus'"),
    (["--modes", "sync,async"], "--modes must name distinct modes of sync, thread, process, got 'sync,async'"),
])
def test_checkpoint_cost_refuses_bad_stall_settings_before_any_work(args, message):
    done = forked.run(os.path.join(BENCHMARKS, "checkpoint_cost.py"), ["--stall", *args], timeout=60)
    assert done.returncode == 2 and message in done.stderr


def test_gpu_resnet_compares_fit_with_a_hand_written_loop():
    """On the CPU with tiny settings: only that it runs and reports; the figures need a GPU."""
    out = json.loads(_run("gpu_resnet.py", "--device", "cpu", "--steps", "2", "--repeats", "1", "--batch-size", "4",
                          "--batches", "2", "--data", "loader", "--workers", "0", "--json"))
    assert list(out["ratio_median"]) == ["raw", "fit-default", "fit-default+bar"]
    assert out["ratio_median"]["raw"] == 1.0 and all(_positive(v) for v in out["ms_per_step"].values())
    assert out["syncs_in_one_epoch_of_fit_default"] is None  # counted on CUDA only


def test_gpu_resnet_runs_the_mlp_with_adamw_and_refuses_cuda_graphs_without_what_they_need(capsys):
    out = json.loads(_run("gpu_resnet.py", "--device", "cpu", "--steps", "2", "--repeats", "1", "--batch-size", "4",
                          "--batches", "2", "--model", "mlp", "--optimizer", "adamw", "--precision", "32", "--json"))
    assert list(out["ratio_median"]) == ["raw", "fit-default", "fit-default+bar"]
    assert out["settings"]["model"] == "mlp" and out["settings"]["optimizer"] == "adamw"
    sys.path.insert(0, BENCHMARKS)  # the script imports its _common helper from there
    try:
        script = runpy.run_path(os.path.join(BENCHMARKS, "gpu_resnet.py"), run_name="gpu_resnet")
    finally:
        sys.path.remove(BENCHMARKS)
    for args, message in ((["--cuda-graphs"], "--cuda-graphs needs --optimizer adamw"),
                          (["--cuda-graphs", "--optimizer", "adamw", "--device", "cpu"],
                           "--cuda-graphs needs --device cuda, got --device cpu")):
        with pytest.raises(SystemExit) as stopped:  # argparse's error: before any work
            script["main"](args)
        assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_checkpoint_compares_memory_and_checkpoint_time_with_ddp():
    out = json.loads(_run("sharded_checkpoint.py", "--small", "--repeats", "1", "--json"))
    ddp, fsdp = out["ddp"], out["fsdp"]
    assert len(ddp["held_bytes_per_rank"]) == len(fsdp["held_bytes_per_rank"]) == 2
    # Adam: parameters and two moments, 4 bytes each; under FSDP2 each rank holds half (256 rows split evenly)
    assert ddp["held_bytes_per_rank"] == [3 * 4 * out["parameters"]] * 2
    assert fsdp["held_bytes_per_rank"] == [3 * 4 * out["parameters"] // 2] * 2
    assert all(ddp[k] > 0 and fsdp[k] > 0 for k in ("save_s", "load_s", "size_bytes"))
    assert 0 < fsdp["async_stall_s"] <= fsdp["async_durable_s"]


def test_data_positioning_times_every_library_at_both_positions():
    out = _run("data_positioning.py", "--samples", "2000", "--batch-size", "100", "--repeats", "1")
    lines = out.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("(states captured"))
    rows = {line[:42].strip(): line[42:].split() for line in lines[2:end]}
    assert list(rows) == ["torchdata map (fit)", "torchdata map (its own load_state_dict)", "hf map",
                          "hf iterable (its state)", "streaming"]
    # seconds printed to the millisecond: a fast positioning (torchdata's own, 2000 samples) may read 0.000
    assert all(len(v) == 3 and all(math.isfinite(float(x)) and float(x) >= 0 for x in v[:2]) for v in rows.values())
    # the shuffle buffer's own table: the time to the first batch resumed at each position, its state's size
    assert ".shuffle(buffer_size=" in lines[end + 1] and lines[end + 2].split()[:3] == ["resume", "at", "batch"]
    buffer = [line.split() for line in lines[end + 3:] if line.strip()]
    assert [int(row[0]) for row in buffer] == [0, 5, 10, 15]
    assert all(len(row) == 5 and float(row[1]) >= 0 and int(row[3]) > 0 for row in buffer), buffer


def test_the_gpu_check_script_runs_benchmarks_and_tests_with_options_they_accept(monkeypatch):
    """benchmarks/gpu_check.sh (the one prepared run for a lent GPU): every part it would run is
    a command whose arguments its script's own parser accepts (parsed here, nothing run)."""
    import argparse
    import shlex
    import subprocess

    script = os.path.join(BENCHMARKS, "gpu_check.sh")
    listed = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, check=True).stdout
    parts = [line.split("|", 2) for line in listed.splitlines()]
    assert [name for name, _, _ in parts] == ["tests", "mlp", "resnet", "loader", "save"]
    assert sum(int(limit) for _, limit, _ in parts) <= 2 * 600  # two calls of a lent machine's limit
    bad = subprocess.run(["bash", script, "--dry-run", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr

    class Parsed(Exception):
        pass

    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        real(self, args, namespace)  # an option it does not know exits with status 2 here
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.syspath_prepend(BENCHMARKS)  # the scripts import their _common helper from there
    for name, _, command in parts:
        words = shlex.split(command)
        if name == "tests":
            assert words[1:4] == ["-m", "pytest", "-m"] and words[4] == "cuda" and words[-1] == "tests"
            continue
        module = runpy.run_path(os.path.join(BENCHMARKS, os.path.basename(words[1])), run_name="gpu_check")
        with pytest.raises(Parsed):
            module["main"](words[2:])


def test_tokenized_data_reports_every_path_against_the_plain_collate():
    out = json.loads(_run("tokenized_data.py", "--rows", "256", "--repeats", "1", "--json"))
    results = out["results"]
    assert len(results) == 6 and next(iter(results.values()))["ratio"] == 1.0
    assert any("ArrowCollate" in name for name in results)
    assert all(_positive(r["ratio"]) and _positive(r["us_per_row"]["median"]) for r in results.values())


def test_vs_trainer_reports_steps_data_and_both_kills_for_each_framework():
    done = forked.run(os.path.join(BENCHMARKS, "vs_trainer.py"),
                      ["--steps", "6", "--save-every", "2", "--stop-at", "3", "--buffers", "0",
                       "--frameworks", "estimatorch,trainer", "--rounds", "1", "--json"], timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)["results"]
    assert sorted(results) == ["estimatorch, buffer 0", "trainer, buffer 0"]
    ours = results["estimatorch, buffer 0"]
    assert _positive(ours["step_ms"]) and _positive(ours["data_ms"]) and _positive(ours["step_ratio_to_loop"])
    low, high = ours["ratio_range"]  # a ratio to the loop per round (one round here: the suite's time)
    assert ours["rounds"] == 1 and low == ours["step_ratio_to_loop"] == high
    assert ours["sigterm"]["exit"] == 143 and ours["sigterm"]["steps_redone"] == 0  # the stopped step was saved
    assert ours["sigterm"]["bitwise"] and ours["sigkill"]["bitwise"] and ours["sigkill"]["exit"] == -9
    assert results["trainer, buffer 0"]["sigterm"]["exit"] == -15  # Trainer's default: killed, nothing saved
