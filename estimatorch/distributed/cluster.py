"""Which launcher started this process, read from its environment: the one place that knows them.

``fit`` forms the process group from what :func:`detect` finds, and
:func:`~estimatorch.distributed.get_rank`, ``get_world_size``, ``get_local_rank`` and
``is_main_process`` answer from it before a group exists. In order of precedence:

- **an existing process group** (Ray Train's, or your own ``init_process_group``): used as it is.
- **torchrun / torchelastic**: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT`` all set. torchrun started under SLURM or in a PyTorchJob's pod wins over them.
- **a PyTorchJob** (Kubeflow's training operator): ``RANK`` and ``WORLD_SIZE`` (with
  ``MASTER_ADDR`` and ``MASTER_PORT``) but no ``LOCAL_RANK``. The local rank is ``RANK`` modulo
  ``LOCAL_WORLD_SIZE`` when that is set, else 0 (one process per pod).
- **SLURM** (``srun python train.py``, one task per process): ``SLURM_PROCID`` is the rank,
  ``SLURM_NTASKS`` the world size, ``SLURM_LOCALID`` the local rank. ``MASTER_ADDR`` is the
  first host of ``SLURM_JOB_NODELIST`` (compressed lists such as ``node[01-03,07]`` are expanded
  here, without calling ``scontrol``) unless set; ``MASTER_PORT`` is taken from the environment,
  else derived from the job id: ``15000 + SLURM_JOB_ID % 17000`` (15000-31999: unprivileged,
  below Linux's ephemeral ports, and the same in every task of the job). An interactive
  allocation is one process: ``SLURM_NTASKS`` of 1, a step started by ``salloc`` or
  ``srun --pty bash`` (job name ``bash`` or ``interactive``), or a batch script's own shell
  (no ``SLURM_STEP_ID``: the script ran ``python`` without ``srun``).
- otherwise a single process.

Variables set inconsistently (a rank not below the world size, a world size above 1 with no
address to meet at, a malformed node list) raise a ``RuntimeError`` naming the variables and their
values in ``fit`` (:func:`init_process_group`), before any work: never a silent run of processes
that each believe they are alone. A query (:func:`current`, behind the rank helpers) answers one
process with a warning instead.

SLURM requeue (see ``docs/clusters.md``): under SLURM, the signal named by
``ESTIMATORCH_REQUEUE_SIGNAL`` (default ``USR1``, what ``sbatch --signal=USR1@90`` sends before
the time limit) stops every rank at the agreed step boundary like SIGTERM, checkpoints it, then
rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` and the processes exit. ``ESTIMATORCH_REQUEUE=0``
turns it off (the signal then keeps its default action).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import subprocess
from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

__all__ = ["Launcher", "REQUEUE_SIGNAL_VAR", "REQUEUE_VAR", "SHARE_STORE_VAR", "agent_drops", "current", "detect",
           "expand_nodelist", "init_process_group", "requeue", "requeue_signal", "shared_store_restarts", "slurm_port"]

logger = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: the variable that turns SLURM requeue off (``0``, ``false``, ``no``, ``off``)
REQUEUE_VAR = "ESTIMATORCH_REQUEUE"
#: the variable naming the signal that requeues under SLURM (``USR1``, ``SIGUSR2``, ...)
REQUEUE_SIGNAL_VAR = "ESTIMATORCH_REQUEUE_SIGNAL"
#: ports derived from ``SLURM_JOB_ID``: ``PORT_BASE + job id % PORT_SPAN``
PORT_BASE, PORT_SPAN = 15000, 17000


@dataclasses.dataclass(frozen=True)
class Launcher:
    """What started this process.

    Attributes:
        name: ``"process_group"``, ``"torchrun"``, ``"pytorchjob"``, ``"slurm"`` or ``"none"``.
        rank: the global rank.
        world_size: the number of processes.
        local_rank: the rank on this machine (picks the GPU).
        master_addr: where the ranks meet (None where the launcher gave none).
        master_port: the port there (None where the launcher gave none).
    """

    name: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    @property
    def multi(self) -> bool:
        """More than one process."""
        return self.world_size > 1


def _values(env: Mapping[str, str], names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={env[n]!r}" if n in env else f"{n} unset" for n in names)


def _int(env: Mapping[str, str], name: str, names: tuple[str, ...], default: Optional[int] = None) -> int:
    """``env[name]`` as an int; a ``RuntimeError`` naming ``names``' values when it is not one."""
    if name not in env:
        if default is None:
            raise RuntimeError(f"{name} is not set ({_values(env, names)})")
        return default
    try:
        return int(env[name])
    except ValueError:
        raise RuntimeError(f"{name} must be an integer ({_values(env, names)})") from None


