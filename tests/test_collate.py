"""ArrowCollate: the batches of DataCollatorForLanguageModeling(mlm=False) and of
DataCollatorWithPadding from Arrow rows, bit for bit, and a streamed, shuffled pipeline with it
resumes exactly."""

from __future__ import annotations

import pytest
import torch
import transformers
from datasets import Dataset

from estimatorch import Estimator
from estimatorch.collate import ArrowCollate
from estimatorch.testing import assert_resumable
from tests.hf_models import tiny_gpt2, train_tokenizer, write_corpus


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(write_corpus(str(tmp_path_factory.mktemp("corpus"))))


@pytest.fixture(scope="module")
def tokenized(tokenizer):
    lines = [f"the cat sat on the mat {' '.join(['and ran'] * (i % 5))}." for i in range(20)]
    ds = Dataset.from_dict({"text": lines, "label": [i % 3 for i in range(20)]})
    return ds.map(lambda rows: tokenizer(rows["text"]), batched=True, remove_columns=["text"])


def rows(ds, arrow):
    fmt = ds.with_format("arrow") if arrow else ds
    it = fmt.to_iterable_dataset()
    return list(it)[:8]


def assert_same_batch(got, expected):
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype, key
        assert torch.equal(got[key], expected[key]), key


def test_it_gives_the_causal_lm_collators_batch(tokenizer, tokenized):
    ds = tokenized.remove_columns(["label"])
    expected = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)(rows(ds, arrow=False))
    got = ArrowCollate(tokenizer.pad_token_id, causal_lm_labels=True)(rows(ds, arrow=True))
    assert_same_batch(got, dict(expected))


def test_it_gives_the_padding_collators_batch(tokenizer, tokenized):
    expected = transformers.DataCollatorWithPadding(tokenizer)(rows(tokenized, arrow=False))
    got = ArrowCollate(tokenizer.pad_token_id)(rows(tokenized, arrow=True))
    got["labels"] = got.pop("label")  # DataCollatorWithPadding renames the column
    assert_same_batch(got, dict(expected))


def test_rows_not_in_arrow_are_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"with_format\('arrow'\).*got list of dict"):
        ArrowCollate()([{"input_ids": [1, 2]}])


def test_a_streamed_shuffled_pipeline_with_it_resumes_exactly(tokenizer, tokenized):
    from torch.utils.data import DataLoader

    def data():
        ds = tokenized.remove_columns(["label"]).to_iterable_dataset(num_shards=2).shuffle(seed=0, buffer_size=8)
        return DataLoader(ds.with_format("arrow"), batch_size=4,
                          collate_fn=ArrowCollate(tokenizer.pad_token_id, causal_lm_labels=True))

    def make():
        model = tiny_gpt2(len(tokenizer))
        return Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))

    assert_resumable(make, data, epochs=2, stop_at=[2, 7], quiet=True)


# -- PadCollate: the rows of any map-style dataset ------------------------------------------------
def test_pad_collate_pads_sequences_stacks_numbers_and_keeps_text():
    import numpy as np

    from estimatorch.collate import PadCollate

    rows = [{"input_ids": [5, 6, 7], "attention_mask": np.ones(3, dtype=np.int32), "labels": torch.tensor([1, 2, 3]),
             "label": 2, "score": 0.5, "text": "a b c"},
            {"input_ids": [8], "attention_mask": np.ones(1, dtype=np.int32), "labels": torch.tensor([4]),
             "label": 0, "score": 1.5, "text": "d"}]
    batch = PadCollate(pad_value=1)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]] and batch["input_ids"].dtype == torch.int64
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert batch["label"].tolist() == [2, 0]  # not renamed: the rows hold labels already
    assert batch["score"].dtype == torch.float32 and batch["text"] == ["a b c", "d"]
    renamed = PadCollate(keep=["input_ids", "label"])([{k: r[k] for k in ("input_ids", "label", "text")} for r in rows])
    assert sorted(renamed) == ["input_ids", "labels"] and renamed["labels"].tolist() == [2, 0]
    pairs = PadCollate()([(torch.zeros(2), 1), (torch.ones(2), 0)])  # not dicts: the default collate
    assert pairs[0].shape == (2, 2) and pairs[1].tolist() == [1, 0]
    with pytest.raises(ValueError, match="pad_value must be an int, got 0.5"):
        PadCollate(0.5)
