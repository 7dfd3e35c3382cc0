"""The data layer: what turns any training data into a resumable, shardable, positionable stream.

It sits below the estimator and the handlers (it imports ``rng``, ``distributed``, ``cluster``,
``samplers`` and the shared checks, never ``estimatorch.estimator`` or
``estimatorch.event_handlers``). One module per kind of stream:

- ``_stream_base``: the ``TrainStream`` interface and the settings a rebuilt ``DataLoader`` keeps;
- ``_streams``: map-style loaders rebuilt around a resumable sampler, lists of batches, replayed
  iterables; ``make_train_stream`` picks the stream for a fit's ``train_data``;
- ``_iterable_streams``: stateful ``IterableDataset``s over any number of workers;
- ``_hf_streams``, ``_mosaic_streams``, ``_torchdata``: Hugging Face ``datasets``, MosaicML
  ``streaming``, torchdata's ``StatefulDataLoader``;
- ``_elastic``: the elastic layout (samples laid out in global optimizer steps);
- ``_sharding``: each rank's share of the data for ``evaluate`` and ``predict``;
- ``_workers``: what a rebuilt loader's worker processes run first.
"""

from ._elastic import ElasticLayout, check_fingerprint, configure_elastic, is_elastic
from ._sharding import InferenceData, for_inference, in_step
from ._stream_base import TrainStream, loader_kwargs
from ._streams import draws_no_randomness, make_train_stream
from ._workers import IgnoreStopSignals

__all__ = ["ElasticLayout", "IgnoreStopSignals", "InferenceData", "TrainStream", "check_fingerprint",
           "configure_elastic", "draws_no_randomness", "for_inference", "in_step", "is_elastic", "loader_kwargs",
           "make_train_stream"]