def _checked(launcher: Launcher, env: Mapping[str, str], names: tuple[str, ...]) -> Launcher:
    if launcher.world_size < 1 or not 0 <= launcher.rank < launcher.world_size:
        raise RuntimeError(f"{launcher.name}: the rank must be at least 0 and below the world size "
                           f"({_values(env, names)})")
    if launcher.local_rank < 0 or launcher.local_rank > launcher.rank:
        raise RuntimeError(f"{launcher.name}: the local rank must be at least 0 and at most the rank "
                           f"({_values(env, names)})")
    return launcher


# -- SLURM's node lists ---------------------------------------------------------------------------
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part)
        if match is None:
            raise RuntimeError(f"SLURM_JOB_NODELIST={nodelist!r}: {part!r} is not a number or a range")
        first, last = match.group(1), match.group(2)
        if last is None:
            out.append(first)
            continue
        if int(last) < int(first):
            raise RuntimeError(f"SLURM_JOB_NODELIST={nodelist!r}: the range {part!r} runs backwards")
        width = len(first) if first.startswith("0") else 0  # node[01-03]: keep the zero padding
        out.extend(str(i).zfill(width) for i in range(int(first), int(last) + 1))
    return out


def _split_top(nodelist: str) -> list[str]:
    """``nodelist`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth < 0 or depth > 1:
            raise RuntimeError(f"SLURM_JOB_NODELIST={nodelist!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise RuntimeError(f"SLURM_JOB_NODELIST={nodelist!r}: unbalanced brackets")
    items.append(nodelist[start:])
    return items


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, in order (what ``scontrol show hostnames`` prints).

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
        >>> expand_nodelist("a[1-2]-ib,b3")
        ['a1-ib', 'a2-ib', 'b3']
        >>> expand_nodelist("r[1-2]n[1-2]")
        ['r1n1', 'r1n2', 'r2n1', 'r2n2']
    """
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        if not item:
            raise RuntimeError(f"SLURM_JOB_NODELIST={nodelist!r}: an empty host name")
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", item):
            if piece.startswith("["):
                names = [n + value for n in names for value in _expand_ranges(piece[1:-1], nodelist)]
            else:
                names = [n + piece for n in names]
        hosts.extend(names)
    return hosts


def slurm_port(job_id: str) -> int:
    """The port a SLURM job's ranks meet at when ``MASTER_PORT`` is unset: ``15000 + job id %
    17000``, the same in every task of the job, between 15000 and 31999 (unprivileged, and below
    the ports Linux hands out for outgoing connections, 32768 and up).

    Example:
        >>> slurm_port("123456")
        19456
    """
    digits = re.match(r"\d+", job_id)  # an array task's id may read 1234_5
    if digits is None:
        raise RuntimeError(f"SLURM_JOB_ID must start with a number to derive MASTER_PORT, got {job_id!r}")
    return PORT_BASE + int(digits.group()) % PORT_SPAN


# -- detection ------------------------------------------------------------------------------------
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
               "MASTER_ADDR", "MASTER_PORT")
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_INTERACTIVE_NAMES = ("bash", "interactive")

_NONE = Launcher("none")
_launched: Optional[Launcher] = None  # what init_process_group formed the group from


