"""Capture the whole optimizer step once and replay it (paper Sec. 6, App. D.2).

Row selection, the gathers, Gram NS, the scatters, the fused updates and AdamW issue many
small kernels; replaying a CUDA graph turns their host cost into one launch. The learning
rate and the matrices' weight decay stay live: they are device tensors refreshed before every
replay, so LR schedules (torchtitan's LambdaLR) still apply; only turning a matrix group's
weight decay on or off (from or to 0) re-captures. An AdamW group's weight decay, betas and
eps are constants of the graph: changing one re-captures. Non-finite gradients are
handled on the device as in an eager step, and the host reads a replay's flag at the next
``step()`` as it does an eager step's (optim/nonfinite.py): "raise" raises there, with nothing
of the bad step applied.

A step given the gradients' norm (``use_gradient_norm``) takes its flag from the guard's norm
buffer, which the norm is copied into before the replay; a step without one makes its own pass
over the gradients. The two are different graphs, so whether a norm is given is part of the
signature: a step of the other kind re-captures (after one eager step of that kind, as any
re-capture). That keeps each graph one path with nothing decided inside it; a trainer gives a
norm every step or never, so in practice it is captured once.
"""

import weakref

import torch

from dion3_titan.dist.comm import CommStats
from dion3_titan.dist.layout import to_local
from dion3_titan.optim.moving_grads import MovingGradients

_live: "weakref.WeakSet[GraphedOptimizer]" = weakref.WeakSet()


def release_all() -> None:
    """Free every captured step (call before destroying the process group they captured
    collectives on, or NCCL teardown can hang)."""
    for g in list(_live):
        g.release()


def replaying(runners) -> bool:
    """Whether a container's step is replayed now: it has captured step runners and every one
    holds its graph (after its eager warm-up steps, until the graphs are released)."""
    graphed = [r for r in runners if isinstance(r, GraphedOptimizer)]
    return bool(graphed) and all(r.graph is not None for r in graphed)


