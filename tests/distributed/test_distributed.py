"""Two gloo processes on this machine: DDP keeps ranks in step, metrics reduce across ranks, a stop
decided on one rank stops all, data is sharded, and a 2-rank run resumes bit-identically."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, EarlyStoppingHandler, Estimator, GradientUpdateHandler, distributed
from estimatorch.event_handlers import BatchEnd

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# -- spawn ------------------------------------------------------------------------------------
def _rank_and_sum(offset):
    import torch.distributed as dist

    total = torch.tensor([distributed.get_rank() + 1.0])
    dist.all_reduce(total)
    return {"rank": distributed.get_rank(), "world": distributed.get_world_size(), "sum": total, "offset": offset}


def test_spawn_returns_every_ranks_result_in_rank_order(fresh_interpreter_ranks):
    results = distributed.spawn(_rank_and_sum, 2, 7, backend="gloo")
    assert [r["rank"] for r in results] == [0, 1] and [r["world"] for r in results] == [2, 2]
    assert all(torch.equal(r["sum"], torch.tensor([3.0])) and r["offset"] == 7 for r in results)


def _raise_on_rank_1(in_collective):
    import torch.distributed as dist

    if distributed.get_rank() == 1:
        raise ValueError("rank one refuses")
    if in_collective:  # waits for a peer that is gone: must not hang the caller
        dist.all_reduce(torch.zeros(1))
    return "done"


@pytest.mark.parametrize("in_collective", [False, True])
def test_spawn_raises_the_failing_ranks_exception_naming_the_rank(in_collective, fresh_interpreter_ranks):
    with pytest.raises(distributed.RankFailedError, match="rank 1 of 2 raised ValueError: rank one refuses") as info:
        distributed.spawn(_raise_on_rank_1, 2, in_collective, backend="gloo")
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError) and info.value.exception is info.value.__cause__
    assert "_raise_on_rank_1" in info.value.remote_traceback  # the traceback from that process


def _exit_without_result():
    if distributed.get_rank() == 1:
        os._exit(3)
    return "done"


def test_spawn_reports_a_rank_that_died_without_a_result(fresh_interpreter_ranks):
    with pytest.raises(distributed.RankFailedError, match=r"rank 1 of 2 ended before returning a result \(exit code 3\)"):
        distributed.spawn(_exit_without_result, 2, backend="gloo")


def _abort_after_delivering():
    import signal
    import threading
    import time

    if distributed.get_rank() == 0:  # dies while it waits for rank 1, its result already sent
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGABRT)).start()
    else:
        time.sleep(2.0)
    return distributed.get_rank() * 10


def test_spawn_keeps_a_result_delivered_before_the_process_aborted(fresh_interpreter_ranks):
    """The torch 2.13 gloo teardown abort, simulated: the result survives, with a warning."""
    with pytest.warns(RuntimeWarning, match=r"rank 0 delivered its result, then its process ended \(killed by signal SIGABRT\)"):
        assert distributed.spawn(_abort_after_delivering, 2, backend="gloo") == [0, 10]


def _environment(name):
    return os.environ.get(name), os.getcwd()


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_the_ranks_see_the_callers_environment_and_working_directory(start, monkeypatch, tmp_path):
    """The suite's forkserver (tests/conftest.py) started before this test set the variable: its
    children take the caller's environment from the request, as spawned ones inherit it."""
    from estimatorch.distributed import _spawn

    distributed.spawn(_environment, 1, "ESTIMATORCH_TEST_MARK", backend="gloo")  # the server is up
    monkeypatch.setattr(_spawn, "_START_METHOD", start)
    monkeypatch.setenv("ESTIMATORCH_TEST_MARK", "set by the test")
    monkeypatch.chdir(tmp_path)
    assert distributed.spawn(_environment, 2, "ESTIMATORCH_TEST_MARK", backend="gloo") == \
        [("set by the test", str(tmp_path))] * 2


def test_the_error_of_a_rank_that_raised_also_names_a_rank_killed_before_it():
    """Rank 0 SIGKILLed, then rank 1's collective lost its peer: rank 1's error is raised (a
    raised error is preferred), and the message names rank 0's death whichever came first."""
    from types import SimpleNamespace

    from estimatorch.distributed._spawn import _raise_rank_failure

    error = RuntimeError("Connection closed by peer")
    died, raised = (0, ("died", "killed by signal SIGKILL")), (1, ("error", error, "RuntimeError", str(error), "tb"))
    procs = [SimpleNamespace(exitcode=-9), SimpleNamespace(exitcode=1)]
    for failures in ([died, raised], [raised, died]):
        with pytest.raises(distributed.RankFailedError) as info:
            _raise_rank_failure(failures, [], procs)
        assert info.value.rank == 1 and str(info.value).startswith("rank 1 of 2 raised RuntimeError")
        assert str(info.value).endswith("(also: rank 0: killed by signal SIGKILL)"), str(info.value)


