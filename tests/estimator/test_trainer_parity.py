"""What a ``transformers.Trainer`` user expects, on a tiny BERT classifier from a config:
step-level evaluation (logged, kept in ``History`` with its step), the best checkpoint holding the
weights that were evaluated (eval and save periods that differ, per-epoch validation with batch
saves), the best restored at the end, early stopping counted in validations."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from estimatorch import CheckpointHandler, EarlyStoppingHandler, Estimator, ValidationHandler
from estimatorch.checkpoint import load, load_model_state, load_weights
from tests.conftest import assert_tree_equal, ctrl_c_at
from tests.hf_models import classification_batches, tiny_bert

VOCAB = 40
TRAIN = classification_batches(VOCAB, n=9, size=4, seed=0)  # 9 steps an epoch
VAL = classification_batches(VOCAB, n=2, size=8, seed=1)


def bert_estimator(lr: float = 5e-3) -> Estimator:
    model = tiny_bert(VOCAB)
    return Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=lr))


def evaluated(weights: dict) -> float:
    """``val_loss`` of a fresh model holding ``weights``."""
    est = bert_estimator()
    load_model_state(est.net, weights)
    return est.evaluate(VAL)["val_loss"]


class WeightsAtValidations:
    """The weights at every validation (as the notice hears it): what each one measured."""

    def __init__(self):
        self.weights = {}

    def validation_end(self, estimator, *, step, **kwargs):
        self.weights[step] = copy.deepcopy(estimator.net.state_dict())


def notice_recorder():
    from estimatorch.events import Handler, ValidationEnd

    class Recorder(WeightsAtValidations, Handler, ValidationEnd):
        pass

    return Recorder()


@pytest.fixture(scope="module")
def step_validated(tmp_path_factory):
    """One fit of 2 epochs validated every 3 steps, saving every 2 with the best file."""
    directory = tmp_path_factory.mktemp("every3save2")
    est = bert_estimator()
    recorder = notice_recorder()
    records = []

    import logging

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("estimatorch")
    collect = Collect()
    logger.addHandler(collect)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every test runs (the autouse fixture comes after a module's)
    try:
        history = est.fit(TRAIN, epochs=2, event_handlers=[
            ValidationHandler(VAL, est.evaluate, epoch_period=None, batch_period=3),
            CheckpointHandler(directory, batch_period=2, epoch_period=None, save_best=True, monitor="val_loss",
                              max_checkpoints=None),
            recorder])
    finally:
        logger.removeHandler(collect)
        torch.set_num_threads(threads)
    return est, history, recorder, records, directory


def test_six_step_level_validations_in_two_epochs_are_logged_and_kept(step_validated):
    est, history, recorder, records, _ = step_validated
    validations = history.validations
    assert validations.steps == [3, 6, 9, 12, 15, 18]
    assert validations.epochs == [1, 1, 1, 2, 2, 2]
    lines = [line for line in records if "Validation:" in line]
    assert len(lines) == 6
    for line, step, epoch, loss in zip(lines, validations.steps, validations.epochs, validations["val_loss"]):
        assert line.startswith(f"[Epoch {epoch}/2][Step {step}] Validation: val_loss: {loss:.4f}")
    # each recorded value is what the weights of that step evaluate to
    for step, loss in zip(validations.steps, validations["val_loss"]):
        assert evaluated(recorder.weights[step]) == loss
    # the epoch rows keep the epoch's last validation, as before
    assert history["val_loss"] == [validations["val_loss"][2], validations["val_loss"][5]]


def test_the_best_file_holds_the_weights_that_were_evaluated(step_validated):
    """Validation every 3 steps, saves every 2: the best file is written at its validation."""
    _, history, _, _, directory = step_validated
    losses = history.validations["val_loss"]
    best = min(losses)
    best_step = history.validations.steps[losses.index(best)]
    payload = load(directory / "model-best.pt")
    state = payload["ranks"][0]["handlers"]["CheckpointHandler"]
    assert (state["best"], state["best_step"]) == (best, best_step)
    assert payload["ranks"][0]["position"]["step"] == best_step
    assert evaluated(load_weights(directory / "model-best.pt")) == best


def test_per_epoch_validation_with_batch_saves_writes_the_best_at_its_validation(tmp_path):
    """The reported case: save_best at batch saves every 5 steps, validation per epoch."""
    est = bert_estimator()
    history = est.fit(TRAIN, VAL, epochs=3, event_handlers=[
        CheckpointHandler(tmp_path, batch_period=5, epoch_period=None, save_best=True, monitor="val_loss")])
    best = min(history["val_loss"])
    state = load(tmp_path / "model-best.pt")["ranks"][0]["handlers"]["CheckpointHandler"]
    assert state["best"] == best
    assert state["best_step"] == 9 * (history["val_loss"].index(best) + 1)  # the end of the best epoch
    assert evaluated(load_weights(tmp_path / "model-best.pt")) == best


def test_restore_best_loads_the_best_files_weights_at_the_end(tmp_path):
    est = bert_estimator()
    history = est.fit(TRAIN, epochs=2, event_handlers=[
        ValidationHandler(VAL, est.evaluate, epoch_period=None, batch_period=3),
        CheckpointHandler(tmp_path, batch_period=4, epoch_period=None, save_best=True, monitor="val_loss",
                          restore_best=True)])
    assert_tree_equal(est.net.state_dict(), load_weights(tmp_path / "model-best.pt"))
    assert est.evaluate(VAL)["val_loss"] == min(history.validations["val_loss"])


def test_restore_best_needs_a_best_file():
    with pytest.raises(ValueError, match="restore_best=True .* save_best=True"):
        CheckpointHandler("unused", restore_best=True)


def test_early_stopping_counts_step_level_validations():
    """patience in validations: the stop comes at the boundary of the first validation that
    did not improve (patience=1), mid-epoch, and restore_best_weights gives the weights the
    best validation measured."""
    est = bert_estimator(lr=1.5e-2)  # a rate at which the validation loss goes up and down
    recorder = notice_recorder()
    stopper = EarlyStoppingHandler("val_loss", patience=1, restore_best_weights=True)
    history = est.fit(TRAIN, epochs=2, event_handlers=[
        ValidationHandler(VAL, est.evaluate, epoch_period=None, batch_period=3), stopper, recorder])
    losses = history.validations["val_loss"]
    assert all(later < earlier for earlier, later in zip(losses[:-2], losses[1:-1]))  # improving until
    assert not losses[-1] < min(losses[:-1])  # the last did not improve: it stopped there
    assert len(losses) < 6 and est.position.step == 3 * len(losses) == history.validations.steps[-1]
    assert stopper.best_step == 3 * (len(losses) - 1)
    assert_tree_equal(est.net.state_dict(), recorder.weights[stopper.best_step])


def test_step_level_validations_survive_a_resume(step_validated):
    """Ctrl-C at step 10, then fit(resume=True): the same validations, values and steps."""
    est = bert_estimator()
    handlers = [ValidationHandler(VAL, est.evaluate, epoch_period=None, batch_period=3)]
    with pytest.raises(KeyboardInterrupt):
        est.fit(TRAIN, epochs=2, event_handlers=[*handlers, ctrl_c_at(10)])
    history = est.fit(TRAIN, epochs=2, event_handlers=handlers, resume=True)
    reference = step_validated[1].validations
    assert history.validations.to_dict() == reference.to_dict()
    assert not any(math.isnan(v) for v in history.validations["val_loss"])
    assert re.fullmatch(r"Validations\(steps=\[3, .*18\], metrics=\['val_loss'\]\)", repr(history.validations))


# -- schedules in their unit ---------------------------------------------------------------------
def test_a_warmup_factory_reaches_its_peak_without_an_interval():
    """``lr_scheduler=lambda opt, total: get_linear_schedule_with_warmup(opt, 6, total)`` and
    nothing else: sized with the optimizer steps and stepped after each, as Trainer does."""
    from transformers import get_linear_schedule_with_warmup

    from estimatorch.events import BatchBegin, Handler

    model = tiny_bert(VOCAB)
    sizes, rates = [], []

    def factory(optimizer, total):
        sizes.append(total)
        return get_linear_schedule_with_warmup(optimizer, 6, total)

    class Rates(Handler, BatchBegin):
        def batch_begin(self, estimator, **kwargs):
            rates.append(estimator.optimizer.param_groups[0]["lr"])

    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), lr_scheduler=factory)
    est.fit(TRAIN, epochs=2, event_handlers=[Rates()])
    assert sizes == [est.planned_steps(TRAIN, epochs=2)] == [18]
    reference = torch.optim.AdamW(tiny_bert(VOCAB).parameters(), lr=1e-3)
    schedule = get_linear_schedule_with_warmup(reference, 6, 18)
    expected = []
    for _ in range(18):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        schedule.step()
    assert rates == expected  # Trainer's rates, step for step
    assert max(rates) == rates[6] == 1e-3


def test_a_warmup_scheduler_stepped_per_epoch_is_named_in_a_warning():
    """A scheduler *object* keeps PyTorch's per-epoch default; one counted in optimizer steps
    then ends long after the plan, which fit says, naming lr_scheduler_interval."""
    from transformers import get_linear_schedule_with_warmup

    model = tiny_bert(VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    est = Estimator(model, optimizer=optimizer, lr_scheduler=get_linear_schedule_with_warmup(optimizer, 6, 18))
    with pytest.warns(UserWarning, match=r"LambdaLR is stepped every epoch and ends after 18 epochs, but .* "
                                         r"takes 2 .*lr_scheduler_interval='batch'"):
        est.fit(TRAIN, epochs=2)


# -- datasets as they come -----------------------------------------------------------------------
def text_rows(n: int = 24, seed: int = 0) -> dict:
    """Tokenized rows of several lengths with the text column a newcomer leaves in."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return {"text": [f"sentence {i}" for i in range(n)],
            "input_ids": [torch.randint(6, VOCAB, (k,), generator=g).tolist() for k in lengths],
            "attention_mask": [[1] * k for k in lengths],
            "label": torch.randint(0, 3, (n,), generator=g).tolist()}


