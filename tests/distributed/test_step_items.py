"""``distributed.StepItems``: what each micro-batch weighs, the divisor of a step's summed gradient,
where the count must be summed over the ranks, and its state."""

from __future__ import annotations

import torch

from estimatorch.distributed import StepItems


def test_full_micro_batches_of_samples_weigh_one_and_the_window_divides_by_their_number():
    items = StepItems(world_size=1, unit=4, ranks_agree=True, accumulation_steps=3)
    loss = torch.tensor(2.0)
    assert items.weigh(loss, 4) is loss and items.weigh(loss, 4) is loss  # not even multiplied
    assert float(items.weigh(loss, 2)) == 1.0  # an uneven one: its share of a full one
    assert items.divisor(averaged=False) == 2.5 and items.weighed
    items.reset()
    assert items.local == 0 and not items.weighed


def test_counts_of_labels_weigh_by_the_count_and_a_micro_batch_without_any_is_zero_not_nan():
    items = StepItems(world_size=1, unit=None, ranks_agree=True, accumulation_steps=2)
    assert float(items.weigh(torch.tensor(1.5), torch.tensor(4))) == 6.0
    assert float(items.weigh(torch.tensor(float("nan")), torch.tensor(0))) == 0.0  # a mean over nothing
    divisor = items.divisor(averaged=False)
    assert isinstance(divisor, torch.Tensor) and divisor.dtype == torch.float32 and float(divisor) == 4.0
    items.reset()
    items.weigh(torch.tensor(1.0), torch.tensor(0))
    assert float(items.divisor(averaged=False)) == 1.0  # no item in the whole step: its gradient is 0 anyway


def test_a_sum_loss_weighs_one_unit_and_counts_its_items():
    items = StepItems(world_size=1, unit=4, ranks_agree=True, accumulation_steps=2)
    assert float(items.weigh(torch.tensor(8.0), 4, mean=False)) == 2.0
    assert items.divisor(averaged=False) == 1.0


def test_one_micro_batch_per_rank_with_agreeing_counts_is_not_weighed_at_all():
    """The DDP step of before: every rank's batch holds as many samples, the weights cancel."""
    items = StepItems(world_size=2, unit=4, ranks_agree=True, accumulation_steps=1)
    loss = torch.tensor(3.0)
    assert items.weigh(loss, 3) is loss and not items.weighed and items.collectives == 0


def test_under_ddp_the_divisor_is_over_the_ranks_and_agreeing_or_laid_out_counts_need_no_collective():
    agree = StepItems(world_size=2, unit=4, ranks_agree=True, accumulation_steps=2)
    agree.weigh(torch.tensor(1.0), 4)
    agree.weigh(torch.tensor(1.0), 2)
    assert agree.divisor(averaged=True) == 1.5 and agree.divisor(averaged=False) == 3.0
    laid_out = StepItems(world_size=2, unit=4, ranks_agree=False, accumulation_steps=1,
                         step_total=lambda step: 14 if step == 1 else 16)  # an elastic layout's last step
    laid_out.weigh(torch.tensor(1.0), 4)
    assert laid_out.divisor(averaged=False, step=1) == 3.5 and laid_out.collectives == 0


def test_the_state_of_a_window_round_trips():
    items = StepItems(world_size=1, unit=None, ranks_agree=True, accumulation_steps=3)
    items.weigh(torch.tensor(1.0), 5)
    state = items.state_dict()
    assert state == {"local": 5, "unit": 5}
    fresh = StepItems(world_size=1, unit=None, ranks_agree=True, accumulation_steps=3)
    fresh.load_state_dict(state)
    fresh.weigh(torch.tensor(1.0), 5)
    assert fresh.divisor(averaged=False) == 2.0 and fresh.weighed