def test_spawn_checks_its_arguments_before_starting_anything():
    with pytest.raises(ValueError, match="nprocs must be a positive int, got 0"):
        distributed.spawn(_rank_and_sum, 0)
    with pytest.raises(ValueError, match="backend must be .*got 'tcp'"):
        distributed.spawn(_rank_and_sum, 2, backend="tcp")


# -- training on two ranks ----------------------------------------------------------------------
class Record(BatchEnd):
    priority = float("inf")

    def __init__(self):
        self.losses, self.labels = [], []

    def batch_end(self, est, *, loss, label, **kw):
        self.losses.append(float(loss.detach()).hex())
        self.labels.extend(label.tolist())


class StopOnRank(BatchEnd):
    """Asks to stop at ``step`` on ``rank`` only."""

    def __init__(self, rank, step):
        self.rank, self.step, self.seen = rank, step, 0

    def batch_end(self, est, **kw):
        self.seen += 1
        return distributed.get_rank() == self.rank and self.seen == self.step


def _setup():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), seed=11)
    g = torch.Generator().manual_seed(5)
    # 43 samples: the label is the sample's index, so each rank's share can be checked.
    dataset = torch.utils.data.TensorDataset(torch.randn(43, 4, generator=g), torch.arange(43) % 3,
                                             torch.arange(43))
    loader = torch.utils.data.DataLoader(dataset, batch_size=5, shuffle=True)
    return est, loader


class Processor:
    """Batches are (x, y, index): train on (x, y), report the index as the label for checks."""

    def fit_batch(self, est, batch, batch_axis=0):
        from estimatorch import BatchProcessor

        x, y, index = batch
        data, label, pred, loss = BatchProcessor().fit_batch(est, (x, y), batch_axis)
        est._last_index = index
        return data, label, pred, loss

    def evaluate_batch(self, est, batch, batch_axis=0):
        from estimatorch import BatchProcessor

        x, y, _ = batch
        return BatchProcessor().evaluate_batch(est, (x, y), batch_axis)


class RecordIndex(BatchEnd):
    priority = float("inf")

    def __init__(self):
        self.indices = []

    def batch_end(self, est, **kw):
        self.indices.extend(est._last_index.tolist())


def _train(out_dir, mode, ckpt_dir=None):
    est, loader = _setup()
    est.batch_processor = Processor()
    rank = distributed.get_rank()
    record, indices = Record(), RecordIndex()
    # best weights (the same on every rank: stored once per file) and gradient accumulation
    handlers = [record, indices, GradientUpdateHandler(accumulation_steps=2),
                EarlyStoppingHandler(est.train_metrics[0], patience=100, restore_best_weights=True)]
    if mode == "stop":
        handlers.append(StopOnRank(rank=1, step=3))
    if ckpt_dir is not None:
        handlers.append(CheckpointHandler(ckpt_dir, batch_period=1, epoch_period=None, max_checkpoints=None,
                                          resume_from_checkpoint=mode == "resume"))
    history = est.fit(loader, epochs=2, event_handlers=handlers)
    return {"losses": record.losses, "indices": indices.indices, "history": history.to_dict(),
            "model": est.net.state_dict(), "optimizer": est.optimizer.state_dict(),
            "step": est.position.step, "world": distributed.get_world_size(),
            "metric": est.train_metrics[0].compute(), "local": est.train_metrics[0].compute(sync=False)}


