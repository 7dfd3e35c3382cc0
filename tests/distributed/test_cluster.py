"""The launchers read from their variables (no process is started here): torchrun, SLURM with its
node lists, a PyTorchJob, the interactive cases that are one process, and every inconsistent
environment named in its error; SLURM's requeue signal and ``scontrol requeue``."""

from __future__ import annotations

import logging
import os
import signal
import stat

import pytest
import torch

from estimatorch import distributed
from estimatorch.distributed import cluster
from estimatorch.event_handlers import BatchEnd

SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
         "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train"}
JOB = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "trainer-master-0", "MASTER_PORT": "23456"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("node07", ["node07"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("x[098-101]", ["x098", "x099", "x100", "x101"]),
    ("rack[1-2]n[3,5]", ["rack1n3", "rack1n5", "rack2n3", "rack2n5"]),
    ("c1,d[2-3],e", ["c1", "d2", "d3", "e"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_a_node_list_expands_as_scontrol_show_hostnames_does(nodelist, hosts):
    assert cluster.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, problem", [
    ("node[01-03", "unbalanced brackets"), ("node]1[", "unbalanced brackets"), ("n[3-1]", "runs backwards"),
    ("n[a-b]", "is not a number or a range"), ("a,,b", "an empty host name"), ("n[1,]", "is not a number"),
])
def test_a_malformed_node_list_is_an_error_naming_it(nodelist, problem):
    with pytest.raises(RuntimeError, match=problem) as info:
        cluster.expand_nodelist(nodelist)
    assert f"SLURM_JOB_NODELIST={nodelist!r}" in str(info.value)


def test_srun_tasks_are_ranks_meeting_at_the_first_node_on_a_port_of_the_job():
    launcher = cluster.detect(SLURM)
    assert launcher == cluster.Launcher("slurm", 1, 4, 1, "node01", cluster.PORT_BASE + 77)
    # the job's own MASTER_ADDR / MASTER_PORT win; an array task's id still gives a port
    given = cluster.detect(dict(SLURM, MASTER_ADDR="10.0.0.5", MASTER_PORT="4000"))
    assert (given.master_addr, given.master_port) == ("10.0.0.5", 4000)
    assert cluster.slurm_port("123_4") == cluster.PORT_BASE + 123
    ports = {cluster.slurm_port(str(job)) for job in range(0, 100000, 7)}
    assert min(ports) >= 15000 and max(ports) < 32768


@pytest.mark.parametrize("change", [
    {"SLURM_NTASKS": "1"},  # srun --pty bash, or one task
    {"SLURM_JOB_NAME": "interactive"},  # salloc's interactive step
    {"SLURM_JOB_NAME": "bash"},
    {"SLURM_STEP_ID": None},  # the batch script's own shell ran python without srun
    {"SLURM_PROCID": None},
])
def test_an_interactive_allocation_is_one_process(change):
    env = {k: v for k, v in {**SLURM, **change}.items() if v is not None}
    assert cluster.detect(env) == cluster.Launcher("none")


def test_a_pytorchjob_without_local_rank_takes_it_from_the_processes_per_node():
    assert cluster.detect(JOB) == cluster.Launcher("pytorchjob", 3, 4, 0, "trainer-master-0", 23456)
    assert cluster.detect(dict(JOB, LOCAL_WORLD_SIZE="2")).local_rank == 1


def test_torchrun_wins_over_the_slurm_or_pod_it_runs_in():
    launcher = cluster.detect({**SLURM, **TORCHRUN})
    assert launcher == cluster.Launcher("torchrun", 1, 2, 1, "127.0.0.1", 29500)
    assert cluster.detect({}) == cluster.Launcher("none")


@pytest.mark.parametrize("env, named", [
    (dict(TORCHRUN, RANK="2"), "RANK='2', WORLD_SIZE='2'"),
    (dict(TORCHRUN, LOCAL_RANK="-1"), "LOCAL_RANK='-1'"),
    (dict(JOB, RANK="4"), "RANK='4', WORLD_SIZE='4'"),
    (dict(JOB, WORLD_SIZE="two"), "WORLD_SIZE must be an integer"),
    (dict(JOB, WORLD_SIZE="0", RANK="0"), "WORLD_SIZE='0'"),
    (dict(SLURM, SLURM_PROCID="4"), "SLURM_PROCID='4', SLURM_NTASKS='4'"),
    (dict(SLURM, SLURM_LOCALID="x"), "SLURM_LOCALID must be an integer"),
    (dict(SLURM, SLURM_JOB_NODELIST="n[1-"), "SLURM_JOB_NODELIST='n[1-'"),
])
def test_an_inconsistent_environment_is_an_error_naming_the_variables(env, named):
    with pytest.raises(RuntimeError) as info:
        cluster.detect(env)
    assert named in str(info.value)


@pytest.mark.parametrize("env, named", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR unset"),
    (dict(JOB, MASTER_PORT=None), "MASTER_PORT unset"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_JOB_NODELIST unset"),
])
def test_fit_refuses_several_processes_with_nowhere_to_meet_before_any_step(monkeypatch, env, named):
    from tests.distributed.test_distributed import _setup

    for key in {**SLURM, **JOB, **TORCHRUN}:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        if value is not None:
            monkeypatch.setenv(key, value)
    est, loader = _setup()
    steps = []
    est.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    with pytest.raises(RuntimeError, match="needs an address and a port") as info:
        est.fit(loader, epochs=1)
    assert named in str(info.value) and not steps and not torch.distributed.is_initialized()


@pytest.mark.parametrize("env, named", [
    (dict(TORCHRUN, RANK="2"), "RANK='2', WORLD_SIZE='2'"),
    (dict(SLURM, SLURM_JOB_NODELIST="n[1-"), "SLURM_JOB_NODELIST='n[1-'"),
])
def test_the_rank_helpers_answer_one_process_on_inconsistent_variables_and_fit_refuses(monkeypatch, caplog, env,
                                                                                        named):
    from tests.distributed.test_distributed import _setup

    for key in {**SLURM, **JOB, **TORCHRUN}:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="estimatorch.distributed.cluster"):
        answers = [(distributed.get_rank(), distributed.get_world_size(), distributed.get_local_rank(),
                    distributed.is_main_process()) for _ in range(3)]
    assert answers == [(0, 1, 0, True)] * 3  # a query outside fit never raises
    warned = [r.getMessage() for r in caplog.records if r.name == "estimatorch.distributed.cluster"]
    assert len(warned) == 1 and named in warned[0]  # once, naming the variables
    est, loader = _setup()
    steps = []
    est.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    with pytest.raises(RuntimeError) as info:
        est.fit(loader, epochs=1)
    assert named in str(info.value) and not steps and not torch.distributed.is_initialized()


def test_the_rank_helpers_answer_from_slurm_before_a_process_group(monkeypatch):
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    for key in TORCHRUN:
        monkeypatch.delenv(key, raising=False)
    assert (distributed.get_rank(), distributed.get_world_size(), distributed.get_local_rank()) == (1, 4, 1)
    assert not distributed.is_main_process() and not distributed.is_distributed()


# -- requeue ------------------------------------------------------------------------------------
@pytest.mark.parametrize("env, expected", [
    ({"SLURM_JOB_ID": "5"}, signal.SIGUSR1),
    ({"SLURM_JOB_ID": "5", "ESTIMATORCH_REQUEUE_SIGNAL": "usr2"}, signal.SIGUSR2),
    ({"SLURM_JOB_ID": "5", "ESTIMATORCH_REQUEUE_SIGNAL": "SIGUSR2"}, signal.SIGUSR2),
    ({"SLURM_JOB_ID": "5", "ESTIMATORCH_REQUEUE": "0"}, None),
    ({"SLURM_JOB_ID": "5", "ESTIMATORCH_REQUEUE": "off"}, None),
    ({}, None),  # not a SLURM job
])
def test_the_requeue_signal_is_usr1_under_slurm_and_can_be_switched(env, expected):
    assert cluster.requeue_signal(env) == expected


@pytest.mark.parametrize("name", ["TERM", "NOPE"])
def test_a_requeue_signal_that_cannot_be_one_is_an_error_naming_it(name):
    with pytest.raises(RuntimeError, match=f"ESTIMATORCH_REQUEUE_SIGNAL='{name}'"):
        cluster.requeue_signal({"SLURM_JOB_ID": "5", "ESTIMATORCH_REQUEUE_SIGNAL": name})


AGENT = {"TORCHELASTIC_RUN_ID": "r1", "SLURM_JOB_ID": "42"}


@pytest.mark.parametrize("env, signum, problem", [
    (dict(AGENT, TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT"), signal.SIGUSR1,
     "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"),  # torchrun's default: USR1 ends the agent
    (dict(AGENT, TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGUSR1"), signal.SIGUSR2, "SIGUSR2"),
    (AGENT, signal.SIGUSR1, "This torch's torchrun cannot pass it on"),  # a torchrun without the option
    (dict(AGENT, TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"), signal.SIGUSR1, None),
    (dict(AGENT, TORCHELASTIC_SIGNALS_TO_HANDLE="TERM, usr1"), signal.SIGUSR1, None),
    ({"SLURM_JOB_ID": "42"}, signal.SIGUSR1, None),  # srun python: no agent in between
    (AGENT, None, None),  # requeue off
])
def test_a_torchrun_agent_that_would_not_pass_the_requeue_signal_on_is_named(env, signum, problem):
    said = cluster.agent_drops(signum, env)
    if problem is None:
        assert said is None
    else:
        assert problem in said and "SLURM job 42" in said and "ESTIMATORCH_REQUEUE=0" in said


def test_fit_warns_when_torchruns_agent_would_drop_the_requeue_signal(monkeypatch, estimatorch_log):
    """Read from the estimatorch logger's own records: it does not propagate to the root logger once
    a fit set it up, so caplog saw the warning only when no fit ran before in the session."""
    from tests.distributed.test_distributed import _setup

    for key in {**SLURM, **JOB, **TORCHRUN}:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # a batch script's own process: one process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    est, _ = _setup()
    loader = [(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))]
    est.fit(loader, epochs=1)
    warned = [r for r in estimatorch_log if "does not handle SIGUSR1" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    estimatorch_log.clear()
    est.fit(loader, epochs=1)
    assert not any("does not handle" in r.getMessage() for r in estimatorch_log)


SHARED = {"TORCHELASTIC_RUN_ID": "r1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "2",
          "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize("env, warned", [
    (SHARED, True),  # several agents, restarts allowed, the store shared: a restart meets the dead keys
    ({k: v for k, v in SHARED.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}, True),  # read from the agent's env
    (dict(SHARED, TORCHELASTIC_USE_AGENT_STORE="False"), False),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    ({k: v for k, v in SHARED.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
     | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, False),
    (dict(SHARED, GROUP_WORLD_SIZE="1"), False),  # one agent: fit gives each restart its own key space
    (dict(SHARED, TORCHELASTIC_MAX_RESTARTS="0"), False),  # no restart to fail
    ({k: v for k, v in SHARED.items() if k != "TORCHELASTIC_RUN_ID"}, False),  # no torchrun agent
])
def test_several_torchrun_agents_sharing_the_store_across_restarts_are_named(env, warned):
    said = cluster.shared_store_restarts(env)
    if not warned:
        assert said is None
    else:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said and "docs/clusters.md" in said and said.startswith("2 ")


def test_fit_warns_when_several_agents_share_the_store_across_restarts(monkeypatch, estimatorch_log):
    from tests.distributed.test_distributed import _setup

    for key in {**SLURM, **JOB, **TORCHRUN}:
        monkeypatch.delenv(key, raising=False)
    for key, value in SHARED.items():  # the variables only (one process: fit forms no group of them)
        monkeypatch.setenv(key, value)
    est, _ = _setup()
    loader = [(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))]
    est.fit(loader, epochs=1)
    warned = [r.getMessage() for r in estimatorch_log if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.getMessage()]
    assert len(warned) == 1 and estimatorch_log[0].getMessage() == warned[0]  # before any work
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    estimatorch_log.clear()
    est.fit(loader, epochs=1)
    assert not any("TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in r.getMessage() for r in estimatorch_log)


def fake_scontrol(directory, status=0):
    """An ``scontrol`` that records its arguments in ``directory/calls`` and exits with ``status``."""
    path = directory / "scontrol"
    path.write_text(f'#!/bin/sh\necho "$@" >> "{directory}/calls"\necho "scontrol says hi"\nexit {status}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return directory / "calls"


def test_requeue_runs_scontrol_once_with_the_job_id(tmp_path, monkeypatch, caplog):
    calls = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with caplog.at_level(logging.WARNING, "estimatorch.distributed.cluster"):
        assert cluster.requeue({"SLURM_JOB_ID": "4242"})
    assert calls.read_text() == "requeue 4242\n"
    assert "Requeued SLURM job 4242" in caplog.text


def test_a_failed_requeue_is_logged_with_the_commands_output(tmp_path, monkeypatch, caplog):
    fake_scontrol(tmp_path, status=1)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with caplog.at_level(logging.ERROR, "estimatorch.distributed.cluster"):
        assert not cluster.requeue({"SLURM_JOB_ID": "4242"})
    assert "exited with status 1: scontrol says hi" in caplog.text
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    caplog.clear()
    with caplog.at_level(logging.ERROR, "estimatorch.distributed.cluster"):
        assert not cluster.requeue({"SLURM_JOB_ID": "4242"})
    assert "`scontrol requeue 4242` failed" in caplog.text


class SignalAt:
    """Sends ``signum`` to this process during step ``at`` (rank ``rank`` only)."""

    def __init__(self, signum, at, rank=0):
        self.signum, self.at, self.rank, self.seen = signum, at, rank, 0

    def batch_end(self, est, **kw):
        self.seen += 1
        if self.seen == self.at and distributed.get_rank() == self.rank:
            os.kill(os.getpid(), self.signum)


def _slurm_fit(model_dir, handlers=()):
    from estimatorch import CheckpointHandler
    from tests.distributed.test_distributed import Processor, _setup

    est, loader = _setup()
    est.batch_processor = Processor()
    hook = type("Hook", (SignalAt, BatchEnd), {})
    extra = [hook(*h) for h in handlers]
    ckpt = CheckpointHandler(str(model_dir), epoch_period=1, resume_from_checkpoint=True)
    try:
        est.fit(loader, epochs=2, event_handlers=[ckpt, *extra])
        status = 0
    except SystemExit as stop:
        status = stop.code
    return est, status


def test_sigusr1_under_slurm_checkpoints_requeues_once_and_the_rerun_ends_bit_identical(tmp_path, monkeypatch,
                                                                                         caplog):
    calls = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    reference, status = _slurm_fit(tmp_path / "reference")
    assert status == 0 and not calls.exists()
    with caplog.at_level(logging.WARNING):
        stopped, status = _slurm_fit(tmp_path / "job", [(signal.SIGUSR1, 3)])
    assert status == 128 + signal.SIGUSR1 and stopped.position.step == 3
    assert stopped.interruption == "SIGUSR1"
    assert calls.read_text() == "requeue 31337\n"
    assert "SIGUSR1 (SLURM's warning before the time limit)" in caplog.text
    resumed, status = _slurm_fit(tmp_path / "job")  # the requeued job: the same command
    assert status == 0 and calls.read_text() == "requeue 31337\n"
    for key, value in reference.net.state_dict().items():
        assert torch.equal(value, resumed.net.state_dict()[key]), key


def test_sigterm_under_slurm_stays_a_plain_preemption_and_the_switch_turns_requeue_off(tmp_path, monkeypatch):
    calls = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    _, status = _slurm_fit(tmp_path / "term", [(signal.SIGTERM, 2)])
    assert status == 128 + signal.SIGTERM and not calls.exists()
    monkeypatch.setenv("ESTIMATORCH_REQUEUE", "0")
    previous = signal.signal(signal.SIGUSR1, lambda *a: None)  # what the default would do: end the process
    try:
        est, status = _slurm_fit(tmp_path / "off", [(signal.SIGUSR1, 2)])
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert status == 0 and est.interruption is None and not calls.exists()  # fit did not take the signal


@pytest.mark.parametrize("checkpointing, resumes, says", [
    (True, True, "then rank 0 requeues the job (scontrol requeue 9)"),
    (True, False, "The job is not requeued: no CheckpointHandler has resume_from_checkpoint=True"),
    (False, False, "Nothing is saved and the job is not requeued: the steps trained are lost"),
])
def test_the_requeue_message_says_what_is_saved_and_whether_the_job_requeues(monkeypatch, checkpointing, resumes,
                                                                             says):
    from estimatorch.estimator._stopping.interrupts import stop_message

    monkeypatch.setenv("SLURM_JOB_ID", "9")
    text = stop_message("SIGUSR1", notebook=False, checkpointing=checkpointing, resumes=resumes, multi=True)
    assert says in text and "SystemExit(138)" in text


def test_without_a_resuming_checkpoint_handler_sigusr1_stops_but_does_not_requeue(tmp_path, monkeypatch):
    from tests.distributed.test_distributed import Processor, _setup

    calls = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    est, loader = _setup()
    est.batch_processor = Processor()
    hook = type("Hook", (SignalAt, BatchEnd), {})
    with pytest.raises(SystemExit) as stop:
        est.fit(loader, epochs=2, event_handlers=[hook(signal.SIGUSR1, 2)])
    assert stop.value.code == 128 + signal.SIGUSR1 and est.position.step == 2 and not calls.exists()


def test_dataloader_workers_ignore_slurm_requeue_signal(monkeypatch):
    """``--signal=USR1@N`` reaches every process of the step, DataLoader workers too: a worker
    ignores it (as it ignores Ctrl-C and SIGTERM), so the main process can stop at the boundary."""
    import signal as signals

    from estimatorch.estimator._stopping.interrupts import IgnoreStopSignals

    saved = {sig: signals.getsignal(sig) for sig in (signals.SIGINT, signals.SIGTERM, signals.SIGUSR1)}
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "1234")
        IgnoreStopSignals()(0)
        assert signals.getsignal(signals.SIGUSR1) is signals.SIG_IGN
        signals.signal(signals.SIGUSR1, signals.SIG_DFL)
        monkeypatch.setenv("ESTIMATORCH_REQUEUE", "0")  # requeue off: SIGUSR1 is the user's
        IgnoreStopSignals()(0)
        assert signals.getsignal(signals.SIGUSR1) is signals.SIG_DFL
    finally:
        for sig, handler in saved.items():
            signals.signal(sig, handler)
