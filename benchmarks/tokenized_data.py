"""Data time of tokenized text: µs per 128-token row through a DataLoader, for the ways to turn a
Hugging Face ``datasets`` dataset's rows into tensors, against a plain collate of tensors
already in memory (a ``TensorDataset``, the reference: ratio 1).

    python benchmarks/tokenized_data.py                  # 8192 rows, batches of 32, 5 rounds
    python benchmarks/tokenized_data.py --rows 512 --repeats 1 --json

Paths, over the same token ids (lengths 64 to 128, so the collators pad), as a streamed
``IterableDataset`` (``to_iterable_dataset(num_shards=4)``, what ``load_dataset(...,
streaming=True)`` gives) and as a map-style ``Dataset``:

- ``with_format("torch")`` and the default collate (a tensor per row and column, then a stack;
  fixed-length rows only: the default collate cannot pad);
- the plain rows (Python lists) and ``DataCollatorForLanguageModeling(mlm=False)``;
- ``with_format("arrow")`` rows and ``estimatorch.collate.ArrowCollate(causal_lm_labels=True)``
  (streamed only: a map-style ``Dataset`` in Arrow format cannot be read by a ``DataLoader``'s
  batched fetch in datasets 5).

Only iterating the loader is timed (no model); rounds interleave the paths.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from _common import format_table, machine_info, print_machine, summary  # noqa: E402

LENGTH, BATCH, VOCAB, PAD = 128, 32, 50_000, 0


def token_rows(rows: int, fixed: bool) -> list[list[int]]:
    draw = np.random.default_rng(0)
    ids = draw.integers(1, VOCAB, (rows, LENGTH))
    lengths = np.full(rows, LENGTH) if fixed else draw.integers(LENGTH // 2, LENGTH + 1, rows)
    return [row[:n].tolist() for row, n in zip(ids, lengths)]


def loaders(rows: int) -> dict[str, Callable[[], DataLoader]]:
    import datasets
    import transformers
    from tokenizers import Tokenizer, models

    from estimatorch.collate import ArrowCollate

    datasets.disable_progress_bars()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[PAD]": PAD})),
                                                     pad_token="[PAD]")
    fixed, varied = token_rows(rows, fixed=True), token_rows(rows, fixed=False)

    def table(ids: list[list[int]]) -> Any:
        return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})

    tensors = torch.tensor(fixed)
    reference = TensorDataset(tensors, torch.ones_like(tensors), tensors)
    lm = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    arrow = ArrowCollate(PAD, causal_lm_labels=True)
    fixed_ds, varied_ds = table(fixed), table(varied)

    def streamed(ds: Any) -> Any:
        return ds.to_iterable_dataset(num_shards=4)

    return {
        "TensorDataset, default collate (reference)": lambda: DataLoader(reference, batch_size=BATCH),
        "streamed: with_format('torch'), default collate": lambda: DataLoader(
            streamed(fixed_ds).with_format("torch"), batch_size=BATCH),
        "streamed: rows, DataCollatorForLanguageModeling": lambda: DataLoader(
            streamed(varied_ds), batch_size=BATCH, collate_fn=lm),
        "streamed: with_format('arrow'), ArrowCollate": lambda: DataLoader(
            streamed(varied_ds).with_format("arrow"), batch_size=BATCH, collate_fn=arrow),
        "map-style: with_format('torch'), default collate": lambda: DataLoader(
            fixed_ds.with_format("torch"), batch_size=BATCH),
        "map-style: rows, DataCollatorForLanguageModeling": lambda: DataLoader(
            varied_ds, batch_size=BATCH, collate_fn=lm),
    }


def time_one(make: Callable[[], DataLoader], rows: int) -> float:
    loader = make()
    start = time.perf_counter()
    for _ in loader:
        pass
    return (time.perf_counter() - start) / rows * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = loaders(args.rows)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, make in paths.items():
            times[name].append(time_one(make, args.rows))
    reference = summary(next(iter(times.values())))["median"]
    results = {name: {"us_per_row": summary(values), "ratio": summary(values)["median"] / reference}
               for name, values in times.items()}
    info = machine_info()
    if args.json:
        print(json.dumps({"machine": info, "settings": vars(args), "results": results}))
        return
    print_machine(info)
    print(f"{args.rows} rows of {LENGTH // 2}-{LENGTH} tokens, batches of {BATCH}, {args.repeats} rounds")
    print(format_table(["path", "µs/row (median)", "min", "max", "ratio to the reference"],
                       [[name, f"{r['us_per_row']['median']:.1f}", f"{r['us_per_row']['min']:.1f}",
                         f"{r['us_per_row']['max']:.1f}", f"{r['ratio']:.2f}"] for name, r in results.items()]))


if __name__ == "__main__":
    main()