def test_two_ranks_train_in_step_on_disjoint_shards(tmp_path):
    r0, r1 = distributed.spawn(_train, 2, str(tmp_path), "full", backend="gloo")
    assert r0["world"] == r1["world"] == 2
    for key in r0["model"]:
        assert torch.equal(r0["model"][key], r1["model"][key])  # DDP averaged the gradients
    per_epoch = [set(r["indices"][:len(r["indices"]) // 2]) for r in (r0, r1)]
    assert per_epoch[0] | per_epoch[1] == set(range(43))  # the epoch is covered (one index padded)
    assert len(per_epoch[0] & per_epoch[1]) <= 1
    assert r0["losses"] != r1["losses"]  # different data and different dropout masks per rank
    # compute() reduces across ranks: both ranks report the same global value, which differs
    # from the local one
    assert r0["metric"] == r1["metric"]
    assert r0["history"] == r1["history"]
    assert r0["local"] != r1["local"]


def test_a_stop_decided_on_one_rank_stops_every_rank(tmp_path):
    """A rank-local request of step 3 is agreed without a blocking collective: gloo exchanges
    the flags every 16 steps, so here the epoch's end (step 5) agrees on it and every rank stops
    there (see Estimator.fit; tests/estimator/stopping/test_stop_agreement.py tries other periods)."""
    r0, r1 = distributed.spawn(_train, 2, str(tmp_path), "stop", backend="gloo")
    assert r0["step"] == r1["step"] == 5
    assert len(r0["losses"]) == len(r1["losses"]) == 5


def test_two_ranks_resume_bit_identically(tmp_path):
    full_dir = tmp_path / "ckpt"
    reference = distributed.spawn(_train, 2, str(tmp_path), "full", str(full_dir), backend="gloo")
    names = sorted(os.listdir(full_dir))
    assert not [n for n in names if n.endswith(".tmp")]
    resume_dir = tmp_path / "resume-from"
    resume_dir.mkdir()
    k = 6  # first batch of the second epoch (22 samples per rank: 5 batches per epoch), mid accumulation
    shutil.copy(full_dir / f"model-epoch1batch{k}.pt", resume_dir)
    payload = torch.load(resume_dir / f"model-epoch1batch{k}.pt", weights_only=True)
    # EarlyStopping's state is the same on every rank: stored once; the gradients accumulated
    # under DDP's no_sync differ per rank: stored for each
    assert "EarlyStoppingHandler" in payload["ranks"][0]["handlers"]
    assert "EarlyStoppingHandler" not in payload["ranks"][1]["handlers"]
    assert [r["handlers"]["GradientUpdateHandler"]["pending"] for r in payload["ranks"]] == [1, 1]
    resumed = distributed.spawn(_train, 2, str(tmp_path), "resume", str(resume_dir), backend="gloo")
    for want, got in zip(reference, resumed):
        assert got["losses"] == want["losses"][k:]
        for key in want["model"]:
            assert torch.equal(want["model"][key], got["model"][key])
        assert got["history"] == want["history"]


def _resume_with_one_process(ckpt_dir, out):
    est, loader = _setup()
    est.batch_processor = Processor()
    try:
        est.fit(loader, epochs=2, event_handlers=[CheckpointHandler(ckpt_dir, resume_from_checkpoint=True)])
    except ValueError as err:
        with open(out, "w") as f:
            f.write(str(err))


def test_resuming_with_another_world_size_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    distributed.spawn(_train, 2, str(tmp_path), "full", str(ckpt), backend="gloo")
    out = tmp_path / "error.txt"
    _resume_with_one_process(str(ckpt), str(out))
    assert "2 processes" in out.read_text() or "world_size" in out.read_text()


TORCHRUN_SCRIPT = '''
import os, sys, torch
from torch import nn
from estimatorch import Estimator, distributed
torch.manual_seed(0)
torch.set_num_threads(1)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.arange(40) % 3)
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
before = {"group": torch.distributed.is_initialized(), "rank": distributed.get_rank(),
          "world": distributed.get_world_size(), "main": distributed.is_main_process(),
          "planned": est.planned_steps(loader, epochs=2)}
steps = [0]
est.optimizer.register_step_post_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
history = est.fit(loader, epochs=2)
torch.save({"world": distributed.get_world_size(), "rank": distributed.get_rank(), "model": est.net.state_dict(),
            "history": history.to_dict(), "before": before, "steps": steps[0]},
           f"{sys.argv[1]}/rank{distributed.get_rank()}.pt")
# With torch 2.13 a gloo process sometimes aborts during interpreter teardown, after its work is
# done ("terminate called without an active exception"): results are saved, leave without it.
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''


def test_fit_under_torchrun_initialises_the_group_itself(tmp_path):
    """torchrun sets the rendezvous variables; fit creates the process group from them."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert (r0["world"], r0["rank"], r1["world"], r1["rank"]) == (2, 0, 2, 1)
    for key in r0["model"]:
        assert torch.equal(r0["model"][key], r1["model"][key])
    assert r0["history"] == r1["history"] and len(r0["history"]["epoch"]) == 2
    assert proc.stdout.count("Training begin") == 1  # only rank 0 logs
    # before fit started the process group, each rank knew its rank and its share of the steps
    for rank, result in enumerate((r0, r1)):
        before = result["before"]
        assert not before["group"]
        assert (before["rank"], before["world"], before["main"]) == (rank, 2, rank == 0)
        assert before["planned"] == result["steps"] == 2 * (40 // 4 // 2)


def test_rank_and_world_size_come_from_torchrun_variables_before_a_process_group(monkeypatch):
    assert not torch.distributed.is_initialized()
    assert (distributed.get_rank(), distributed.get_world_size(), distributed.is_main_process()) == (0, 1, True)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (distributed.get_rank(), distributed.get_world_size(), distributed.get_local_rank()) == (3, 4, 1)
    assert not distributed.is_main_process() and not distributed.is_distributed()  # no collective without a group


class CtrlCOnRank(BatchEnd):
    """Ctrl-C reaching one rank only, during step ``at``."""

    def __init__(self, rank, at):
        self.rank, self.at, self.seen = rank, at, 0

    def batch_end(self, est, **kw):
        import signal

        self.seen += 1
        if distributed.get_rank() == self.rank and self.seen == self.at:
            signal.raise_signal(signal.SIGINT)


def _interrupted(out_dir):
    import signal

    # A process started in the background by a non-interactive shell (nohup, `cmd &`, some CI
    # runners) inherits SIGINT ignored, and fit then rightly leaves it alone: this test needs
    # Ctrl-C to reach the process, so it says so itself.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    est, loader = _setup()
    est.batch_processor = Processor()
    try:
        est.fit(loader, epochs=2, event_handlers=[CtrlCOnRank(rank=0, at=3)])
        outcome = "finished"
    except KeyboardInterrupt:
        outcome = "interrupted"
    return {"outcome": outcome, "step": est.position.step}


def test_ctrl_c_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Ctrl-C reaches rank 0 during step 3: both ranks stop at step 5, the epoch's end, which
    agrees on it before gloo's next exchange (every 16 steps)."""
    r0, r1 = distributed.spawn(_interrupted, 2, str(tmp_path), backend="gloo")
    assert r0 == r1 == {"outcome": "interrupted", "step": 5}


# -- collectives for the loop -------------------------------------------------------------------
def _collectives():
    rank = distributed.get_rank()
    pending = distributed.all_reduce_max_async([rank, 1 - rank, 7 * rank])
    grads = [torch.full((2, 3), float(rank + 1)), torch.full((4,), 10.0 * (rank + 1), dtype=torch.float64)]
    distributed.all_reduce_mean_(grads)
    return {"max": pending.wait(), "again": pending.wait(), "done": pending.is_completed(), "grads": grads}


def test_the_async_max_and_the_in_place_mean_reduce_over_every_rank():
    for r in distributed.spawn(_collectives, 2, backend="gloo"):
        assert r["max"] == r["again"] == (1, 1, 7) and r["done"]
        assert torch.equal(r["grads"][0], torch.full((2, 3), 1.5))
        assert torch.equal(r["grads"][1], torch.full((4,), 15.0, dtype=torch.float64))


# -- a start check that fails on one rank only -----------------------------------------------------
class RefuseOnRank(BatchEnd):
    """A handler whose start check fails on one rank only (as a rank-0-only directory check does)."""

    def __init__(self, rank):
        self.rank = rank

    def check_fit(self, estimator, resume):
        if distributed.get_rank() == self.rank:
            raise ValueError(f"refused on rank {self.rank}")

    def batch_end(self, est, **kw):
        pass


def _fit_refused(root, refusing_rank):
    import time

    est, loader = _setup()
    handlers = [RefuseOnRank(refusing_rank)]
    if refusing_rank == 0:  # the real case: LoggingHandler checks its log_dir on rank 0 only
        blocker = os.path.join(root, "a-file")
        open(blocker, "w").close()
        handlers = [__import__("estimatorch").LoggingHandler(log_dir=blocker)]
    start = time.monotonic()
    try:
        est.fit(loader, epochs=1, event_handlers=handlers)
        outcome = "trained"
    except ValueError as err:
        outcome = f"ValueError: {err}"
    return {"outcome": outcome, "seconds": time.monotonic() - start, "fitting": est._fitting,
            "handlers": len(est.handlers)}


@pytest.mark.parametrize("refusing_rank", [0, 1])
def test_a_start_check_failing_on_one_rank_stops_every_rank_with_its_error(tmp_path, refusing_rank):
    """Without one agreement on fit's start checks the other rank went on into DDP's first
    collective and waited for a peer that had left (a hang until gloo's timeout)."""
    results = distributed.spawn(_fit_refused, 2, str(tmp_path), refusing_rank, backend="gloo")
    expected = "log_dir" if refusing_rank == 0 else f"refused on rank {refusing_rank}"
    for result in results:
        assert result["outcome"].startswith("ValueError") and expected in result["outcome"], result
        assert result["seconds"] < 60 and not result["fitting"] and result["handlers"] == 0


def test_one_cache_of_process_groups_follows_the_default_group(tmp_path):
    """The flag group and the side group come from one cache keyed by the default group: a new
    process group (after destroy and init) gets new ones, never a group of the destroyed one."""
    import torch.distributed as dist

    seen = []
    for attempt in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{attempt}'}", rank=0, world_size=1)
        try:
            side = distributed.side_group()
            assert distributed.side_group() is side  # reused within one process group
            seen.append(side)
        finally:
            dist.destroy_process_group()
    assert seen[0] is not seen[1]
    assert distributed.side_group() is None  # no process group: none
