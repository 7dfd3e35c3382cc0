"""``Estimator(model, optimizer=...)`` without a loss trains a ``transformers`` model on the loss
it computes itself: per-step losses equal a hand-written ``out = model(**batch);
out.loss.backward()`` loop's, bit for bit (tiny GPT-2 and BERT from configs, random init), with
accumulation, clipping and bf16 autocast too; metrics read the logits and labels (shifted for a
causal LM); a batch without labels is an error before any step; evaluate, predict and resume."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

from estimatorch import BatchProcessor, Estimator, rng
from estimatorch.event_handlers import GradientUpdateHandler
from estimatorch.metrics import Accuracy, Perplexity
from estimatorch.testing import assert_resumable
from tests.conftest import assert_tree_equal, losses_recorder
from tests.hf_models import classification_batches, lm_batches, tiny_bert, tiny_gpt2

VOCAB = 40

MODELS = {
    "gpt2": (lambda: tiny_gpt2(VOCAB), lambda: lm_batches(VOCAB)),
    "bert-classifier": (lambda: tiny_bert(VOCAB), lambda: classification_batches(VOCAB)),
}


def hand_loop(model, batches, *, lr=1e-3, accumulate=1, clip=None, autocast=None, seed=0):
    """``out = model(**batch); out.loss.backward()``: the step a user writes, and its losses. With
    accumulation, as transformers' ``Trainer`` scales it: each batch's loss over its tokens
    (``num_items_in_batch``: labels other than -100, a causal LM's shifted by one), weighed by
    them, the window's gradient divided by the tokens of every batch of the window."""
    rng.seed_everything(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    causal = isinstance(model, transformers.GPT2LMHeadModel)
    model.train()
    losses, tokens = [], 0
    for i, batch in enumerate(batches, 1):
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False):
            if accumulate > 1:
                n = (batch["labels"][..., 1:] if causal else batch["labels"]).ne(-100).sum()
                out = model(**batch, num_items_in_batch=n.clamp(min=1))
            else:
                out = model(**batch)
        if accumulate > 1:
            torch.where(n > 0, out.loss * n, torch.zeros_like(out.loss)).backward()
            tokens = tokens + n
        else:
            out.loss.backward()
        losses.append(float(out.loss.detach()).hex())
        if i % accumulate == 0 or i == len(batches):
            if accumulate > 1:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(tokens.clamp(min=1).float())
                tokens = 0
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses


def fit_losses(model, batches, *, lr=1e-3, handlers=(), precision="32", epochs=1, **kwargs):
    losses, recorder = losses_recorder()
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=lr), precision=precision, **kwargs)
    est.fit(batches, epochs=epochs, event_handlers=[recorder, *handlers])
    return est, losses


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("setting", ["plain", "accumulate-clip", "bf16"])
def test_per_step_losses_equal_a_hand_written_loop(name, setting):
    make_model, make_batches = MODELS[name]
    model, batches = make_model(), make_batches() + make_batches()[:1]  # 5 batches: an accumulation left over
    reference = copy.deepcopy(model)
    options = {"plain": {}, "accumulate-clip": {"accumulate": 2, "clip": 0.5}, "bf16": {"autocast": True}}[setting]
    handlers = [GradientUpdateHandler(accumulation_steps=2, clip_grad_norm=0.5)] if setting == "accumulate-clip" else []
    est, losses = fit_losses(model, batches, handlers=handlers, precision="bf16" if setting == "bf16" else "32")
    expected = hand_loop(reference, batches, **options)
    assert losses == expected
    assert_tree_equal(model.state_dict(), reference.state_dict())