@pytest.fixture(scope="module")
def hf_rows():
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict(text_rows())


def test_a_datasets_dataset_trains_with_batch_size_its_text_column_dropped(hf_rows, estimatorch_log):
    """fit(ds, batch_size=8): the same steps as the DataLoader a user would write without the
    text column, padded; the column is named once in the log."""
    from torch.utils.data import DataLoader

    from estimatorch.collate import PadCollate
    from tests.conftest import losses_recorder

    losses, recorder = losses_recorder()
    est = bert_estimator()
    est.fit(hf_rows, epochs=2, batch_size=8, event_handlers=[recorder])
    dropped = [r.getMessage() for r in estimatorch_log if "are dropped" in r.getMessage()]
    assert dropped == ["train_data: the columns ['text'] are not arguments of BertForSequenceClassification.forward "
                       "and are dropped (as Trainer does)"]
    expected, reference = losses_recorder()
    by_hand = bert_estimator()
    loader = DataLoader(hf_rows.remove_columns(["text"]), batch_size=8, shuffle=True, collate_fn=PadCollate(0))
    by_hand.fit(loader, epochs=2, event_handlers=[reference])
    assert len(losses) == 6 and losses == expected
    assert_tree_equal(est.net.state_dict(), by_hand.net.state_dict())
    # evaluate and predict take it alike, in order
    assert est.evaluate(hf_rows, batch_size=5) == est.evaluate(DataLoader(hf_rows.remove_columns(["text"]),
                                                                          batch_size=5, collate_fn=PadCollate(0)))
    assert est.predict(hf_rows, batch_size=7).shape == (len(hf_rows), 3)


