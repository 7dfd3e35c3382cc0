"""torchrun's agent beyond restarts, on loopback.

``--nnodes=1:2``, a machine lost and another joining: two "machines", one torchrun agent each
(c10d rendezvous, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): the second machine's agent and worker
are SIGKILLed mid-run; the first machine's agent restarts its worker alone (world size 1, twice the
accumulation) from the last checkpoint; a third machine's agent joins, the first agent stops its
worker (SIGTERM: a checkpoint of that step) and both restart at world size 2. With
``CheckpointHandler(..., elastic=True)`` the run ends with the parameters of an uninterrupted
2-process run, bit for bit (docs/resume.md: 2 processes -> 1 with accumulation 2 and back are
bit-identical).

``srun torchrun`` with SLURM's ``--signal=USR1@N``: with ``--signals-to-handle`` naming SIGUSR1 the
agent passes it on, the workers stop, checkpoint and requeue the job once, and the requeued job
ends bitwise.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.distributed.test_cluster import fake_scontrol
from tests.distributed.test_cluster_launchers import _assert_same_model, _base_env, _free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = '''
import os, signal, sys, time, torch
from torch import nn
from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler, distributed
from estimatorch.event_handlers import BatchEnd

torch.set_num_threads(1)
out, model_dir, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
node = os.environ.get("NODE", "-")
world = distributed.get_world_size()  # torchrun's, before fit forms the group
k = 2 // world  # the same 8 samples in every optimizer step on 2 processes or 1
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), seed=3)
est.agree_every = 2  # a stop is agreed within 2 steps (not 16): before the run's end
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.arange(64) % 3)
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


def mark(name, text):
    with open(f"{out}/{name}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{out}/{name}.tmp", f"{out}/{name}")


def wait_for(signum, name):
    """Wait here (at most 5 minutes) until ``signum`` arrives, then let fit's handler stop at
    this step and checkpoint it."""
    stopped = []
    previous = signal.getsignal(signum)
    signal.signal(signum, lambda s, f: (stopped.append(s), previous(s, f)))
    mark(name, str(os.getpid()))
    for _ in range(3000):
        if stopped:
            break
        time.sleep(0.1)


class Elastic(BatchEnd):
    """Machine B's worker waits at its 5th batch to be killed with its agent; the machine left
    alone (world size 1) waits at its second optimizer step for the SIGTERM its agent sends when
    a machine joins."""

    priority = float("inf")  # after this batch's checkpoint
    seen = 0

    def batch_end(self, est, **kw):
        self.seen += 1
        if node == "B" and world == 2 and self.seen == 5:
            mark("b_waits", str(os.getpid()))
            time.sleep(600)
        if world == 1 and self.seen == 4:
            wait_for(signal.SIGTERM, "alone_waits")


class Usr1(BatchEnd):
    """Rank 0 of the first job waits at its 3rd batch for SLURM's SIGUSR1, passed on by the agent."""

    priority = float("inf")
    seen = 0

    def batch_end(self, est, **kw):
        self.seen += 1
        if self.seen == 3 and distributed.get_rank() == 0 and not os.path.exists(f"{out}/usr1_waits"):  # once
            wait_for(signal.SIGUSR1, "usr1_waits")


handlers = [CheckpointHandler(model_dir, batch_period=2 * k, elastic=True, resume_from_checkpoint=True),
            GradientUpdateHandler(accumulation_steps=k)]
if scenario != "none":
    handlers.append(Elastic() if scenario == "elastic" else Usr1())
try:
    est.fit(loader, epochs=2, event_handlers=handlers)
    status = 0
except SystemExit as stop:
    status = stop.code
rank = distributed.get_rank()
with open(f"{out}/generations", "a") as f:
    f.write(f"{node} {rank} {world} {os.environ.get('TORCHELASTIC_RESTART_COUNT')} {est.position.step} {status}\\n")
