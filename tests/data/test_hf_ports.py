"""Hugging Face datasets' own iterable resume cases (tests/test_iterable_dataset.py: the state_dict
tests over FilteredExamplesIterable, SkipExamplesIterable / TakeExamplesIterable,
FormattedExamplesIterable with .batch, RandomlyCyclingMultiSourcesExamplesIterable with both
stopping strategies, VerticallyConcatenatedMultiSourcesExamplesIterable) ported onto ``fit``: an
uninterrupted fit against one SIGKILLed right after the checkpoint of a step in the middle of an
epoch, at an epoch's last batch and after the first epoch, and run again (tests/data/sigkill.py),
workers 0 and 2, every batch, loss and final parameter bit for bit. Each pipeline ends in a random
``.map``; the json shards are written by the test. .shuffle() is left to the shuffle-buffer tests."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import concatenate_datasets, interleave_datasets, load_dataset  # noqa: E402

from tests.data.sigkill import assert_resumed_bitwise, sigkill_resume  # noqa: E402
from tests.data.test_hf_datasets import augment  # noqa: E402


def source(data_dir, name, values, shards=2):
    """``values`` as a streamed json dataset of ``shards`` files (value k in file k % shards)."""
    directory = os.path.join(data_dir, name)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for s in range(shards):
        path = os.path.join(directory, f"part{s}.jsonl")
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                f.write("".join(json.dumps({"i": i}) + "\n" for i in values[s::shards]))
            os.replace(path + ".tmp", path)
        paths.append(path)
    return load_dataset("json", data_files=paths, split="train", streaming=True)


def dataset(case, data_dir):
    if case == "filter":
        ds = source(data_dir, "a", list(range(24))).filter(lambda e: e["i"] % 3 != 2)  # 16 of 24
    elif case == "skip-take":
        ds = source(data_dir, "a", list(range(24))).skip(3).take(16)
    elif case.startswith("interleave-"):
        a, b = source(data_dir, "a", list(range(12))), source(data_dir, "b", list(range(100, 112)))
        ds = interleave_datasets([a, b], probabilities=[0.4, 0.6], seed=5, stopping_strategy=case[len("interleave-"):])
    elif case == "concatenate":
        ds = concatenate_datasets([source(data_dir, "a", list(range(10))), source(data_dir, "b", list(range(100, 106)))])
    elif case == "batch":
        ds = source(data_dir, "a", list(range(16)))
    else:
        raise ValueError(case)
    ds = ds.map(augment, remove_columns=["i"])
    return ds.batch(4) if case == "batch" else ds


def loader(case, num_workers, data_dir):
    """The fit's train_data (built in each process of a run)."""
    ds = dataset(case, data_dir).with_format("torch")
    if case == "batch":  # .batch(4) makes the batches: the loader passes them through
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    return torch.utils.data.DataLoader(ds, batch_size=4, num_workers=num_workers)


def batches_in_the_first_epoch(case, num_workers, data_dir):
    data = loader(case, num_workers, data_dir)
    data.dataset.set_epoch(0)
    return sum(1 for _ in data)


CASES = [(case, workers) for case in ["filter", "skip-take", "batch", "interleave-first_exhausted",
                                      "interleave-all_exhausted", "concatenate"] for workers in (0, 2)
         if (case, workers) != ("concatenate", 2)]  # refused: see below


@pytest.mark.slow
@pytest.mark.parametrize("case,num_workers", CASES)
def test_an_upstream_resume_case_resumes_bitwise_after_a_sigkill(tmp_path, case, num_workers):
    per_epoch = batches_in_the_first_epoch(case, num_workers, str(tmp_path / "data"))
    assert per_epoch >= 3, per_epoch
    # the middle of the first epoch, its last batch, the middle of the second
    runs = sigkill_resume(f"{__name__}:loader", case, num_workers, tmp_path, stops=[2, per_epoch, per_epoch + 2])
    assert_resumed_bitwise(runs, steps=len(runs["full"]["steps"]))
    assert len(runs["full"]["steps"]) > per_epoch + 2
    replayed = [w for w in runs["resumed"]["warnings"] if "replays epoch" in w]
    assert [w for w in runs["resumed"]["warnings"] if w not in replayed] == runs["full"]["warnings"]
    # .batch() is a batched map over the random .map(): resumed by a replay of the epoch, said
    assert bool(replayed) == (case == "batch") and all("['augment'] run below a batched map" in w for w in replayed)


def test_a_concatenation_in_workers_is_refused_at_fit_start_naming_it(tmp_path):
    """datasets' own load_state_dict() fails to resume a concatenate_datasets() in a worker after an
    epoch (IndexError; torchdata's StatefulDataLoader alone too): refused before any step."""
    from tests.conftest import Count
    from tests.data.test_iterable_streams import dropout_estimator

    count = Count()
    with pytest.raises(ValueError, match=r"concatenate_datasets\(\) of iterable datasets, in a DataLoader with "
                                         r"num_workers=2: datasets' own load_state_dict\(\) cannot resume it"):
        dropout_estimator().fit(loader("concatenate", 2, str(tmp_path)), epochs=1, event_handlers=[count])
    assert count.batches == 0
