"""Adapter-only checkpoints: a PEFT LoRA model's checkpoint holds the trainable parameters, the
optimizer and a fingerprint of the frozen base (under 30 % of the whole model's file), resumes
bitwise onto the same base, is refused onto another naming the first parameter that differs, and
still gives the adapter (save_pretrained) and the merged model."""

from __future__ import annotations

import os

import pytest
import torch

from estimatorch import CheckpointHandler, Estimator, checkpoint
from estimatorch.checkpoint import CheckpointError
from tests.conftest import assert_tree_equal, ctrl_c_at, losses_recorder
from tests.hf_models import lm_batches, tiny_gpt2

peft = pytest.importorskip("peft")  # pinned in requirements-dev.txt: present in CI

VOCAB, WIDTH = 200, 64  # a base of 113 k parameters: its bytes, not the run's state, dominate a full checkpoint


def lora_gpt2(seed: int = 0):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1, fan_in_fan_out=True)
    return peft.get_peft_model(tiny_gpt2(VOCAB, seed=seed, width=WIDTH), config)


def lora_estimator(seed: int = 0) -> Estimator:
    model = lora_gpt2(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    return Estimator(model, optimizer=torch.optim.AdamW(params, lr=1e-2))


BATCHES = lm_batches(VOCAB, n=4)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 2 epochs, checkpoints every 2 steps, adapter-only and with the base."""
    directory = tmp_path_factory.mktemp("lora")
    losses, recorder = losses_recorder()
    est = lora_estimator()
    est.fit(BATCHES, epochs=2, event_handlers=[recorder, CheckpointHandler(directory / "adapter", batch_period=2),
                                               CheckpointHandler(directory / "full", batch_period=2,
                                                                 model_prefix="full", save_frozen=True)])
    return est, losses, directory


def test_a_lora_checkpoint_is_under_30_percent_of_the_full_one(uninterrupted):
    _, _, directory = uninterrupted
    adapter = os.path.getsize(directory / "adapter" / "model-epoch2batch8.pt")
    full = os.path.getsize(directory / "full" / "full-epoch2batch8.pt")
    assert adapter < 0.3 * full, (adapter, full)
    payload = checkpoint.load(directory / "adapter" / "model-epoch2batch8.pt")
    assert payload["model"] and all("lora_" in key for key in payload["model"])  # tiny GPT-2 has no buffers
    assert set(payload["frozen"]) == set(checkpoint.frozen_keys(lora_gpt2()))
    assert "frozen" not in checkpoint.load(directory / "full" / "full-epoch2batch8.pt")


def test_a_lora_checkpoint_resumes_bitwise_onto_the_same_base(uninterrupted, tmp_path):
    est, losses, _ = uninterrupted
    first, recorder = losses_recorder()
    with pytest.raises(KeyboardInterrupt):
        lora_estimator().fit(BATCHES, epochs=2, event_handlers=[
            recorder, CheckpointHandler(tmp_path, batch_period=2, resume_from_checkpoint=True), ctrl_c_at(5)])
    rest, recorder = losses_recorder()
    resumed = lora_estimator()  # a new process's model: the base built again, the adapter from the file
    resumed.fit(BATCHES, epochs=2, event_handlers=[
        recorder, CheckpointHandler(tmp_path, batch_period=2, resume_from_checkpoint=True)])
    assert first + rest == losses
    assert_tree_equal(resumed.net.state_dict(), est.net.state_dict())
    assert_tree_equal(resumed.optimizer.state_dict(), est.optimizer.state_dict())


def test_another_base_is_refused_naming_the_first_frozen_parameter(uninterrupted, tmp_path):
    _, _, directory = uninterrupted
    other = lora_estimator(seed=1)  # the same architecture over other base weights
    before = {k: v.clone() for k, v in other.net.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"frozen parameter 'base_model.model.transformer.wte.weight' of "
                                              r"this net differs .*values.*save_frozen=True"):
        checkpoint.load_into(other.net, directory / "adapter" / "model-epoch2batch8.pt")
    assert_tree_equal(other.net.state_dict(), before)  # nothing was loaded


def test_the_adapter_and_the_merged_model_come_from_a_lora_checkpoint(uninterrupted, tmp_path):
    est, _, directory = uninterrupted
    fresh = checkpoint.load_into(lora_gpt2(), directory / "adapter")  # the newest checkpoint
    assert_tree_equal(fresh.state_dict(), est.net.state_dict())
    fresh.save_pretrained(str(tmp_path / "adapter"))
    loaded = peft.PeftModel.from_pretrained(tiny_gpt2(VOCAB, width=WIDTH), str(tmp_path / "adapter")).eval()
    merged = fresh.merge_and_unload().eval()
    ids = BATCHES[0]["input_ids"]
    with torch.no_grad():
        reference = est.net.eval()(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, reference)
        torch.testing.assert_close(merged(input_ids=ids).logits, reference)  # merged: folded into the base
