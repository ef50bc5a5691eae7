"""Which steps put Newton-Schulz on a stream of its own (optim/overlap.py): the costliest shape
group goes last, a step overlaps only on CUDA, with two groups or more and no parameter shared
between the last group and the others; ``ns_overlap`` is checked like every key. (That the
overlapped step gives the one-stream step's bits: tests/gpu/test_overlap.py.)"""

import pytest
import torch

from dion3_titan import Dion3
from dion3_titan.optim import overlap

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


def _opt(shapes, names=None, **options):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    group = {"params": params} if names is None else {"params": params, "names": names}
    return Dion3([group], fraction=0.25, **options)


def test_the_costliest_group_goes_last():
    opt = _opt([(64, 32), (1024, 1024), (64, 32), (512, 128)])
    groups = list(opt.shape_groups)
    rest, last = overlap.order(groups, opt.ns_cost)
    assert [tuple(m.layout.local_shape[-2:]) for m in last.members] == [(1024, 1024)]
    assert len(rest) == len(groups) - 1 and last not in rest
    # its cost is the largest by the FLOP model (256 selected rows x 1024 against a square 128
    # batch and two small ones), and the others' together stay under half of it
    assert all(opt.ns_cost(sg) < opt.ns_cost(last) for sg in rest)
    assert sum(opt.ns_cost(sg) for sg in rest) <= overlap.REST_SHARE_MAX * opt.ns_cost(last)
    assert overlap.applies(groups, opt.ns_cost, CUDA)


def test_where_it_does_not_apply():
    opt = _opt([(64, 32), (256, 512)])
    groups = list(opt.shape_groups)
    assert overlap.applies(groups, opt.ns_cost, CUDA)
    assert not overlap.applies(groups, opt.ns_cost, torch.device("cpu"))
    assert not overlap.applies(groups[:1], opt.ns_cost, CUDA)


def test_others_as_costly_as_the_last_keep_one_stream():
    # 128 selected rows x 512 (Gram NS) against a square 128 batch (standard NS): the square
    # one costs more than half of the other
    opt = _opt([(512, 512), (512, 128)])
    groups = list(opt.shape_groups)
    rest, last = overlap.order(groups, opt.ns_cost)
    share = sum(opt.ns_cost(sg) for sg in rest) / opt.ns_cost(last)
    assert overlap.REST_SHARE_MAX < share < 1
    assert not overlap.applies(groups, opt.ns_cost, CUDA)


def test_a_parameter_in_the_last_group_and_another_keeps_one_stream():
    # a fused (96 x 64) weight cut into a 64-row piece (the costliest group) and a 32-row piece,
    # which shares its group with a separate (32 x 64) weight
    names = ["a.wqkv.weight", "b.weight"]
    opt = _opt([(96, 64), (32, 64)], names, split_specs="pattern=a.wqkv.weight;sizes=64,32")
    groups = list(opt.shape_groups)
    assert len(groups) == 2
    _, last = overlap.order(groups, opt.ns_cost)
    assert [m.layout.local_shape[-2] for m in last.members] == [64]
    assert not overlap.applies(groups, opt.ns_cost, CUDA)


def test_ns_overlap_is_checked():
    with pytest.raises(ValueError, match=r"ns_overlap='yes': must be true or false"):
        _opt([(8, 8)], ns_overlap="yes")
    p, q = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match="ns_overlap: every matrix param group must use the same value"):
        Dion3([{"params": [p]}, {"params": [q], "ns_overlap": False}])


def test_lanes_are_decided_once_per_key():
    opt = _opt([(64, 32), (1024, 1024)])
    groups = list(opt.shape_groups)
    calls = []

    def cost(sg):
        calls.append(sg)
        return opt.ns_cost(sg)

    ov = overlap.Overlap()
    lanes = ov.lanes("plan", groups, cost, CUDA)
    assert lanes == overlap.order(groups, opt.ns_cost) and calls
    seen = len(calls)
    assert ov.lanes("plan", groups, cost, CUDA) is lanes and len(calls) == seen  # no second decision
    assert ov.lanes("cpu", groups, cost, torch.device("cpu")) is None