def slurm_tasks(env: Mapping[str, str]) -> bool:
    """Whether SLURM started this process as one task of several (``srun``, not a shell)."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        return False
    if env.get("SLURM_JOB_NAME") in _INTERACTIVE_NAMES:
        return False
    return _int(env, "SLURM_NTASKS", _SLURM_VARS, default=1) > 1


def _torchrun(env: Mapping[str, str]) -> Launcher:
    return _checked(Launcher("torchrun", _int(env, "RANK", _TORCHRUN_VARS), _int(env, "WORLD_SIZE", _TORCHRUN_VARS),
                             _int(env, "LOCAL_RANK", _TORCHRUN_VARS), env["MASTER_ADDR"],
                             _int(env, "MASTER_PORT", _TORCHRUN_VARS)), env, _TORCHRUN_VARS)


def _pytorchjob(env: Mapping[str, str]) -> Launcher:
    names = _JOB_VARS + (("LOCAL_RANK",) if "LOCAL_RANK" in env else ())
    rank, world = _int(env, "RANK", names, default=0), _int(env, "WORLD_SIZE", names, default=1)
    if "LOCAL_RANK" in env:
        local = _int(env, "LOCAL_RANK", names)
    else:
        per_node = _int(env, "LOCAL_WORLD_SIZE", names, default=0)
        local = rank % per_node if per_node > 0 else 0
    port = _int(env, "MASTER_PORT", names) if "MASTER_PORT" in env else None
    return _checked(Launcher("pytorchjob", rank, world, local, env.get("MASTER_ADDR"), port), env, names)


def _slurm(env: Mapping[str, str]) -> Launcher:
    rank, world = _int(env, "SLURM_PROCID", _SLURM_VARS), _int(env, "SLURM_NTASKS", _SLURM_VARS)
    local = _int(env, "SLURM_LOCALID", _SLURM_VARS, default=0)
    address, nodelist = env.get("MASTER_ADDR"), env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if address is None and nodelist:
        address = expand_nodelist(nodelist)[0]
    if "MASTER_PORT" in env:
        port: Optional[int] = _int(env, "MASTER_PORT", _SLURM_VARS)
    else:
        port = slurm_port(env["SLURM_JOB_ID"]) if "SLURM_JOB_ID" in env else None
    return _checked(Launcher("slurm", rank, world, local, address, port), env, _SLURM_VARS)


def detect(env: Optional[Mapping[str, str]] = None) -> Launcher:
    """What started this process (see the module's docstring for the order).

    Args:
        env: the environment to read. Defaults to ``os.environ``; with an explicit ``env`` an
            existing process group is not looked at.

    Raises:
        RuntimeError: the launcher's variables contradict each other; the message names them
            and their values.

    Example:
        >>> detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
        ...         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"})
        Launcher(name='slurm', rank=1, world_size=2, local_rank=0, master_addr='gpu07', master_port=19242)
    """
    if env is None:
        if dist.is_available() and dist.is_initialized():
            return _group_launcher()
        env = os.environ
    if "RANK" not in env and "WORLD_SIZE" not in env and "SLURM_PROCID" not in env:
        return _NONE  # the common case first: it is asked for at every step by rank-0 gating
    if all(v in env for v in _TORCHRUN_VARS):
        return _torchrun(env)
    if "RANK" in env or "WORLD_SIZE" in env:
        return _pytorchjob(env)
    if slurm_tasks(env):
        return _slurm(env)
    return _NONE


_WARNED: set[str] = set()


def current() -> Launcher:
    """:func:`detect`, for a query (the rank helpers of :mod:`estimatorch.distributed`): where the
    variables contradict each other it answers one process, with a warning (once per problem),
    instead of raising; ``fit``, which forms the group (:func:`init_process_group`), refuses them.
    """
    try:
        return detect()
    except RuntimeError as err:
        if str(err) not in _WARNED:
            _WARNED.add(str(err))
            logger.warning("%s; answering as one process (fit refuses to start)", err)
        return _NONE


def _group_launcher() -> Launcher:
    rank, world = dist.get_rank(), dist.get_world_size()
    if _launched is not None and (_launched.rank, _launched.world_size) == (rank, world):
        return _launched
    local = os.environ.get("LOCAL_RANK", "")
    return Launcher("process_group", rank, world, int(local) if local.isdigit() else 0)


def rendezvous_error(launcher: Launcher) -> Optional[str]:
    """Why ``launcher``'s processes cannot meet (None when they can)."""
    if launcher.multi and (launcher.master_addr is None or launcher.master_port is None):
        names = _SLURM_VARS if launcher.name == "slurm" else _JOB_VARS
        return (f"{launcher.name}: a world size of {launcher.world_size} needs an address and a port to meet at "
                f"({_values(os.environ, names)})")
    return None


def init_process_group(backend: Optional[str] = None) -> bool:
    """Form the default process group from :func:`detect` (``fit`` calls it first thing).

    Args:
        backend: Defaults to ``"nccl"`` when CUDA is available (each process on the GPU its
            local rank picks), else ``"gloo"``.

    Returns:
        True when a group was created; False when one exists already or this is one process.

    Raises:
        RuntimeError: the launcher's variables are inconsistent (:func:`detect`), or several
            processes have no address to meet at.
    """
    global _launched
    if not dist.is_available() or dist.is_initialized():
        return False
    launcher = detect()
    if launcher.name == "none" or (launcher.name != "torchrun" and not launcher.multi):
        return False
    problem = rendezvous_error(launcher)
    if problem is not None:
        raise RuntimeError(problem)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(launcher.local_rank % torch.cuda.device_count())
    if launcher.name == "torchrun":
        store = _agent_store(launcher)
        if store is None:
            dist.init_process_group(backend=backend)  # env://
        else:
            dist.init_process_group(backend=backend, store=store, rank=launcher.rank,
                                    world_size=launcher.world_size)
    else:
        host = f"[{launcher.master_addr}]" if ":" in str(launcher.master_addr) else launcher.master_addr
        logger.debug("%s: rank %d of %d meets at %s:%s", launcher.name, launcher.rank, launcher.world_size,
                     host, launcher.master_port)
        dist.init_process_group(backend=backend, init_method=f"tcp://{host}:{launcher.master_port}",
                                rank=launcher.rank, world_size=launcher.world_size)
    _launched = launcher
    return True


def _agent_store(launcher: Launcher) -> Optional[dist.Store]:
    """torchelastic's agent store, with a key space of this restart's own (None where the workers
    host their own store).

    torchrun's agent (torch 2.13) keeps one TCPStore for every generation of workers it starts
    (``TORCHELASTIC_USE_AGENT_STORE``), and ``init_process_group``'s ``env://`` reads it without
    a prefix per restart: after ``--max-restarts`` restarts the workers, they find the keys the
    killed generation wrote (gloo's listening addresses, the start barrier's counters) and try
    to connect to dead processes ("Gloo connectFullMesh failed ... Connection refused") or wait
    in a barrier already counted. Measured: 2 of 5 restarts of a plain DDP script succeeded
    without a prefix, 5 of 5 with one. Each restart (``TORCHELASTIC_RESTART_COUNT``) gets its own,
    under one agent only: on several machines an agent may restart its workers without counting
    (another machine's failure seen as a membership change), so the counts name no generation
    every worker agrees on; there ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each generation
    a store of its own (docs/clusters.md).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None  # several agents may count restarts differently: torch's own env:// then
    client = dist.TCPStore(str(launcher.master_addr), int(launcher.master_port or 0), launcher.world_size,
                           is_master=False, timeout=default_pg_timeout)
    return dist.PrefixStore(f"estimatorch/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


# -- SLURM requeue --------------------------------------------------------------------------------
def requeue_signal(env: Optional[Mapping[str, str]] = None) -> Optional[signal.Signals]:
    """The signal that stops, checkpoints and requeues this SLURM job (None when this is no
    SLURM job, or ``ESTIMATORCH_REQUEUE`` turns it off).

    Raises:
        RuntimeError: ``ESTIMATORCH_REQUEUE_SIGNAL`` names no signal, or one ``fit`` already
            handles (SIGINT, SIGTERM).
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or env.get(REQUEUE_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    name = env.get(REQUEUE_SIGNAL_VAR, "USR1").strip().upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        signum = signal.Signals[name]
    except KeyError:
        raise RuntimeError(f"{REQUEUE_SIGNAL_VAR}={env[REQUEUE_SIGNAL_VAR]!r} names no signal "
                           "(e.g. USR1, USR2)") from None
    if signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP):
        raise RuntimeError(f"{REQUEUE_SIGNAL_VAR}={env[REQUEUE_SIGNAL_VAR]!r}: SIGINT and SIGTERM already stop "
                           "fit (without a requeue); SIGKILL and SIGSTOP cannot be caught. Use USR1 or USR2")
    return signum


#: the variable that gives each generation of torchrun's workers a rendezvous store of its own
SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def shared_store_restarts(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why a restart of this torchrun job would likely fail, or None: several agents
    (``GROUP_WORLD_SIZE`` > 1) that allow restarts (``TORCHELASTIC_MAX_RESTARTS`` > 0) and share
    the rendezvous store across them (``TORCHELASTIC_USE_AGENT_STORE=True``, which the agent sets
    unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): a restarted generation of workers finds the
    dead generation's keys in the store (see docs/clusters.md). Under one agent ``fit`` gives
    each restart a key space of its own; across agents no restart count names a generation.

    Example:
        >>> env = {"TORCHELASTIC_RUN_ID": "r", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
        ...        "TORCHELASTIC_USE_AGENT_STORE": "True"}
        >>> shared_store_restarts(env).startswith("2 torchrun agents")
        True
        >>> shared_store_restarts({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
        True
    """
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    try:
        agents, restarts = int(env.get("GROUP_WORLD_SIZE", "1")), int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE", str(env.get(SHARE_STORE_VAR, "0") != "1")) == "True"
    if agents < 2 or restarts < 1 or not shared:
        return None
    return (f"{agents} torchrun agents share one rendezvous store across restarts and allow {restarts} "
            f"(TORCHELASTIC_MAX_RESTARTS): a restarted generation of workers would find the dead one's keys in it and "
            f"its restart fail (\"Connection refused\" or a hang). Start every agent with {SHARE_STORE_VAR}=1 "
            "(see docs/clusters.md, several machines).")


#: the signals torchrun's agent handles (and passes on to its workers) unless told otherwise
_AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def agent_drops(signum: Optional[signal.Signals], env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why ``signum`` (SLURM's requeue signal) would not reach this process through torchrun's
    agent, or None (no agent, no signal, or the agent passes it on).

    The agent handles only the signals of ``--signals-to-handle`` (its workers see them in
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``; older torch has no such option), by default SIGTERM, SIGINT, SIGHUP and SIGQUIT:
    another, such as the SIGUSR1 of ``--signal=USR1@N``, ends the agent at once (Python's default
    action), and SLURM ends the job step with it, before any checkpoint.

    Example:
        >>> agent_drops(signal.SIGUSR1, {"TORCHELASTIC_RUN_ID": "r",
        ...                              "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1"}) is None
        True
    """
    env = os.environ if env is None else env
    if signum is None or "TORCHELASTIC_RUN_ID" not in env:
        return None
    handled = env.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    names = {n.strip().upper() for n in (handled or _AGENT_SIGNALS).split(",")}
    if signum.name in names or signum.name[3:] in names:
        return None
    told = "no --signals-to-handle" if handled is None else f"TORCHELASTIC_SIGNALS_TO_HANDLE={handled!r}"
    head = (f"torchrun's agent started this process in SLURM job {env.get('SLURM_JOB_ID', '?')} but does not handle "
            f"{signum.name} ({told}): the {signum.name} of `--signal={signum.name[3:]}@N` would end the agent at once "
            "and the job step with it, before any checkpoint. ")
    if handled is None:
        return head + (f"This torch's torchrun cannot pass it on (newer ones have --signals-to-handle): set "
                       f"{REQUEUE_VAR}=0 and use --signal=TERM@N (see docs/clusters.md)")
    return head + (f"Start torchrun with --signals-to-handle={_AGENT_SIGNALS},{signum.name} and a --shutdown-timeout "
                   f"longer than a stop and its checkpoint take, or set {REQUEUE_VAR}=0 and use --signal=TERM@N "
                   "(see docs/clusters.md)")


def requeue(env: Optional[Mapping[str, str]] = None) -> bool:
    """Run ``scontrol requeue $SLURM_JOB_ID`` once; log its output when it fails.

    Returns:
        Whether the job was requeued.
    """
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "")  # an array task's own id: requeues that task
    command = ["scontrol", "requeue", job]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        logger.error("Could not requeue the job: `%s` failed: %s", " ".join(command), err)
        return False
    if done.returncode != 0:
        logger.error("Could not requeue the job: `%s` exited with status %d: %s", " ".join(command), done.returncode,
                     (done.stdout + done.stderr).strip() or "(no output)")
        return False
    logger.warning("Requeued SLURM job %s (`%s`): it resumes from the checkpoint when it starts again", job,
                   " ".join(command))
    return True
