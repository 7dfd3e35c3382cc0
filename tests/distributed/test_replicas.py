"""The training state's fingerprint is exact: any change of one value's bits changes it (where a
float sum would not see the change), in any dtype; changes that cancel in a plain sum of the bits,
and values that swap places, count too; the ranks that differ are told from the fingerprint most
ranks hold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch.distributed import differing_ranks, state_fingerprint, state_tensors


def fingerprint(*tensors):
    return int(state_fingerprint(list(tensors)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int8, torch.bool, torch.complex64])
def test_any_one_value_changed_changes_the_fingerprint(dtype):
    torch.manual_seed(0)
    base = (torch.randn(5, 7) * 10).to(dtype)
    seen = {fingerprint(base)}
    for index in [(0, 0), (2, 3), (4, 6)]:
        moved = base.clone()
        raw = moved.view(torch.uint8) if dtype in (torch.bool, torch.complex64) else moved.view(torch.int8) \
            if dtype == torch.int8 else moved.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[moved.element_size()])
        flat = raw.reshape(-1) if raw.is_contiguous() else raw
        flat[index[0] * 7 + index[1]] ^= 1  # its lowest bit (a bool's value), the smallest change there is
        seen.add(fingerprint(moved))
    assert len(seen) == 4  # each differs from the base and from each other


def test_a_chunked_tensor_is_mixed_across_chunks(monkeypatch):
    from estimatorch.distributed import _replicas

    x = torch.randn(100)
    whole = fingerprint(x)
    monkeypatch.setattr(_replicas, "CHUNK", 7)
    assert fingerprint(x) == whole  # the chunks' sums are the whole's: indices are the tensor's, not the chunk's


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.float32, torch.int32])
def test_taking_the_fingerprint_changes_nothing_it_reads(dtype):
    x = (torch.randn(1000) * 100).to(dtype)
    before = x.clone()
    fingerprint(x)
    assert torch.equal(x, before)  # an int64 view is not mixed in place


def test_changes_a_float_sum_cannot_see_are_seen():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.5, 1.5])
    assert a.sum() == b.sum() and a.view(torch.int32).sum() == b.view(torch.int32).sum()  # a plain sum of bits too
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))
    big, small = torch.tensor([1e8, 1.0]), torch.tensor([1e8, 0.0])
    assert big.sum() == small.sum() and fingerprint(big) != fingerprint(small)  # 1.0 vanishes in the float sum


def test_the_order_of_the_state_counts_and_equal_states_agree():
    x, y = torch.randn(3), torch.randn(4)
    assert fingerprint(x, y) == fingerprint(x.clone(), y.clone())
    assert fingerprint(x, y) != fingerprint(y, x)
    assert fingerprint(torch.tensor([True, False])) != fingerprint(torch.tensor([False, True]))  # places count
    assert fingerprint(torch.tensor([1.0, 2.0])) != fingerprint(torch.tensor([2.0, 1.0]))


def test_the_state_is_the_parameters_then_the_optimizer_tensors_buffers_left_out():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    tensors = state_tensors(net, optimizer)
    params = list(net.parameters())
    state = [optimizer.state[p][key] for p in params for key in sorted(optimizer.state[p])]
    assert len(tensors) == len(params) + len(state)
    assert all(t is p or torch.equal(t, p) for t, p in zip(tensors, params + state))
    before = fingerprint(*tensors)
    net[1].running_mean += 1  # a buffer: each DDP rank's own
    assert fingerprint(*state_tensors(net, optimizer)) == before
    optimizer.state[params[0]]["exp_avg"][0, 0] += 1e-7
    assert fingerprint(*state_tensors(net, optimizer)) != before


@pytest.mark.parametrize("values, expected", [
    ([5, 5, 5], (5, [])), ([5, 6, 5, 5], (5, [1])), ([5, 6], (5, [1])), ([6, 5], (6, [1])),
    ([1, 2, 2, 1], (1, [1, 2])), ([1, 2, 3], (1, [1, 2])),
])
def test_the_ranks_that_differ_are_those_off_the_most_held_fingerprint(values, expected):
    assert differing_ranks(values) == expected


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_it_waits_for_nothing_and_equals_the_cpus():
    torch.manual_seed(0)
    params = [torch.randn(300, 7, device="cuda"), torch.randn(5, device="cuda", dtype=torch.bfloat16)]
    steps = [torch.tensor(12.0)]  # an optimizer's step count on the CPU beside them
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host-device synchronisation raises
    try:
        on_device = state_fingerprint(params + steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert on_device.device.type == "cuda"
    assert int(on_device) == fingerprint(*[t.cpu() for t in params], *steps)  # a GPU's checkpoint checks on a CPU