def test_a_dataset_resumes_exactly_mid_epoch(hf_rows):
    from tests.conftest import losses_recorder

    losses, recorder = losses_recorder()
    est = bert_estimator()
    est.fit(hf_rows, epochs=2, batch_size=8, event_handlers=[recorder])
    resumed_losses, resumed_recorder = losses_recorder()
    resumed = bert_estimator()
    with pytest.raises(KeyboardInterrupt):
        resumed.fit(hf_rows, epochs=2, batch_size=8, event_handlers=[resumed_recorder, ctrl_c_at(4)])
    resumed.fit(hf_rows, epochs=2, batch_size=8, event_handlers=[resumed_recorder], resume=True)
    assert resumed_losses == losses
    assert_tree_equal(resumed.net.state_dict(), est.net.state_dict())


def test_a_datasets_dataset_without_batch_size_is_refused_naming_the_fix(hf_rows):
    est = bert_estimator()
    before = copy.deepcopy(est.net.state_dict())
    with pytest.raises(TypeError, match=r"train_data is a datasets.Dataset of 24 rows, not an iterable of batches: "
                                        r"pass batch_size= .* or a DataLoader\(ds, batch_size=16"):
        est.fit(hf_rows, epochs=1)
    with pytest.raises(TypeError, match=r"val_data is a datasets.Dataset"):
        est.evaluate(hf_rows)
    assert_tree_equal(est.net.state_dict(), before)


def test_a_text_column_a_transformers_collator_would_meet_is_named(hf_rows, tmp_path):
    """The user's own DataLoader with DataCollatorWithPadding and the text left in: named before
    any step, instead of transformers' "Unable to create tensor" at the first batch."""
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding

    from tests.hf_models import train_tokenizer, write_corpus

    tokenizer = train_tokenizer(write_corpus(str(tmp_path)))
    loader = DataLoader(hf_rows, batch_size=8, collate_fn=DataCollatorWithPadding(tokenizer))
    with pytest.raises(ValueError, match=r"train_data: the text columns \['text'\] .*ds.remove_columns\(\['text'\]\)"):
        bert_estimator().fit(loader, epochs=1)
    bert_estimator().fit(DataLoader(hf_rows.remove_columns(["text"]), batch_size=8,
                                    collate_fn=DataCollatorWithPadding(tokenizer)), epochs=1)  # the fix trains


