"""``transformers``' collators and models as they come, trained without a loss: a tokenizer
trained here (``tokenizers``, on text the test writes), ``DataCollatorWithPadding`` for a
classifier, ``DataCollatorForLanguageModeling`` (masked and causal), ``DataCollatorForSeq2Seq``
with a T5 encoder-decoder, ``gradient_checkpointing_enable()`` and a PEFT LoRA model: each fits,
stops and resumes bit for bit, and ``predict`` returns the logits."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import transformers
from datasets import Dataset
from torch.utils.data import DataLoader

from estimatorch import CheckpointHandler, Estimator, checkpoint
from estimatorch.metrics import Accuracy, Perplexity
from estimatorch.testing import assert_resumable
from tests.conftest import assert_tree_equal, losses_recorder
from tests.estimator.test_transformers import fit_losses, hand_loop
from tests.hf_models import WORDS, lm_batches, tiny_bert, tiny_gpt2, tiny_t5, train_tokenizer, write_corpus


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(write_corpus(str(tmp_path_factory.mktemp("corpus"))))


def sentences(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g))
            for k in torch.randint(3, 12, (n,), generator=g)]


def labelled(tokenizer, n=24):
    """A datasets ``Dataset`` of tokenized sentences of several lengths and a ``label`` column."""
    ds = Dataset.from_dict({"text": sentences(n), "label": [i % 3 for i in range(n)]})
    return ds.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=16), batched=True,
                  remove_columns=["text"])


def test_data_collator_with_padding_fine_tunes_a_classifier_and_resumes(tokenizer):
    collate = transformers.DataCollatorWithPadding(tokenizer)

    def data():
        return DataLoader(labelled(tokenizer), batch_size=4, shuffle=True, collate_fn=collate)

    def make():
        model = tiny_bert(len(tokenizer))
        return Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), train_metrics=[Accuracy()])

    est = make()
    history = est.fit(data(), val_data=data(), epochs=1)
    assert sorted(history.keys()) == ["lr", "train_accuracy", "train_loss", "val_accuracy", "val_loss"]
    assert_resumable(make, data, epochs=2, stop_at=[2, 6, 9], quiet=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_masked_lm_collator_draws_its_masks_reproducibly(tokenizer, workers):
    """The collator's random masks come from the global generator (in the training process, or in
    a worker seeded by fit): a resume draws the same masks."""
    collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.3)

    def data():
        return DataLoader(labelled(tokenizer).remove_columns(["label"]), batch_size=4, shuffle=True,
                          collate_fn=collate, num_workers=workers)

    def make():
        model = tiny_bert(len(tokenizer), head="mlm")
        return Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         train_metrics=[Accuracy(), Perplexity()])

    assert_resumable(make, data, epochs=2, stop_at=[3, 7], quiet=True)


def test_causal_lm_collator_labels_train_the_model(tokenizer):
    collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    loader = DataLoader(labelled(tokenizer).remove_columns(["label"]), batch_size=4, collate_fn=collate)
    model = tiny_gpt2(len(tokenizer))
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), train_metrics=[Perplexity()])
    history = est.fit(loader, epochs=4)
    assert history["train_perplexity"][-1] < history["train_perplexity"][0]


def seq2seq_data(tokenizer, model):
    pairs = Dataset.from_dict({"source": sentences(16, seed=1), "target": sentences(16, seed=2)})

    def tokenize(rows):
        inputs = tokenizer(rows["source"], truncation=True, max_length=16)
        inputs["labels"] = tokenizer(text_target=rows["target"], truncation=True, max_length=12)["input_ids"]
        return inputs

    ds = pairs.map(tokenize, batched=True, remove_columns=["source", "target"])
    return DataLoader(ds, batch_size=4, shuffle=True, collate_fn=transformers.DataCollatorForSeq2Seq(tokenizer, model))


def test_seq2seq_collator_trains_an_encoder_decoder_and_resumes(tokenizer):
    def make():
        model = tiny_t5(len(tokenizer))
        return Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         train_metrics=[Accuracy(), Perplexity()])

    est = make()
    loader = seq2seq_data(tokenizer, est.net)
    scores = est.evaluate(loader)
    assert sorted(scores) == ["val_accuracy", "val_loss", "val_perplexity"]
    batch = next(iter(loader))
    est.net.eval()
    with torch.no_grad():
        out = est.net(**batch)
    assert est.evaluate([batch])["val_perplexity"] == pytest.approx(float(out.loss.exp()), rel=1e-5)  # no shift
    logits = est.predict([batch])
    assert logits.shape == (*batch["labels"].shape, len(tokenizer))
    assert_resumable(make, lambda: seq2seq_data(tokenizer, tiny_t5(len(tokenizer))), epochs=2, stop_at=[2, 5],
                     quiet=True)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_gradient_checkpointing_trains_as_the_hand_written_loop():
    model = tiny_gpt2(40)
    model.gradient_checkpointing_enable()
    reference = copy.deepcopy(model)
    batches = lm_batches(40)
    _, losses = fit_losses(model, batches)
    assert losses == hand_loop(reference, batches)
    assert_tree_equal(model.state_dict(), reference.state_dict())

    def make():
        net = tiny_gpt2(40)
        net.gradient_checkpointing_enable()
        return Estimator(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3))

    assert_resumable(make, batches, epochs=2, stop_at=[2, 5], quiet=True)


# -- PEFT ----------------------------------------------------------------------------------------
peft = pytest.importorskip("peft")  # pinned in requirements-dev.txt: present in CI


def lora_gpt2():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1, fan_in_fan_out=True)
    return peft.get_peft_model(tiny_gpt2(40), config)


def lora_estimator(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return Estimator(model, optimizer=torch.optim.AdamW(params, lr=1e-2))


def test_lora_trains_only_the_adapter_as_the_hand_written_loop():
    model = lora_gpt2()
    reference = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    batches = lm_batches(40)
    losses, recorder = losses_recorder()
    lora_estimator(model).fit(batches, epochs=1, event_handlers=[recorder])
    assert losses == hand_loop(reference, batches, lr=1e-2)
    after = model.state_dict()
    changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
    assert changed and all("lora_" in k for k in changed)
    assert_tree_equal(after, reference.state_dict())


def test_lora_resumes_exactly_and_its_adapter_exports(tmp_path):
    assert_resumable(lambda: lora_estimator(lora_gpt2()), lm_batches(40), epochs=2, stop_at=[2, 5], quiet=True)

    model = lora_gpt2()
    est = lora_estimator(model)
    est.fit(lm_batches(40), epochs=1, event_handlers=[CheckpointHandler(str(tmp_path / "ckpt"))])
    fresh = lora_gpt2()  # the checkpoint's weights into a fresh model, then its adapter alone exported
    checkpoint.load_into(fresh, str(tmp_path / "ckpt"))  # adapter-only: the base is fresh's own
    fresh.save_pretrained(str(tmp_path / "adapter"))
    assert os.path.getsize(tmp_path / "adapter" / "adapter_model.safetensors") < 0.5 * sum(
        p.numel() * 4 for p in fresh.parameters())
    loaded = peft.PeftModel.from_pretrained(tiny_gpt2(40), str(tmp_path / "adapter")).eval()
    ids = lm_batches(40, n=1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
