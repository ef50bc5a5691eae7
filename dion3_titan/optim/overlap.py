"""The costliest shape group beside the others: the matrix pipeline on two CUDA streams.

A step's Newton-Schulz keeps the tensor cores busy and reads little; its accumulate, pack and
update stream momentum and weights through memory; the NS of the small groups is a string of
~20 µs launches that leave most SMs idle. One after the other, each leaves the others'
resources idle. On one GPU the shape group with the most NS FLOPs runs its whole pipeline
(accumulate to update) on a stream of its own, at the highest priority, while the other groups
run theirs on the step's stream:

    own stream:   acc(last) sel(last) pack(last) NS(last) ................. update(last, selected rows)
    step stream:  acc(rest) | r1: pack NS update | r2: ... | decay(last, other rows) | counters(last)

The own stream's persistent kernels leave ``sms_left`` SMs (a sixth) to the step stream, whose
passes and small products run there beside them (kernels/tma.py, ``leave_sms``). With weight
decay, the last group's update is split where its stages allow it (``Stages.splits_decay``):
the rows it did not select only decay, which needs nothing past its selection, so the step
stream does that pass (most of the update's bytes at f < 1) after its own groups, and the update
after the Newton-Schulz visits the selected rows alone. (Where the step stream's groups outlast
the large Newton-Schulz, as at the llama3-1B and 7b shapes, that pass runs last, on the whole
GPU: scripts/profile_timeline.py.) The two touch disjoint rows with the same
arithmetic. Each group runs the kernels it runs alone, on its own inputs, so the results are
bit-identical (tests/gpu/test_overlap.py). The step's counters (non-finite NS results, the
metrics) read and add shared tensors: the last group's are taken on the step stream once the
streams have joined.

It applies where no shape group's rows leave the process (one GPU): every collective stays on
one stream in one order that way; and where the other groups' Newton-Schulz is small beside
the last one's (``REST_SHARE_MAX``), as at f < 1. The decision depends on the plan only and is
made once per set of groups. ``ns_overlap = false`` runs the groups one after another.
Measured: docs/benchmarks.md, "The costliest group on a stream of its own".
"""

from collections.abc import Callable, Hashable, Sequence

import torch

from dion3_titan.dist.plan import ShapeGroup
from dion3_titan.kernels.tma import leave_sms, num_sms
from dion3_titan.optim.stages import Aside, Outcome

# Share of the SMs the own stream's persistent kernels leave to the step stream: on one H200
# (132 SMs), 16 and 24 were the fastest of 0, 8, 16, 24 and 32 at the llama3-1B and 7B shapes
SMS_LEFT_SHARE = 1 / 6


# The overlap pays where the other groups are memory passes and small products beside one
# large Newton-Schulz: their NS FLOPs at most this share of the last group's (llama3-1B and 7b
# shapes: 8% and 18% at f = 1/4, 30% and 28% at f = 1/2). At f = 1 the other groups together
# cost more than the last (111%, 118%): the step stream then finds no idle SMs, and the SMs left
# to it slow the large Newton-Schulz. 7b, Muon flavor, f = 1, captured: 155.1 ms overlapped
# against 147.4 ms on one stream in an earlier call.
REST_SHARE_MAX = 0.5


def sms_left(device: torch.device) -> int:
    return round(num_sms(device) * SMS_LEFT_SHARE)


def order(groups: Sequence[ShapeGroup], cost: Callable[[ShapeGroup], float]) -> tuple[list[ShapeGroup], ShapeGroup]:
    """(the other groups in plan order, the group of the largest ``cost``; the first of equals)."""
    last = max(groups, key=cost)
    return [sg for sg in groups if sg is not last], last


def applies(groups: Sequence[ShapeGroup], cost: Callable[[ShapeGroup], float], device: torch.device) -> bool:
    """Whether a step of ``groups`` overlaps: on CUDA, with two groups or more, none whose rows
    leave the process, the others' ``cost`` at most ``REST_SHARE_MAX`` of the last group's, and
    the last group's parameters in no other group (each stream accumulates the momentum of its
    own groups' parameters)."""
    if device.type != "cuda" or len(groups) < 2 or any(sg.moves_data for sg in groups):
        return False
    rest, last = order(groups, cost)
    if sum(cost(sg) for sg in rest) > REST_SHARE_MAX * cost(last):
        return False
    own = {id(m.param) for m in last.members}
    return not any(id(m.param) in own for sg in rest for m in sg.members)


class Overlap:
    """The costliest group's own stream (one per device, made on first use), the lanes of each
    set of groups, and the schedule above."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lanes: dict[Hashable, tuple[list[ShapeGroup], ShapeGroup] | None] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            # the highest priority: its kernels' programs take the SMs as they come free
            self._streams[device] = torch.cuda.Stream(device, priority=-1)
        return self._streams[device]

    def lanes(
        self, key: Hashable, groups: Sequence[ShapeGroup], cost: Callable[[ShapeGroup], float], device: torch.device
    ) -> tuple[list[ShapeGroup], ShapeGroup] | None:
        """``order(groups)`` where the step ``applies``, else None; decided once per ``key``
        (the caller's name for this set of groups and their settings), not every step."""
        if key not in self._lanes:
            self._lanes[key] = order(groups, cost) if applies(groups, cost, device) else None
        return self._lanes[key]

    def run(
        self,
        lanes: tuple[list[ShapeGroup], ShapeGroup],
        device: torch.device,
        pipeline: Callable[[list[ShapeGroup], Callable[[Outcome], None], Aside | None], None],
        account: Callable[[Outcome], None],
    ) -> None:
        """One step of ``lanes`` (from ``lanes``): ``pipeline(lane, account, aside)`` runs a list
        of groups from accumulate to update, hands each group's outcome to ``account`` and work
        that may run beside it to ``aside``: the last group's goes to the step stream, after
        the other groups' pipelines (while the last group's Newton-Schulz runs)."""
        rest, last = lanes
        step, own = torch.cuda.current_stream(device), self.stream(device)
        later: list[Outcome] = []
        handed: list[tuple[torch.cuda.Event, Callable[[], None]]] = []

        def aside(work: Callable[[], None]) -> None:
            ready = torch.cuda.Event()
            ready.record(own)
            handed.append((ready, work))

        own.wait_stream(step)
        with torch.cuda.stream(own), leave_sms(sms_left(device)):
            pipeline([last], later.append, aside)
        pipeline(rest, account, None)
        for ready, work in handed:
            step.wait_event(ready)
            work()
        step.wait_stream(own)
        # joined: the last group's counters, and its buffers may be freed (the own stream's
        # next work waits for everything the step stream has queued by then)
        for out in later:
            account(out)
