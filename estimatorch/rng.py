"""Seeding, capture and restore of every random number generator estimatorch knows about.

The generators are python's ``random``, torch's CPU generator, every CUDA device's generator and
the library's numpy :class:`numpy.random.Generator` (:func:`default_numpy_rng`). numpy's legacy
global ``np.random.*`` state is yours: seeding and capture leave it alone unless asked
(``numpy_global=True``, which ``fit`` passes: it seeds that generator too and saves and restores
it with the run, since a dataset in the training process, ``num_workers=0``, may draw from it).
Data loading (:func:`sample_seeding`) also reseeds it: many augmentation libraries draw from
``np.random``, so each sample's fetch reseeds it from the sample's position, and in the main
process puts your state back afterwards, so you never see a change.

This module is the only place in estimatorch that reads or writes RNG state.

Example:
    >>> from estimatorch import rng
    >>> _ = rng.seed_everything(7)
    >>> a = rng.default_numpy_rng().random()
    >>> with rng.keep_random_state():
    ...     _ = rng.seed_everything(123)
    >>> _ = rng.seed_everything(7)
    >>> rng.default_numpy_rng().random() == a
    True
"""

from __future__ import annotations

import contextlib
import operator
import random
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch

__all__ = [
    "DEFAULT_SEED",
    "default_numpy_rng",
    "derive_seed",
    "get_state",
    "keep_random_state",
    "sample_seeding",
    "seed_everything",
    "seed_position",
    "seeded_state",
    "seed_worker",
    "separate_draws",
    "set_state",
]

#: The seed used when none is given (``seed_everything()``, ``Estimator(seed=None)``).
DEFAULT_SEED = 0

_MASK64 = (1 << 64) - 1
_MASK128 = (1 << 128) - 1
_NUMPY_RNG = np.random.Generator(np.random.PCG64(DEFAULT_SEED))
_REQUIRED_KEYS = ("python", "torch", "numpy")


def default_numpy_rng() -> np.random.Generator:
    """Return the library's numpy generator, seeded by :func:`seed_everything`.

    The object is the same for the life of the process (it is reseeded in place), so holding a
    reference to it is safe.
    """
    return _NUMPY_RNG


#: Seeds are ints in ``[0, 2**64)``: the range torch's generators accept (numpy's and
#: python's accept any non-negative int).
_SEED_LIMIT = 1 << 64


