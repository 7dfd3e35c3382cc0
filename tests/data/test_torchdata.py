"""torchdata's StatefulDataLoader: fit positions it from its own checkpoint, as the DataLoader it
replaces (the loader's own state_dict is not used, so the data is never positioned twice)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from estimatorch.data._streams import make_train_stream
from estimatorch.samplers import ResumableRandomSampler
from estimatorch.testing import assert_resumable
from tests.conftest import losses_recorder
from tests.data.test_iterable_streams import StatefulRange, dropout_estimator
from tests.data.test_streams_matrix import Noisy

STOPS = [2, 4, 6]  # mid-epoch, an epoch's last step, mid second epoch (4 batches per epoch)


def exact(make_data, stops=STOPS, epochs=2):
    with warnings.catch_warnings():
        # exact: no replay warning (torchdata's own deprecation warnings aside)
        warnings.filterwarnings("error", message=".*(replay|cannot be positioned|not a sampler estimatorch).*")
        assert_resumable(dropout_estimator, make_data, epochs=epochs, stop_at=stops, quiet=True)


def losses(data, epochs=2):
    got, rec = losses_recorder()
    dropout_estimator().fit(data, epochs=epochs, event_handlers=[rec])
    return got


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_style_stateful_loader_trains_as_the_dataloader_it_replaces(num_workers):
    loader = StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers)
    stream = make_train_stream(loader, seed=0)
    # torchdata's stateful RandomSampler is taken as torch's: positioned by estimatorch's sampler
    assert isinstance(stream.sampler, ResumableRandomSampler)
    plain = torch.utils.data.DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers)
    assert losses(loader) == losses(plain)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_style_stateful_loader_resumes_exactly(num_workers):
    exact(lambda: StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_iterable_dataset_in_a_stateful_loader_resumes_exactly(num_workers):
    # 14 samples: a partial last batch (per worker with 2 workers)
    exact(lambda: StatefulDataLoader(StatefulRange(14, noise=True), batch_size=4, num_workers=num_workers),
          stops=[2, 3, 4, 5])


def test_a_stateful_loader_with_a_loaded_state_is_refused():
    loader = StatefulDataLoader(Noisy(), batch_size=4, shuffle=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.load_state_dict(state)
    with pytest.raises(ValueError, match="StatefulDataLoader with a state loaded by load_state_dict"):
        dropout_estimator().fit(loader, epochs=1)
    assert len(losses(StatefulDataLoader(Noisy(), batch_size=4, shuffle=True), epochs=1)) == 4