def test_a_torch_dataset_of_dict_rows_drops_what_forward_does_not_take(estimatorch_log):
    rows = text_rows(12)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return {key: column[i] for key, column in rows.items()}

    history = bert_estimator().fit(Rows(), epochs=1, batch_size=4)
    assert len(history["train_loss"]) == 1
    assert any("the columns ['text'] are not arguments" in r.getMessage() for r in estimatorch_log)


def test_two_eval_sets_give_two_val_losses(hf_rows, estimatorch_log):
    """val_data={"a": ..., "b": ...}: val_a_loss and val_b_loss, each what evaluating that set
    alone gives; a monitor of val_loss follows the first set's, val_b_loss chooses the other."""
    sets = {"a": hf_rows.select(range(8)), "b": hf_rows.select(range(8, 24))}
    est = bert_estimator()
    first = EarlyStoppingHandler("val_loss", patience=5)
    second = EarlyStoppingHandler("val_b_loss", patience=5)
    history = est.fit(hf_rows, val_data=sets, epochs=2, batch_size=8, event_handlers=[first, second])
    assert history.metrics == ["train_loss", "val_a_loss", "val_b_loss"]
    assert first.monitor.name == "val_a_loss" and second.monitor.name == "val_b_loss"
    assert any("EarlyStoppingHandler monitors val_loss: the first eval set's val_a_loss" in r.getMessage()
               for r in estimatorch_log)
    alone = {name: est.evaluate(data, batch_size=8)["val_loss"] for name, data in sets.items()}
    assert (history["val_a_loss"][-1], history["val_b_loss"][-1]) == (alone["a"], alone["b"])
    both = est.evaluate(sets, batch_size=8)
    assert both == {"val_a_loss": alone["a"], "val_b_loss": alone["b"]}
    assert [m.name for m in est.val_metrics] == ["val_a_loss", "val_b_loss"]  # outside fit: the last data's
    est.evaluate(sets["a"], batch_size=8)
    assert [m.name for m in est.val_metrics] == ["val_loss"]


def test_a_custom_loss_on_a_model_output_names_the_fix():
    """Trainer's compute_loss habit: loss(outputs, labels) and Accuracy() on the same outputs."""
    from estimatorch.metrics import Accuracy

    model = tiny_bert(VOCAB)
    est = Estimator(model, lambda out, labels: torch.nn.functional.cross_entropy(out.logits, labels),
                    train_metrics=[Accuracy()], optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(TypeError, match=r"train_accuracy.update\(preds, target\) got a SequenceClassifierOutput, "
                                        r"the model's whole output .*Estimator\(model, optimizer=...\) without a loss"):
        est.fit(TRAIN, epochs=1)


# -- label smoothing -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bert-classifier", "gpt2"])
def test_label_smoothing_is_trainers_label_smoother(name):
    """BatchProcessor(label_smoothing=0.1): the loss of Trainer's LabelSmoother on the same
    logits (shifted for a causal LM), for training and evaluation."""
    from transformers.trainer_pt_utils import LabelSmoother

    from estimatorch import BatchProcessor
    from estimatorch.event_handlers import BatchEnd
    from tests.hf_models import lm_batches, tiny_gpt2

    model = tiny_bert(VOCAB) if name == "bert-classifier" else tiny_gpt2(VOCAB)
    batches = TRAIN[:2] if name == "bert-classifier" else lm_batches(VOCAB, n=2)
    reference = copy.deepcopy(model)
    seen = []

    class Losses(BatchEnd):
        def batch_end(self, estimator, *, loss, **kwargs):
            seen.append(loss.detach().clone())

    est = Estimator(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),  # lr 0: the weights stay
                    batch_processor=BatchProcessor(label_smoothing=0.1))
    est.fit(batches, epochs=1, event_handlers=[Losses()])
    smoother = LabelSmoother(epsilon=0.1)
    reference.train()
    for batch, loss in zip(batches, seen):
        torch.manual_seed(0)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            reference.eval()  # (dropout off for the comparison: the estimator's step drew its own masks)
            expected = smoother(reference(**inputs), batch["labels"], shift_labels=name == "gpt2")
            est.net.eval()
            got = est.batch_processor.evaluate_batch(est, batch)[3]
        torch.testing.assert_close(got, expected)
        assert loss.shape == ()
    with torch.no_grad():
        own = reference(**batches[0]).loss  # the model's own loss differs: smoothing took its place
    assert not torch.equal(own, est.batch_processor.evaluate_batch(est, batches[0])[3])
    with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\), got 1.5"):
        BatchProcessor(label_smoothing=1.5)
