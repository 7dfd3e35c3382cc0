"""Two processes started the way SLURM's ``srun`` and a Kubeflow PyTorchJob start them (plain
processes with the launcher's variables, no torchrun, on loopback) form one 2-process run whose
parameters are bitwise those of ``torchrun --nproc-per-node=2`` running the same script; SIGUSR1
on rank 0 under SLURM stops both ranks at the same boundary, checkpoints it, requeues the job once
(a fake ``scontrol`` on ``PATH`` records it), and the requeued job resumes bitwise."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys

import pytest
import torch

from estimatorch import cluster
from tests.distributed.test_cluster import fake_scontrol

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = '''
import os, signal, sys, torch
from torch import nn
from estimatorch import CheckpointHandler, Estimator, cluster, distributed
from estimatorch.event_handlers import BatchEnd

torch.set_num_threads(1)
out, model_dir, at, kill = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
before = (torch.distributed.is_initialized(), distributed.get_rank(), distributed.get_world_size(),
          distributed.get_local_rank(), distributed.is_main_process())
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), seed=3)
est.agree_every = 2
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.arange(64) % 3)
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


class SignalOnRank0(BatchEnd):
    seen = 0

    def batch_end(self, est, **kw):
        self.seen += 1
        if self.seen == at and distributed.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        if self.seen == kill and distributed.get_rank() == 1 and first:  # a worker lost mid-run
            os.kill(os.getpid(), signal.SIGKILL)


try:
    est.fit(loader, epochs=2, event_handlers=[CheckpointHandler(model_dir, resume_from_checkpoint=True),
                                              SignalOnRank0()])
    status = 0
except SystemExit as stop:
    status = stop.code
torch.save({"model": est.net.state_dict(), "step": est.position.step, "status": status, "before": before,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "launcher": cluster.detect().name, "world": distributed.get_world_size()},
           f"{out}/rank{distributed.get_rank()}.pt")
# With torch 2.13 a gloo process sometimes aborts during interpreter teardown, after its work is
# done: the results are saved, leave without it.
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def _base_env(extra_path=None):
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "ESTIMATORCH_"))}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    if extra_path is not None:
        env["PATH"] = f"{extra_path}{os.pathsep}{env['PATH']}"
    return env


def _free(port):
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slurm_job_id():
    """A job id whose derived port (:func:`cluster.slurm_port`) is free here now."""
    while True:
        job = random.randrange(cluster.PORT_SPAN, 50 * cluster.PORT_SPAN)
        if _free(cluster.slurm_port(str(job))):
            return str(job)


def _run(tmp_path, tag, envs, at=0, model_dir=None):
    """Start one process per environment in ``envs``; return each rank's results."""
    out = tmp_path / tag
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), str(out), str(model_dir or tmp_path / f"{tag}-model"), str(at), "0"]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for env in envs]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    results = []
    for rank in range(len(envs)):
        path = out / f"rank{rank}.pt"
        assert path.exists(), f"rank {rank} left no result:\n" + "\n".join(log[-3000:] for log in logs)
        results.append(torch.load(path, weights_only=True))
    return results


def _torchrun(tmp_path, tag, *options, kill=0):
    out = tmp_path / tag
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           *options, str(script), str(out), str(tmp_path / f"{tag}-model"), "0", str(kill)],
                          capture_output=True, text=True, env=_base_env(), timeout=300)
    assert (out / "rank0.pt").exists() and (out / "rank1.pt").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _slurm_envs(job, path=None):
    base = dict(_base_env(path), SLURM_JOB_ID=job, SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_JOB_NAME="train",
                SLURM_JOB_NODELIST="127.0.0.[1-2]")  # a compressed list: rank 0 meets the others at its first host
    return [dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(2)]