def check_seed(seed: Any, arg: str = "seed") -> int:
    """``seed`` as an int, checked to the range every generator accepts (before any is seeded)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"{arg} must be a non-negative int, got {seed!r}")
    if seed >= _SEED_LIMIT:
        raise ValueError(f"{arg} must be an int in [0, 2**64), the range torch, numpy and python's random "
                         f"all accept, got {seed!r}")
    return int(seed)


def _seed_part(part: Any) -> int:
    """One part of :func:`derive_seed`: an integer (python, numpy or a one-element integer
    tensor); a float such as 1.5 would silently hash like 1, so it is refused."""
    if isinstance(part, bool):
        raise TypeError(f"derive_seed takes integers, got the bool {part!r}")
    try:
        return operator.index(part)
    except TypeError:
        raise TypeError(f"derive_seed takes integers, got {part!r} ({type(part).__name__})") from None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """Hash integers (seed, epoch, index, rank, ...) into one well-mixed 63-bit seed.

    A pure function: the same parts give the same seed on every machine and process. Used to make
    randomness a function of position, e.g. ``derive_seed(seed, epoch, sample_index)``. Parts
    are integers of any size and sign; anything else (a float, a bool, a string) is a
    ``TypeError``.

    Example:
        >>> derive_seed(0, 1) == derive_seed(0, 1) != derive_seed(1, 0)
        True
    """
    h = 0x6A09E667F3BCC908
    for part in parts:
        if type(part) is not int:  # the common case costs one type check (per sample when loading)
            part = _seed_part(part)
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


def seed_everything(seed: Optional[int] = None, *, numpy_global: bool = False) -> int:
    """Seed python ``random``, torch (CPU and every CUDA device) and :func:`default_numpy_rng`.

    Args:
        seed: an int in ``[0, 2**64)``. Defaults to :data:`DEFAULT_SEED` (0).
        numpy_global: seed numpy's legacy global generator (``np.random.*``) too. Defaults to
            False (it is yours); ``fit`` passes True.

    Returns:
        The seed used.
    """
    seed = DEFAULT_SEED if seed is None else check_seed(seed)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily where not initialised)
    _NUMPY_RNG.bit_generator.state = np.random.PCG64(seed).state
    if numpy_global:
        np.random.seed([seed & 0xFFFFFFFF, seed >> 32])  # the whole 64-bit seed (it takes 32-bit words)
    return seed


def get_state(cuda: Optional[bool] = None, *, numpy_global: bool = False) -> dict[str, Any]:
    """Capture the state of every generator, as plain tensors and python values.

    The result can be saved with ``torch.save`` and loaded with ``torch.load(weights_only=True)``.

    Args:
        cuda: include every CUDA device's generator. Defaults to None: when CUDA is available
            (a run on the CPU passes False, so that it resumes on a machine with other GPUs).
        numpy_global: include numpy's legacy global generator (``np.random.*``), under
            ``"numpy_global"``. Defaults to False; ``fit`` passes True.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": _NUMPY_RNG.bit_generator.state,
    }
    if torch.cuda.is_available() and cuda is not False:
        state["cuda"] = torch.cuda.get_rng_state_all()
    if numpy_global:
        kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        state["numpy_global"] = {"kind": str(kind), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
                                 "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    return state


def _numpy_global_state(saved: Any) -> tuple:
    """numpy's ``np.random.set_state`` tuple of :func:`get_state`'s ``"numpy_global"`` entry."""
    if not isinstance(saved, dict) or saved.get("kind") != "MT19937" \
            or not isinstance(saved.get("key"), torch.Tensor) or saved["key"].shape != (624,):
        raise ValueError(f"RNG state's 'numpy_global' must be numpy's legacy MT19937 state (a dict with "
                         f"'kind', a 624-word 'key', 'pos', 'has_gauss', 'cached_gaussian'), got {saved!r:.200}")
    key = saved["key"].numpy().astype(np.uint32)
    return ("MT19937", key, int(saved["pos"]), int(saved["has_gauss"]), float(saved["cached_gaussian"]))


def set_state(state: dict[str, Any]) -> None:
    """Restore a state captured by :func:`get_state`.

    Raises:
        ValueError: when a required key is missing, a key is unknown, or the saved CUDA states do
            not match this machine's device count. Nothing is restored in that case.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from rng.get_state(), got {type(state).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"RNG state is missing the key {missing[0]!r} (has {sorted(state)})")
    unknown = sorted(set(state) - set(_REQUIRED_KEYS) - {"cuda", "numpy_global"})
    if unknown:
        raise ValueError(f"RNG state has unknown key {unknown[0]!r}")
    cuda_states = state.get("cuda")
    if cuda_states is not None:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(cuda_states) != have:
            raise ValueError(
                f"RNG state holds {len(cuda_states)} CUDA generator states but this process "
                f"sees {have} CUDA devices"
            )
    numpy_state = state["numpy"]
    if numpy_state.get("bit_generator") != type(_NUMPY_RNG.bit_generator).__name__:
        raise ValueError(
            f"RNG state's numpy bit generator is {numpy_state.get('bit_generator')!r}, "
            f"expected {type(_NUMPY_RNG.bit_generator).__name__!r}"
        )
    legacy = _numpy_global_state(state["numpy_global"]) if "numpy_global" in state else None
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"])
    _NUMPY_RNG.bit_generator.state = numpy_state
    if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)
    if legacy is not None:
        np.random.set_state(legacy)


def _as_python_state(value: Any) -> tuple:
    # torch.save keeps tuples, other serialisers turn them into lists: accept both.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


class keep_random_state(contextlib.ContextDecorator):
    """Shield a block or a function: every generator is restored on exit, also on exceptions.

    Use it as ``with keep_random_state(): ...`` or as a decorator ``@keep_random_state()``.
    Nesting is safe, also a decorated function that calls itself: each entry saves its own state.
    """

    def __init__(self) -> None:
        self._saved: list[dict[str, Any]] = []

    def __enter__(self) -> "keep_random_state":
        self._saved.append(get_state())
        return self

    def __exit__(self, *exc: Any) -> None:
        set_state(self._saved.pop())


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` for a :class:`torch.utils.data.DataLoader` of your own.

    Seeds python ``random`` and :func:`default_numpy_rng` in each worker from the worker's torch
    seed (which the DataLoader derives from its ``generator``), as PyTorch's reproducibility notes
    recommend. ``fit`` does more for the loaders it manages: every sample gets its own seed.
    """
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    _NUMPY_RNG.bit_generator.state = np.random.PCG64(worker_seed).state


def _reseed_fast(seed: int) -> None:
    """Reseed every CPU-side generator, numpy's legacy global one included, from one 63-bit
    seed, in a few microseconds."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    _reseed_numpy(seed)


def _reseed_numpy(seed: int) -> None:
    """Reseed :func:`default_numpy_rng` from a 63-bit seed without numpy's slower seeding."""
    hi = _splitmix64(seed)
    lo = _splitmix64(hi)
    inc = _splitmix64(lo)
    _NUMPY_RNG.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": ((hi << 64) | lo) & _MASK128, "inc": ((inc << 1) | 1) & _MASK128},
        "has_uint32": 0,
        "uinteger": 0,
    }


