"""A causal LM trained without a loss over a streamed, shuffled ``datasets`` pipeline with
``DataCollatorForLanguageModeling``, killed by SIGTERM (checkpointing that step) or SIGKILL
(after a step's checkpoint), in subprocesses: the rerun resumes and every later step's loss and
the final weights equal an uninterrupted run's, bit for bit; the same for a PEFT LoRA model. One
uninterrupted run per model serves both kills; the processes are forked from a server that
imported the libraries once (``tests/forked.py``)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests import forked
from tests.conftest import assert_tree_equal
from tests.hf_models import save_tokenizer, train_tokenizer, write_corpus, write_shards

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_worker.py")
AT = 9  # of 13 batches per epoch: mid first epoch


#: what the worker imports beyond torch and estimatorch: its fork server imports them once
PRELOAD = ("datasets", "transformers", "tokenizers", "tests.hf_models")


def run(directory, mode, *extra):
    return forked.run(WORKER, [directory, mode, str(AT), *extra], timeout=600, preload=PRELOAD)


def losses(directory, mode):
    with open(os.path.join(directory, mode + ".losses")) as f:
        return f.read().split()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per model (``lora``): a directory with the corpus, the tokenizer and the shards, and the
    uninterrupted run's losses and weights, shared by the SIGTERM and the SIGKILL case."""
    made = {}

    def get(lora):
        if lora not in made:
            directory = str(tmp_path_factory.mktemp("lora" if lora else "gpt2"))
            save_tokenizer(train_tokenizer(write_corpus(directory)), os.path.join(directory, "tokenizer.json"))
            write_shards(os.path.join(directory, "corpus.txt"), directory)
            full = run(directory, "full", *(["--lora"] if lora else []))
            assert full.returncode == 0, full.stderr[-3000:]
            made[lora] = directory
        return made[lora]

    return get


@pytest.mark.parametrize("lora", [False, True], ids=["gpt2", "lora"])
@pytest.mark.parametrize("sig", ["sigterm", "sigkill"])
def test_a_killed_causal_lm_resumes_exactly(tmp_path, sig, lora, uninterrupted):
    if lora:
        pytest.importorskip("peft")  # pinned in requirements-dev.txt: present in CI
    directory = str(tmp_path / "run")
    shutil.copytree(uninterrupted(lora), directory)  # the data and the uninterrupted run; no checkpoint yet
    extra = ["--lora"] if lora else []
    killed = run(directory, sig, *extra)
    assert killed.returncode == (143 if sig == "sigterm" else -9), killed.stderr[-3000:]
    assert len(losses(directory, sig)) == AT
    resumed = run(directory, "resume", *extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = losses(directory, "full")
    assert losses(directory, sig) == expected[:AT]
    assert losses(directory, "resume") == expected[AT:]
    assert_tree_equal(torch.load(os.path.join(directory, "resume.pt")), torch.load(os.path.join(directory, "full.pt")))
