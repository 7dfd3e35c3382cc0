"""The warning about a .map() before .shuffle() that datasets runs in its prefetch threads: only
when the step draws from a global generator (probed on the first examples), in a category users
can filter, and the probe changes neither the generators nor the pipeline."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from estimatorch import rng
from estimatorch.data import NondeterministicDataWarning, open_stream
from estimatorch.data._hf_streams import _pipeline
from estimatorch.data._map_probe import drawing_threaded_maps
from tests.hf_models import load_tokenizer, save_tokenizer, train_tokenizer, write_corpus, write_shards


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("corpus"))
    path = write_corpus(directory)
    return write_shards(path, directory), save_tokenizer(train_tokenizer(path), directory + "/tokenizer.json")


def pipeline(files, tokenizer_path, step=None):
    from datasets import load_dataset

    tokenizer = load_tokenizer(tokenizer_path)
    ds = load_dataset("text", data_files=files, split="train", streaming=True)
    ds = ds.map(lambda rows: tokenizer(rows["text"]), batched=True, remove_columns=["text"])
    if step is not None:
        ds = ds.map(step)
    return ds.shuffle(seed=1, buffer_size=8)


def noisy(example):
    return {"noise": random.random()}


def torch_noisy(example):
    return {"noise": float(torch.rand(()))}


def test_a_tokenizing_map_before_the_shuffle_is_not_warned_about(corpus):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_stream(pipeline(*corpus), 0)


@pytest.mark.parametrize("step", [noisy, torch_noisy])
def test_a_random_map_before_the_shuffle_is_named_in_its_category(corpus, step):
    with pytest.warns(NondeterministicDataWarning, match=rf"that drew from the global generators .*\.map\({step.__name__}\) before its \.shuffle\(\)"):
        open_stream(pipeline(*corpus, step), 0)
    assert issubclass(NondeterministicDataWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=NondeterministicDataWarning)  # what the docs say to write
        open_stream(pipeline(*corpus, step), 0)


def test_the_probe_changes_neither_the_generators_nor_the_pipeline(corpus):
    ds = pipeline(*corpus, noisy)
    ds.set_epoch(0)
    rng.seed_everything(5)
    state = rng.get_state(cuda=False)
    assert drawing_threaded_maps(_pipeline(ds)) == [(".map(noisy)", "before its .shuffle()")]
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(state.values(), rng.get_state(cuda=False).values()))
    fresh = pipeline(*corpus, noisy)
    fresh.set_epoch(0)
    ids = [row["input_ids"] for row in ds]
    assert ids == [row["input_ids"] for row in fresh] and len(ids) == 200
