"""datasets' own resume cases for IterableDataset pipelines (its tests of .filter, .take/.skip,
interleave_datasets with probabilities and stopping strategies, concatenate_datasets), ported onto
fit: the uninterrupted fit against one stopped right after a checkpoint and resumed from it in a
fresh estimator, every later loss and the final parameters bitwise; workers 0 and 2."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import concatenate_datasets, interleave_datasets, load_dataset  # noqa: E402

from estimatorch.testing import assert_resumable  # noqa: E402
from tests.data.test_exact_cases import augment  # noqa: E402
from tests.data.test_hf_datasets import write_shards  # noqa: E402
from tests.data.test_iterable_streams import dropout_estimator  # noqa: E402


def source(directory, shards=2):
    directory.mkdir(exist_ok=True)
    return load_dataset("json", data_files=write_shards(directory, "json", shards), split="train", streaming=True)


PIPELINES = {
    "filter": lambda d: source(d / "a").filter(lambda e: e["i"] % 3 != 1),
    "take": lambda d: source(d / "a").take(11),
    "skip": lambda d: source(d / "a").skip(3),
    "interleave first_exhausted": lambda d: interleave_datasets([source(d / "a"), source(d / "b")]),
    "interleave all_exhausted": lambda d: interleave_datasets(
        [source(d / "a"), source(d / "b", 1).take(5)], stopping_strategy="all_exhausted"),
    "interleave probabilities": lambda d: interleave_datasets(
        [source(d / "a"), source(d / "b")], probabilities=[0.3, 0.7], seed=5),
    "interleave probabilities all_exhausted": lambda d: interleave_datasets(
        [source(d / "a"), source(d / "b")], probabilities=[0.3, 0.7], seed=5, stopping_strategy="all_exhausted"),
    "concatenate": lambda d: concatenate_datasets([source(d / "a"), source(d / "b", 1).take(6)]),
}


# concatenate_datasets of sources with fewer shards than workers, workers 2, is left out: datasets'
# own load_state_dict of a worker's saved state raises IndexError on resume (loud, not silent)
CASES = [(name, w) for name in sorted(PIPELINES) for w in (0, 2) if (name, w) != ("concatenate", 2)]


@pytest.mark.parametrize("pipeline,num_workers", CASES)
def test_a_datasets_pipeline_resumes_exactly(tmp_path, pipeline, num_workers):
    def data():
        ds = PIPELINES[pipeline](tmp_path).map(augment, remove_columns=["i"])  # random: after, in this thread
        return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=4, num_workers=num_workers)

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(replay|cannot be positioned|prefetch threads).*")
        assert_resumable(dropout_estimator, data, epochs=2, stop_at=[1, 2, 3, 5], quiet=True)