def check_warmup(steps) -> None:
    """The number of eager steps before capture: at least one, because kernels compile and
    buffers are allocated there, which capture cannot do."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"cuda_graph_warmup={steps!r}: must be an integer >= 1 (eager steps before capture: "
            "kernels compile and buffers are allocated there, which capture cannot do)"
        )


class GraphedOptimizer:
    """Wraps a ``Dion3``: eager for ``warmup_steps`` steps (compiling kernels, allocating
    buffers), then capture once and replay every step.

    The captured kernels read each gradient where it was at capture. The row engine's
    accumulate pass always reads the matrices' gradients through movable tables
    (optim/moving_grads.py), built at capture from wherever the gradients are then: tables
    keyed by gradient addresses could not be built during a capture, and new gradient tensors
    (``zero_grad(set_to_none=True)``, FSDP2's reduce-scatter output) may lie where no eager
    step's did. When a step's gradients are new tensors, a step given its gradient norm
    (``use_gradient_norm``) points those tables at the matrices' new gradients; the other
    gradients, and every one in a step that makes its own finiteness pass (which reads them
    where they were captured; its tables stay there), are copied into the captured tensors
    first, in one multi-tensor copy. ``load_state_dict`` and param-group changes re-capture.
    Call ``release`` before destroying the process group.
    """

    def __init__(self, optimizer, warmup_steps: int = 3) -> None:
        check_warmup(warmup_steps)
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self._eager_steps = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._stream: torch.cuda.Stream | None = None
        self._grads: list[torch.Tensor] = []  # local tensors the graph reads
        self._grad_objects: list[torch.Tensor] = []  # the .grad objects they came from
        self._params: list[torch.Tensor] = []
        self._moving: MovingGradients | None = None  # the captured accumulate pass's gradient tables
        self._moves_tables = False  # whether a replay points those tables at moved gradients
        self.copied_grads = 0  # gradients the last replay had copied into the captured tensors
        self._version = None
        self._eager_version = None  # the signature of the last eager step
        self.captured_comm: CommStats | None = None  # what the captured step issued
        _live.add(self)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    @property
    def graph(self) -> "torch.cuda.CUDAGraph | None":
        """The captured step (None before the capture and after ``release``)."""
        return self._graph

    def signature(self) -> tuple:
        """What a captured step bakes in: the state tensors (``state_version``; Dion3 refuses
        new param groups after construction), where its non-finite flag comes from (a given
        gradient norm or its own pass), the AdamW groups' constants, which torch's AdamW
        reads as Python floats, each matrix group's momentum (a constant of the kernels that
        decay the momentum: a schedule that changes it re-captures, so it takes effect) and
        whether it decays its weights at all (without weight decay the update leaves the rows
        that are not selected unread). (Matrix groups read lr and the size of their weight
        decay live.)"""
        opt = self.optimizer
        adamw = [g for g in opt.param_groups if g["algorithm"] == "adamw"]
        matrices = [g for g in opt.param_groups if g["algorithm"] != "adamw"]
        return (
            opt.state_version,
            opt.nonfinite.norm_given,
            *((g["weight_decay"], g["eps"], *g["betas"]) for g in adamw),
            *((g["momentum"], g["weight_decay"] != 0) for g in matrices),
        )

    def step(self, closure=None):
        # The replay path is the hot path: a handful of Python comparisons, one small host-to-
        # device copy when lr or weight decay changed, and the graph launch.
        if closure is not None:
            raise ValueError(
                "GraphedOptimizer.step does not take a closure: compute the loss and gradients before step()"
            )
        guard = self.optimizer.nonfinite
        guard.resolve()  # the previous replay's gradient flag: count a skipped step, or raise
        signature = self.signature()
        if self._graph is not None and self._version != signature:
            self.release()
        # capture only after an eager step of the same kind (it allocates what the capture reads)
        if self._graph is None and (self._eager_steps < self.warmup_steps or self._eager_version != signature):
            self._side_stream_run(lambda: self.optimizer.step())
            self._eager_steps += 1
            self._eager_version = signature
            return None
        if self._graph is None:
            self._capture()
        self.refresh_grads()
        self.optimizer.load_hyperparameters()
        self._graph.replay()
        guard.issued()
        return None

    @property
    def captured_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, the local gradient tensor the graph reads for it) of the captured step;
        empty before a capture."""
        return list(zip(self._params, self._grads))

    @property
    def moving_gradients(self) -> MovingGradients | None:
        """The captured accumulate pass's movable gradient tables; None before a capture."""
        return self._moving

    def use_gradient_norm(self, norm: torch.Tensor) -> None:
        """The next step's gradients have total norm ``norm`` (``Dion3.use_gradient_norm``);
        copied before the replay into the buffer the captured step reads."""
        self.optimizer.use_gradient_norm(norm)

    def _side_stream_run(self, fn) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            fn()
        current.wait_stream(self._stream)

    def _capture(self) -> None:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        missing = [n for g in opt.param_groups for p, n in zip(g["params"], opt.param_names(g)) if p.grad is None]
        if missing:
            raise ValueError(
                f"cuda_graph: cannot capture the optimizer step: parameters without a gradient at capture "
                f"time: {missing[:8]}{' ...' if len(missing) > 8 else ''}. A captured step reads every "
                "gradient; freeze such parameters (requires_grad=False) or disable cuda_graph"
            )
        self._params = params
        self._grads = [to_local(p.grad) for p in params]
        self._grad_objects = [p.grad for p in params]
        opt.load_hyperparameters()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        opt.comm_stats.reset()
        # The accumulate pass reads the matrices' gradients through tables built here from where
        # the gradients are now, with or without a given norm: the row engine's cached tables are
        # keyed by the gradients' addresses, cannot be built during a capture, and this step's
        # gradients may lie where no eager step's did.
        matrices = sum(sg.batch for sg in opt.shape_groups)
        moving = MovingGradients(matrices, to_local(params[0]).device)
        with torch.cuda.graph(graph, stream=self._stream):
            opt.step_body(moving)
        moving.flush()  # its tables are written outside the capture, before the first replay
        self._moving = moving
        # Only a step given its gradient norm reads the matrices' gradients in the accumulate
        # pass alone; the own finiteness pass reads every gradient where it was captured, so
        # there each moved gradient is copied back and the tables never leave it.
        self._moves_tables = opt.nonfinite.norm_given
        # the replayed step issues exactly the collectives the captured one did
        self.captured_comm = opt.comm_stats.copy()
        self._graph = graph
        self._version = self.signature()

    def refresh_grads(self) -> None:
        """Point the captured step at the current gradients (new ``.grad`` objects since the
        last replay): in a step given its gradient norm, move the tables that read a matrix's
        gradient to where it is now; copy the rest of those whose storage moved (every one in
        a step without a norm) into the tensors the graph reads."""
        grads = [p.grad for p in self._params]
        if all(g is held for g, held in zip(grads, self._grad_objects)):
            self.copied_grads = 0
            return  # gradients written in place, or the same new tensors as the last replay
        missing = [i for i, g in enumerate(grads) if g is None]
        if missing:
            raise ValueError(
                f"cuda_graph: {len(missing)} parameters have no gradient at this step (the captured step reads "
                "every gradient it was captured with); give every parameter a gradient or disable cuda_graph"
            )
        moving, moves, stale_dst, stale_src = self._moving, self._moves_tables, [], []
        for p, g, held in zip(self._params, grads, self._grads):
            local = to_local(g)
            delta = local.data_ptr() - held.data_ptr()
            if moves and moving.covers(p):
                same_layout = (
                    local.shape == held.shape and local.stride() == held.stride() and local.dtype == held.dtype
                )
                if same_layout and moving.move(p, delta):
                    continue
                moving.move(p, 0)  # read from the captured tensor, where it is copied below
            if delta:
                stale_dst.append(held)
                stale_src.append(local)
        if moves:
            moving.flush()
        if stale_dst:
            torch._foreach_copy_(stale_dst, stale_src)
        self.copied_grads = len(stale_dst)
        self._grad_objects = grads

    def release(self) -> None:
        """Free the graph (before the process group it captured collectives on goes away). The
        next capture follows one eager step: it builds what new state tensors need (the row
        engine's kernel tables), which a capture cannot."""
        if self._graph is not None:
            torch.cuda.synchronize()
            self._graph = None
            self._grads, self._grad_objects, self._params, self._moving = [], [], [], None
            self._moves_tables = False
            self._eager_steps = min(self._eager_steps, self.warmup_steps - 1)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.release()
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # New gradient tensors are found by refresh_grads; set to None, autograd and FSDP2 write
        # the next ones without a memset and a read-modify-write of the old.
        self.optimizer.zero_grad(set_to_none=set_to_none)