def seed_position(seed: int, *position: int, device: Optional[torch.device] = None) -> None:
    """Reseed torch's CPU generator (and ``device``'s, when it is a CUDA device), python
    ``random`` and :func:`default_numpy_rng` from ``derive_seed(seed, *position)``, so that what
    is drawn next is a function of that position alone (numpy's legacy global state is left
    alone). Elastic training calls it before every micro-batch with ``(epoch, global
    micro-batch)``: a micro-batch's dropout does not depend on the process that trains it.

    Example:
        >>> seed_position(0, 3, 7)
        >>> a = torch.rand(2)
        >>> seed_position(0, 3, 7)
        >>> torch.equal(a, torch.rand(2))
        True
    """
    value = derive_seed(seed, *position)
    torch.default_generator.manual_seed(value)
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(value)
    random.seed(value)
    _reseed_numpy(value)


def seeded_state(seed: int, cuda: Optional[bool] = None) -> dict[str, Any]:
    """The state :func:`get_state` captures right after ``seed_everything(seed)``, computed
    without changing any generator (a process that resumes an elastic run on another world size
    starts from one of these: the generators of the process it replaces may not exist).

    Args:
        seed: an int in ``[0, 2**64)``.
        cuda: as in :func:`get_state`. Defaults to None.
    """
    with keep_random_state():
        seed_everything(seed)
        return get_state(cuda=cuda)


def _cpu_states() -> tuple:
    return (torch.get_rng_state(), random.getstate(), _NUMPY_RNG.bit_generator.state, np.random.get_state())


def _set_cpu_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    _NUMPY_RNG.bit_generator.state = states[2]
    np.random.set_state(states[3])


def separate_draws(iterable: Any, seed: int) -> Iterator[Any]:
    """Iterate ``iterable`` on CPU generators of its own, seeded from ``seed``.

    Every step of the iteration (``iter()`` and each ``next()``) draws from torch's CPU generator,
    python ``random``, numpy's legacy global one and :func:`default_numpy_rng` as seeded from
    ``seed`` and left by the previous step; the caller's states are put back after each step. A
    sampler that draws its order from torch's global generator (``RandomSampler`` without a
    ``generator``) then gives an order that is a function of ``seed``, and iterating it never
    shifts the model's random stream.

    Example:
        >>> a = list(separate_draws(torch.utils.data.RandomSampler(range(5)), seed=3))
        >>> a == list(separate_draws(torch.utils.data.RandomSampler(range(5)), seed=3))
        True
    """
    caller = _cpu_states()
    _reseed_fast(seed)
    try:
        it = iter(iterable)
    finally:
        own = _cpu_states()
        _set_cpu_states(caller)
    while True:
        caller = _cpu_states()
        _set_cpu_states(own)
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            own = _cpu_states()
            _set_cpu_states(caller)
        yield item


@contextlib.contextmanager
def sample_seeding(seed: int, epoch: int, restore: bool) -> Iterator[Any]:
    """Make data-loading randomness a function of ``(seed, epoch, sample index)``.

    Yields a function ``seed_sample(index, salt=0)`` that reseeds the CPU generators (numpy's
    legacy global one included) for one sample. With ``restore=True`` (data loaded in the main
    process) the caller's generator states are put back on exit, so loading data never shifts
    the model's random stream nor anything of yours.
    """
    saved = (torch.get_rng_state(), random.getstate(), _NUMPY_RNG.bit_generator.state,
             np.random.get_state()) if restore else None

    def seed_sample(index: int, salt: int = 0) -> None:
        _reseed_fast(derive_seed(seed, epoch, index, salt))

    try:
        yield seed_sample
    finally:
        if saved is not None:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            _NUMPY_RNG.bit_generator.state = saved[2]
            np.random.set_state(saved[3])


_check_seed = check_seed  # the name of earlier releases
