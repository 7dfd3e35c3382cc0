"""The data layer: what turns any training data into a resumable, shardable, positionable stream.

It sits below the estimator and the handlers: it imports ``rng``, ``distributed`` (with its ``cluster``),
``samplers`` and the shared checks, never ``estimatorch.estimator``, ``estimatorch.events`` or
``estimatorch.event_handlers`` (``tests/test_layers.py`` checks it).

The contract, as ``estimatorch.events`` is the handlers' (docs/data.md walks through it):

- :class:`TrainStream`: what a resumable stream gives the loop (batches per epoch, exact or
  replayed positioning, an epoch's batches from a position, its state, its fingerprint and the
  judge of a saved one, an elastic layout where supported, closing its workers);
- :class:`StreamAdapter`: what recognises a kind of data (without importing its library) and
  opens its stream, shown the data as a :class:`DataSource`;
- :func:`register_adapter` / :func:`unregister_adapter` / :func:`registered_adapters`: the
  registry every built-in adapter joins through the same call a third party uses;
- :func:`open_stream`: the one way in, which ``fit`` and ``Estimator.planned_steps`` take.

Also here, for ``evaluate`` and ``predict``: each rank's share of the data (:func:`for_inference`,
:func:`in_step`) and index-seeded samples (:func:`seeded_for_inference`); and the pieces a
stream author reuses: :func:`compare_fingerprints`, :func:`loader_kwargs`,
:class:`IgnoreStopSignals`; and :class:`NondeterministicDataWarning` (with
:func:`warn_threaded_maps`, its one wording), said at fit start for draws no seed fixes.
"""

from ._adapters import DataSource, StreamAdapter, open_stream, register_adapter, registered_adapters, unregister_adapter
from ._elastic import ElasticLayout, slot_positions
from ._fingerprint import compare_fingerprints, is_elastic
from ._hf_streams import HFIterableAdapter
from ._inference_seeding import seeded_for_inference
from ._iterable_streams import StatefulIterableAdapter
from ._mosaic_streams import MosaicAdapter
from ._replay_stream import ReplayAdapter
from ._sequence_stream import SequenceAdapter
from ._sharding import InferenceData, for_inference, in_step
from ._stream_base import TrainStream, loader_kwargs
from ._streams import MapLoaderAdapter, draws_no_randomness
from ._torchdata import TorchdataAdapter
from ._warnings import NondeterministicDataWarning, warn_threaded_maps
from ._workers import IgnoreStopSignals

__all__ = ["DataSource", "ElasticLayout", "IgnoreStopSignals", "InferenceData", "NondeterministicDataWarning",
           "StreamAdapter", "TrainStream", "compare_fingerprints", "draws_no_randomness", "for_inference", "in_step",
           "is_elastic", "loader_kwargs", "open_stream", "register_adapter", "registered_adapters",
           "seeded_for_inference", "slot_positions", "unregister_adapter", "warn_threaded_maps"]

# The built-in adapters join the registry through the public call (docs/data.md lists them).
for _adapter, _priority in ((TorchdataAdapter(), 100), (HFIterableAdapter(), 200), (MosaicAdapter(), 210),
                            (StatefulIterableAdapter(), 300), (MapLoaderAdapter(), 400), (SequenceAdapter(), 500),
                            (ReplayAdapter(), 1000)):
    register_adapter(_adapter, priority=_priority)
del _adapter, _priority