def _pytorchjob_envs():
    base = dict(_base_env(), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return [dict(base, RANK=str(r)) for r in range(2)]  # no LOCAL_RANK: one process per pod


def _assert_same_model(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    return _torchrun(tmp_path_factory.mktemp("torchrun"), "torchrun")


@pytest.mark.parametrize("launcher", ["slurm", "pytorchjob"])
def test_srun_and_a_pytorchjob_form_the_run_torchrun_forms(tmp_path, torchrun_run, launcher):
    envs = _slurm_envs(_slurm_job_id()) if launcher == "slurm" else _pytorchjob_envs()
    results = _run(tmp_path, launcher, envs)
    reference = torchrun_run
    assert [r["launcher"] for r in reference] == ["torchrun", "torchrun"]
    for rank, result in enumerate(results):
        assert result["launcher"] == launcher and result["world"] == 2 and result["status"] == 0
        # before fit formed the group, each process already knew its place
        assert result["before"] == (False, rank, 2, rank if launcher == "slurm" else 0, rank == 0)
        assert result["step"] == reference[rank]["step"] == 2 * 64 // 4 // 2
        _assert_same_model(result["model"], reference[rank]["model"])


def test_sigusr1_on_rank_0_under_slurm_requeues_once_and_the_requeued_job_resumes_bitwise(tmp_path, torchrun_run):
    calls = fake_scontrol(tmp_path)
    job = _slurm_job_id()
    model_dir = tmp_path / "job-model"
    stopped = _run(tmp_path, "stopped", _slurm_envs(job, tmp_path), at=3, model_dir=model_dir)
    steps = {r["step"] for r in stopped}
    assert len(steps) == 1 and 3 <= steps.pop() < 16  # both ranks at the same boundary, before the end
    assert [r["status"] for r in stopped] == [128 + signal.SIGUSR1] * 2
    assert calls.read_text() == f"requeue {job}\n"  # once, by rank 0
    resumed = _run(tmp_path, "resumed", _slurm_envs(job, tmp_path), model_dir=model_dir)  # the same command
    assert calls.read_text() == f"requeue {job}\n"
    for rank, result in enumerate(resumed):
        assert result["status"] == 0 and result["step"] == 16
        _assert_same_model(result["model"], torchrun_run[rank]["model"])


def test_torchruns_agent_restarts_a_killed_worker_and_the_run_ends_bitwise(tmp_path, torchrun_run):
    """A worker SIGKILLed in the second epoch: the agent restarts both, they form a new group
    (on a key space of their own in the agent's store: see ``cluster._agent_store``) and resume
    from the first epoch's checkpoint."""
    results = _torchrun(tmp_path, "restarted", "--max-restarts=1", kill=12)
    for rank, result in enumerate(results):
        assert result["restarts"] == 1 and result["status"] == 0 and result["step"] == 16
        _assert_same_model(result["model"], torchrun_run[rank]["model"])


def test_two_torchrun_agents_restart_a_killed_worker_and_the_run_ends_bitwise(tmp_path, torchrun_run):
    """Two "machines" on loopback (one agent each, c10d rendezvous): rank 1's worker is SIGKILLed
    mid-run; both agents restart their workers (each counts the failure against its own
    ``--max-restarts``, hence 2) and the run ends bitwise, each generation on a store of its own
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as docs/clusters.md recommends for several machines)."""
    out = tmp_path / "nodes"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=cluster-test",
                                "--max-restarts=2", str(script), str(out), str(tmp_path / "model"), "0", "12"],
                               env=dict(_base_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    logs = [agent.communicate(timeout=240)[0] for agent in agents]
    results = []
    for rank in range(2):
        path = out / f"rank{rank}.pt"
        assert path.exists(), "\n".join(log[-3000:] for log in logs)
        results.append(torch.load(path, weights_only=True))
        assert results[rank]["status"] == 0 and results[rank]["step"] == 16
        _assert_same_model(results[rank]["model"], torchrun_run[rank]["model"])
    # the killed worker's agent counted a restart; the other may have seen a membership change
    assert max(result["restarts"] for result in results) >= 1
    assert not any(cluster.SHARE_STORE_VAR in log for log in logs)  # set: no warning


def test_two_torchrun_agents_sharing_the_store_across_restarts_are_warned_of(tmp_path):
    """As docs/clusters.md says for several machines, but without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
    every worker inherits its agent's environment, and fit (rank 0) names the variable before a
    restart fails on the dead generation's store. (No worker is killed: the run ends.)"""
    out = tmp_path / "nodes"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    endpoint = f"127.0.0.1:{_free_port()}"
    env = _base_env()
    env.pop(cluster.SHARE_STORE_VAR, None)
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=shared-store",
                                "--max-restarts=1", str(script), str(out), str(tmp_path / "model"), "0", "0"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    logs = [agent.communicate(timeout=240)[0] for agent in agents]
    for rank in range(2):
        assert (out / f"rank{rank}.pt").exists(), "\n".join(log[-3000:] for log in logs)
    warned = [line for log in logs for line in log.splitlines() if f"{cluster.SHARE_STORE_VAR}=1" in line]
    assert len(warned) == 1, "\n".join(log[-3000:] for log in logs)  # once: rank 0's logger
    assert "2 torchrun agents share one rendezvous store" in warned[0] and "docs/clusters.md" in warned[0]