torch.save({"model": est.net.state_dict(), "step": est.position.step, "status": status, "world": world, "node": node},
           f"{out}/rank{rank}.pt")
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)  # torch 2.13's gloo may abort at teardown: the results are saved
'''


def _wait_for(path, procs, logs, limit=240):
    start = time.monotonic()
    while not path.exists():
        dead = [name for name, proc in procs.items() if proc.poll() is not None]
        if dead or time.monotonic() - start > limit:
            pytest.fail(f"no {path.name} (ended: {dead}):\n" + "\n".join(
                f"--- {name}\n{log.read_text()[-3000:]}" for name, log in logs.items()))
        time.sleep(0.2)
    return path.read_text()


def _wait_for_port(port, procs, logs, limit=120):
    start = time.monotonic()
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() - start > limit or any(proc.poll() is not None for proc in procs.values()):
            pytest.fail(f"nothing listens on {port}:\n" + "\n".join(log.read_text()[-3000:] for log in logs.values()))
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-process run: each rank's results."""
    tmp = tmp_path_factory.mktemp("reference")
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                    str(tmp), str(tmp / "model"), "none"],
                   env=_base_env(), capture_output=True, timeout=300, check=True)
    return [torch.load(tmp / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


def _assert_ends_as(out, reference):
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True)
        assert got["step"] == reference[rank]["step"] == 16 and got["status"] == 0
        _assert_same_model(got["model"], reference[rank]["model"])


@pytest.mark.timeout(600)
def test_a_machine_lost_and_another_joining_under_torchrun_nnodes_1_2_ends_bitwise(tmp_path, reference):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    out = tmp_path / "elastic"
    out.mkdir()
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    env = dict(_base_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    procs, logs = {}, {}

    def agent(node, hosts_the_rendezvous):
        # seconds instead of torch's defaults (30 s of last call, a node dead after 3 x 5 s without a heartbeat)
        conf = f"last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,is_host={hosts_the_rendezvous}"
        logs[node] = tmp_path / f"{node}.log"
        procs[node] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=elastic-test", f"--rdzv-conf={conf}",
             "--max-restarts=3", "--monitor-interval=0.5", str(script), str(out), str(tmp_path / "model"), "elastic"],
            env=dict(env, NODE=node), stdout=logs[node].open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    try:
        agent("A", "true")  # hosts the rendezvous store: the machine that must stay
        _wait_for_port(port, procs, logs)  # A's store is up before B looks for it
        agent("B", "false")
        worker = int(_wait_for(out / "b_waits", procs, logs))
        os.killpg(procs["B"].pid, signal.SIGKILL)  # machine B lost: its agent and its worker
        os.kill(worker, signal.SIGKILL)
        procs.pop("B").wait()
        _wait_for(out / "alone_waits", procs, logs)  # A's worker trains alone, from the last checkpoint
        agent("C", "false")  # a machine joins
        codes = {node: proc.wait(timeout=300) for node, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert codes == {"A": 0, "C": 0}, "\n".join(log.read_text()[-3000:] for log in logs.values())
    generations = [line.split() for line in (out / "generations").read_text().splitlines()]
    # A alone at world size 1 after one restart (the failure counted), stopped by the join with a
    # checkpoint (SIGTERM: 143); then A and C at world size 2 (a membership change: not counted)
    assert generations[0][:4] == ["A", "0", "1", "1"] and generations[0][5] == "143"
    assert sorted(g[:4] + g[5:] for g in generations[1:]) == [["A", "0", "2", "1", "0"], ["C", "1", "2", "0", "0"]]
    _assert_ends_as(out, reference)


@pytest.mark.timeout(600)
def test_srun_torchrun_passes_slurms_usr1_on_and_the_requeued_job_resumes_bitwise(tmp_path, reference):
    """``srun torchrun --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``: the SIGUSR1 of
    ``--signal=USR1@N`` reaches the agent (simulated: sent to it), which passes it on to its
    workers; they stop at one step, checkpoint it, rank 0 requeues the job once (a recording
    ``scontrol``), and the requeued job (the same command) ends bitwise. No warning: the agent
    handles the signal (``cluster.agent_drops``)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    calls = fake_scontrol(tmp_path)
    env = dict(_base_env(tmp_path), SLURM_JOB_ID="4242", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_STEP_ID="0",
               SLURM_JOB_NODELIST="127.0.0.1", SLURM_JOB_NAME="train")  # one task: the node's agent
    out = tmp_path / "job"
    out.mkdir()

    def job():
        log = (out / "agent.log").open("a")
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=120", str(script),
             str(out), str(tmp_path / "model"), "usr1"], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    agent = job()
    try:
        _wait_for(out / "usr1_waits", {"agent": agent}, {"agent": out / "agent.log"})
        agent.send_signal(signal.SIGUSR1)  # to the agent only: it must pass it on
        agent.wait(timeout=300)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    log = (out / "agent.log").read_text()
    stopped = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    assert [r["status"] for r in stopped] == [128 + signal.SIGUSR1] * 2, log[-3000:]
    assert stopped[0]["step"] == stopped[1]["step"] < 16  # one boundary, before the end
    assert calls.read_text() == "requeue 4242\n"  # once, by rank 0
    assert "does not handle" not in log
    for rank in range(2):
        (out / f"rank{rank}.pt").unlink()
    assert job().wait(timeout=300) == 0  # the requeued job: the same command, resumed
    assert calls.read_text() == "requeue 4242\n"
    _assert_ends_as(out, reference)