def test_a_positional_loss_still_splits_the_batch():
    """``Estimator(net, loss)``: the label rule of before, unchanged."""
    net = torch.nn.Linear(4, 3)
    est = Estimator(net, torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    history = est.fit([{"input": torch.randn(8, 4), "labels": torch.randint(0, 3, (8,))}], epochs=1)
    assert "train_accuracy" in history


@pytest.mark.parametrize("loss", [torch.nn.CrossEntropyLoss(), lambda out, y: out.loss], ids=["ce", "out.loss"])
def test_a_loss_given_a_transformers_output_says_to_drop_it(loss):
    """The newcomer's two tries: the labels go to the loss, so the model computes none."""
    model = tiny_gpt2(VOCAB)
    est = Estimator(model, loss, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(TypeError, match=r"Build Estimator\(model, optimizer=...\) without a loss"):
        est.fit(lm_batches(VOCAB), epochs=1)


def test_a_batch_without_labels_is_an_error_before_any_step():
    model = tiny_gpt2(VOCAB)
    before = copy.deepcopy(model.state_dict())
    batches = [{k: v for k, v in b.items() if k != "labels"} for b in lm_batches(VOCAB)]
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel returned CausalLMOutputWithCrossAttentions without one.*"
                                         r"\['attention_mask', 'input_ids'\] and no 'labels'.*collator"):
        est.fit(batches, epochs=1)
    assert_tree_equal(model.state_dict(), before)


def test_a_label_column_named_label_is_named_in_the_error():
    model = tiny_gpt2(VOCAB)
    batches = [{"input_ids": b["input_ids"], "label": b["labels"]} for b in lm_batches(VOCAB)]
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match="it has 'label' where GPT2LMHeadModel takes 'labels'"):
        est.fit(batches, epochs=1)


def test_evaluate_reports_the_models_loss_as_val_loss():
    model = tiny_bert(VOCAB)
    batches = classification_batches(VOCAB)
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                    train_metrics=[Accuracy()])
    scores = est.evaluate(batches)
    model.eval()
    with torch.no_grad():
        outs = [model(**b) for b in batches]
    sizes = [len(b["labels"]) for b in batches]
    expected_loss = sum(float(o.loss) * n for o, n in zip(outs, sizes)) / sum(sizes)
    right = sum(int((o.logits.argmax(-1) == b["labels"]).sum()) for o, b in zip(outs, batches))
    assert sorted(scores) == ["val_accuracy", "val_loss"]
    assert scores["val_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert scores["val_accuracy"] == right / sum(sizes)


def test_token_metrics_of_a_causal_lm_use_the_shift_of_its_loss():
    """Accuracy and Perplexity over the tokens the loss predicts: t + 1 from tokens up to t,
    padding (-100) skipped; perplexity of one batch is exp of the model's own loss."""
    model = tiny_gpt2(VOCAB)
    batch = lm_batches(VOCAB, n=1)
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                    train_metrics=[Accuracy(), Perplexity()])
    scores = est.evaluate(batch)
    model.eval()
    with torch.no_grad():
        out = model(**batch[0])
    logits, labels = out.logits[:, :-1], batch[0]["labels"][:, 1:]
    kept = labels != -100
    assert scores["val_perplexity"] == pytest.approx(math.exp(float(out.loss)), rel=1e-5)
    assert scores["val_accuracy"] == int((logits.argmax(-1) == labels)[kept].sum()) / int(kept.sum())


def test_shift_labels_can_be_forced_off():
    model = tiny_gpt2(VOCAB)
    batch = lm_batches(VOCAB, n=1)
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), train_metrics=[Perplexity()],
                    batch_processor=BatchProcessor(shift_labels=False))
    scores = est.evaluate(batch)
    model.eval()
    with torch.no_grad():
        out = model(**batch[0])
    assert scores["val_perplexity"] != pytest.approx(math.exp(float(out.loss)), rel=1e-3)


def test_predict_returns_the_logits():
    model = tiny_gpt2(VOCAB)
    batches = lm_batches(VOCAB, n=2)
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    logits = est.predict(batches)
    model.eval()
    with torch.no_grad():
        expected = torch.cat([model(**b).logits for b in batches])
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_computing_its_own_loss_resumes_exactly(name):
    make_model, make_batches = MODELS[name]

    def make():
        model = make_model()
        return Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))

    assert_resumable(make, make_batches(), epochs=2, stop_at=[1, 4, 6], quiet=True)
