"""Split specs (paper App. A.1.1): a fused parameter whose pieces are orthogonalized separately
trains exactly like the model with separate weights — single process and under FSDP2 on 2 and
4 gloo ranks (pieces cut by the shards, uneven, empty on some ranks) — per-head splitting is H
matrices of (d/H) x d, interleaved gate/up equals separate gate/up, bad specs raise."""

import math

import pytest
import torch
import torch.nn as nn

from dion3_titan import Dion3
from dion3_titan.optim.split import SplitSpec, auto_split_specs, parse_spec, split_pieces, with_auto_split_specs
from tests.dist_reference import TextbookDion3
from tests.inputs import random_grads
from tests.spawn import spawn

pytestmark = pytest.mark.timeout(300)

D, HEADS, KV_HEADS, HEAD_DIM, FFN, EXPERTS = 32, 4, 2, 8, 48, 3
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

SPECS = (
    f"pattern=layers.*.attention.wqkv.weight;sizes={Q},{KV},{KV}"
    " | pattern=layers.*.feed_forward.w13.weight;chunks=2"
    " | pattern=layers.*.moe.experts.mlp1_weight;interleave=2"
    " | pattern=layers.*.mix.weight;interleave=2"
)
SPLIT = {"split_specs": SPECS, "split_heads": HEADS, "split_heads_pattern": "*.attn2.wq.weight"}


def layout(n_layers: int = 2) -> list[tuple[str, str, list[tuple[str, tuple[int, ...]]]]]:
    """(fused name, how the parts are fused, [(separate name, shape)]) per fused parameter;
    "whole" is a parameter that is not split (it shares shape groups with pieces)."""
    out = []
    for i in range(n_layers):
        L = f"layers.{i}"
        out += [
            (
                f"{L}.attention.wqkv.weight",
                "cat",
                [
                    (f"{L}.attention.wq.weight", (Q, D)),
                    (f"{L}.attention.wk.weight", (KV, D)),
                    (f"{L}.attention.wv.weight", (KV, D)),
                ],
            ),
            (f"{L}.attention.wo.weight", "whole", [(f"{L}.attention.wo.weight", (D, Q))]),
            (
                f"{L}.feed_forward.w13.weight",
                "cat",
                [(f"{L}.feed_forward.w1.weight", (FFN, D)), (f"{L}.feed_forward.w3.weight", (FFN, D))],
            ),
            (
                f"{L}.moe.experts.mlp1_weight",
                "interleave",
                [(f"{L}.moe.experts.gate", (EXPERTS, FFN // 2, D)), (f"{L}.moe.experts.up", (EXPERTS, FFN // 2, D))],
            ),
            # 18 rows: FSDP chunks of 9 or 5 rows start on odd rows, so local gate rows start at 1
            (f"{L}.mix.weight", "interleave", [(f"{L}.mix.g", (9, D)), (f"{L}.mix.u", (9, D))]),
            (f"{L}.attn2.wq.weight", "cat", [(f"{L}.attn2.head{h}", (HEAD_DIM, D)) for h in range(HEADS)]),
        ]
    return out


def fuse(kind: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if kind == "interleave":  # row n*j + i is row j of part i (gpt_oss mlp1_weight: gate, up, gate, ...)
        stacked = torch.stack(parts, dim=-2)
        return stacked.reshape(*stacked.shape[:-3], -1, stacked.shape[-1])
    return torch.cat(parts, dim=-2)


def unfuse(kind: str, fused: torch.Tensor, shapes) -> list[torch.Tensor]:
    if kind == "interleave":
        return [fused[..., i :: len(shapes), :] for i in range(len(shapes))]
    return list(fused.split([s[-2] for s in shapes], dim=-2))


def separate_tensors(seed: int, n_layers: int, scale_rows: bool = False) -> dict[str, torch.Tensor]:
    names, shapes = zip(*(part for _, _, parts in layout(n_layers) for part in parts))
    return dict(zip(names, random_grads(seed, shapes, row_scale=scale_rows)))


def fused_tensors(sep: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    return {fname: fuse(kind, [sep[n] for n, _ in parts]) for fname, kind, parts in layout(n_layers)}


class Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = list(tensors)
        for i, t in enumerate(tensors.values()):
            self.register_parameter(f"p{i}", nn.Parameter(t.clone()))


CONFIGS = [(1.0, "muon"), (1.0, "normuon"), (0.25, "muon"), (0.25, "normuon")]
STEPS = 5


def _placements_2d(name: str, ndim: int):
    """FSDP x TP on a (dp=2, tp=2) mesh: attention weights colwise under FSDP (rows cut by both
    dims, _StridedShard), the MLP's rows by dp and columns by tp, experts by dp and their rows
    by tp (gpt_oss's TP of mlp1_weight)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if ndim == 3:
        return [Shard(0), Shard(1)]
    if ".attention." in name or ".attn2." in name:
        return [_StridedShard(0, split_factor=2), Shard(0)]
    return [Shard(0), Shard(1)]


def train(tensors: dict, options: dict, steps: int, grads_fn, mode: str = "local"):
    """Dion3 on ``tensors`` (names as given) for ``steps`` steps, as plain tensors ("local"),
    under fully_shard ("fsdp") or on a 2 x 2 FSDP x TP mesh ("2d"); returns the final full
    tensors and the optimizer."""
    from torch.distributed.tensor import distribute_tensor

    model = Holder(tensors)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif mode == "2d":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for i, (name, t) in enumerate(zip(model.names, tensors.values())):
            d = distribute_tensor(t, mesh, _placements_2d(name, t.ndim), src_data_rank=None)
            setattr(model, f"p{i}", nn.Parameter(d))
    params = list(model.parameters())
    opt = Dion3(
        [{"params": params, "names": model.names}],
        lr=0.05,
        weight_decay=0.1,
        ns_dtype="float32",
        backend="torch",
        **options,
    )
    for step in range(steps):
        for p, g in zip(params, grads_fn(step).values()):
            # every rank holds the same full gradient: shard it locally (no scatter)
            p.grad = (
                g.clone() if mode == "local" else distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
            )
        opt.step()
    final = {n: (p.detach().clone() if mode == "local" else p.full_tensor()) for n, p in zip(model.names, params)}
    return final, opt


def compare(fused_final: dict, sep_final: dict, n_layers: int) -> float:
    """How far the fused run (cut back into parts) is from the separate run, in units of
    allclose(rtol=1e-5, atol=1e-5): < 1 means equal. (Pieces and separate weights may be
    padded differently by the exchange, so NS may pick Gram for one and standard for the
    other: equal up to float32 rounding.)"""
    worst = 0.0
    for fname, kind, parts in layout(n_layers):
        pieces = unfuse(kind, fused_final[fname], [s for _, s in parts])
        for (name, _), got in zip(parts, pieces):
            want = sep_final[name]
            worst = max(worst, ((got - want).abs() / (1e-5 + 1e-5 * want.abs())).max().item())
    return worst


def run_pair(fraction: float, flavor: str, mode: str = "local", n_layers: int = 2) -> dict:
    sep0 = separate_tensors(0, n_layers)
    base = {"fraction": fraction, "flavor": flavor, "selection_scope": "global"}
    sep_grads = lambda step: separate_tensors(1000 + step, n_layers, scale_rows=True)  # noqa: E731
    fused_grads = lambda step: fused_tensors(sep_grads(step), n_layers)  # noqa: E731
    sep_final, _ = train(sep0, base, STEPS, sep_grads, mode)
    fused_final, opt = train(fused_tensors(sep0, n_layers), {**base, **SPLIT}, STEPS, fused_grads, mode)
    from dion3_titan.dist.layout import is_dtensor

    keys = sorted({k for st in opt.state.values() for k in st})
    members = [m for sg in opt._groups for m in sg.members]
    dtensor_state = {m.name: is_dtensor(opt.state[m.param][m.variance_key]) for m in members if flavor == "normuon"}
    return {
        "diff": compare(fused_final, sep_final, n_layers),
        "keys": keys,
        "groups": len(opt._groups),
        "dtensor_state": dtensor_state,
    }


DIST_CONFIGS = [(1.0, "muon"), (0.25, "normuon")]  # gloo on CPU is slow: the two ends


def _worker(rank, world, out_path):
    results = [run_pair(f, flavor, "fsdp", n_layers=1) for f, flavor in DIST_CONFIGS]
    if world == 4:  # FSDP x TP: pieces cut by two mesh dims (strided rows) or rows x columns
        results.append(run_pair(0.25, "normuon", "2d", n_layers=1))
    if rank == 0:
        torch.save(results, out_path)


# ----------------------------------------------------------------- (1) fused == separate
@pytest.mark.parametrize("fraction, flavor", CONFIGS)
def test_fused_equals_separate_single_process(fraction, flavor):
    r = run_pair(fraction, flavor)
    assert r["diff"] < 1, r["diff"]
    if flavor == "normuon":  # pieces that select rows share their parameter's row state
        assert "variance" in r["keys"]


@pytest.mark.parametrize("world", [2, 4])
def test_fused_equals_separate_fsdp(tmp_path, world):
    """Pieces cut by FSDP's row shards (Q|K|V = 32|16|16 rows over 4 ranks: Q on ranks 0-1, K
    on 2, V on 3; gate/up halves on different ranks; interleaved rows at odd offsets; experts
    empty on rank 3) are recovered locally as views and assembled by the exchange: same result
    as separate weights. On 4 ranks also FSDP x TP (2 x 2)."""
    out = tmp_path / "r.pt"
    spawn(world, _worker, str(out))
    results = torch.load(out)
    configs = [*DIST_CONFIGS, *([(0.25, "normuon", "2d")] if world == 4 else [])]
    assert len(results) == len(configs)
    for config, r in zip(configs, results):
        assert r["diff"] < 1, (world, config, r["diff"])
    # NorMuon state is a DTensor like the parameter's rows for every piece, including those the
    # shards cut unevenly (Q lives on the first ranks only): DCP reshards it
    # (tests/test_split_checkpoint.py)
    for r in results[len(DIST_CONFIGS) - 1 :]:
        assert r["dtensor_state"] and all(r["dtensor_state"].values()), r["dtensor_state"]


def test_fused_matches_textbook_reference():
    """Independent check: the fused run equals the textbook update of each separate part."""
    n_layers = 1
    sep0 = separate_tensors(0, n_layers)
    grads = lambda step: separate_tensors(1000 + step, n_layers, scale_rows=True)  # noqa: E731
    opts = {"fraction": 0.25, "flavor": "normuon", "selection_scope": "global", "selection_dim": "rows", **SPLIT}
    final, _ = train(fused_tensors(sep0, n_layers), opts, STEPS, lambda s: fused_tensors(grads(s), n_layers))
    names = list(sep0)
    ref = TextbookDion3([tuple(sep0[n].shape) for n in names], lr=0.05, fraction=0.25, flavor="normuon", wd=0.1)
    weights = [sep0[n].clone() for n in names]
    for step in range(STEPS):
        g = grads(step)
        ref.step(weights, [g[n] for n in names])
    assert compare(final, dict(zip(names, weights)), n_layers) < 1


# ----------------------------------------------------------------- (2) per-head
def test_per_head_plan_and_reference():
    """split_heads=H on Q (H*dh x d): H matrices of dh x d in the plan, each orthogonalized
    separately (equal to a reference on the H head blocks as separate matrices)."""
    H, dh, d = 4, 8, 32
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(H * dh, d, generator=g)
    p = nn.Parameter(w0.clone())
    opt = Dion3(
        [{"params": [p], "names": ["layers.0.attention.wq.weight"]}],
        lr=0.05,
        fraction=1.0,
        ns_dtype="float32",
        backend="torch",
        split_heads=H,
        selection_dim="rows",
    )
    members = [m for sg in opt._groups for m in sg.members]
    assert len(members) == H and len(opt._groups) == 1  # one megabatch of H heads
    assert all(m.layout.global_shape == (dh, d) for m in members)
    assert [m.piece for m in members] == [slice(h * dh, (h + 1) * dh, 1) for h in range(H)]
    assert all(m.lr_scale == pytest.approx(math.sqrt(dh / d)) for m in members)
    ref = TextbookDion3([(dh, d)] * H, lr=0.05, fraction=1.0, flavor="muon")
    blocks = list(w0.clone().split(dh))
    grads = [torch.randn(H * dh, d, generator=g) for _ in range(3)]
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        ref.step(blocks, list(grad.split(dh)))
    assert torch.allclose(p.detach(), torch.cat(blocks), atol=1e-5)
    # without the split the same steps orthogonalize the whole matrix (its own textbook update),
    # and that update is another one: the heads really are separate matrices
    whole = nn.Parameter(w0.clone())
    o2 = Dion3([whole], lr=0.05, ns_dtype="float32", backend="torch")
    ref_whole, w_whole = TextbookDion3([(H * dh, d)], lr=0.05, fraction=1.0, flavor="muon"), [w0.clone()]
    for grad in grads:
        whole.grad = grad.clone()
        o2.step()
        ref_whole.step(w_whole, [grad])
    assert len([m for sg in o2._groups for m in sg.members]) == 1
    assert torch.allclose(whole.detach(), w_whole[0], atol=1e-5)
    assert (whole.detach() - p.detach()).abs().max() > 1e-2


def test_heads_compose_with_sizes_and_interleave():
    assert split_pieces(
        "a.wqkv.weight", (64, 32), {"split_specs": ("pattern=*.wqkv.weight;sizes=32,16,16;head_dim=8",)}
    ) == [
        slice(0, 8, 1),
        slice(8, 16, 1),
        slice(16, 24, 1),
        slice(24, 32, 1),
        slice(32, 40, 1),
        slice(40, 48, 1),
        slice(48, 56, 1),
        slice(56, 64, 1),
    ]
    assert split_pieces("x", (3, 12, 5), {"split_specs": "pattern=x;interleave=2;heads=2"}) == [
        slice(0, 5, 2),
        slice(6, 11, 2),
        slice(1, 6, 2),
        slice(7, 12, 2),
    ]
    assert split_pieces("x", (12, 5), {"split_specs": "pattern=x;sizes=8,4;heads=4,1"}) == [
        slice(0, 2, 1),
        slice(2, 4, 1),
        slice(4, 6, 1),
        slice(6, 8, 1),
        slice(8, 12, 1),
    ]
    # first matching spec wins; split_heads only where no spec matched
    opts = {
        "split_specs": "pattern=*.wq.weight;chunks=2",
        "split_heads": 4,
        "split_heads_pattern": "*.wq.weight|*.wk.weight",
    }
    assert len(split_pieces("l.wq.weight", (16, 4), opts)) == 2
    assert len(split_pieces("l.wk.weight", (16, 4), opts)) == 4
    assert split_pieces("l.wv.weight", (16, 4), opts) is None


# ----------------------------------------------------------------- (3) interleaved
def test_interleaved_views_write_through():
    """Pieces are views of the parameter: the (B, R, C) view of piece 1 of an interleaved
    (E, 2h, d) stack is rows 1, 3, 5, ... and an in-place change lands in the parameter."""
    p = nn.Parameter(torch.zeros(2, 6, 4))
    opt = Dion3(
        [{"params": [p], "names": ["m.mlp1_weight"]}],
        split_specs=["pattern=*mlp1_weight;interleave=2"],
        selection_dim="rows",
    )
    m1 = [m for sg in opt._groups for m in sg.members if m.piece_index == 1][0]
    v = m1.view(p.data)
    assert v.shape == (2, 3, 4) and v.data_ptr() == p.data[:, 1].data_ptr()
    v.add_(1.0)
    assert p.data[:, 1::2].eq(1).all() and p.data[:, ::2].eq(0).all()
    # gate and up of equal shape batch together: one shape group of 2 x 2 matrices
    assert len(opt._groups) == 1 and opt._groups[0].batch == 4


# ----------------------------------------------------------------- (4) bad specs
@pytest.mark.parametrize(
    "spec, words",
    [
        ("sizes=1,2", ["missing pattern"]),
        ("pattern=a;sizes=4", ["at least two"]),
        ("pattern=a;sizes=4,x", ["comma-separated integers"]),
        ("pattern=a;sizes=-1,2", [">= 1"]),
        ("pattern=a;chunks=1", [">= 2"]),
        ("pattern=a;interleave=2,3", ["one integer"]),
        ("pattern=a;interleave=2;sizes=1,1", ["cannot be combined"]),
        ("pattern=a;heads=2;head_dim=4", ["cannot be combined"]),
        ("pattern=a;bogus=1", ["unknown key 'bogus'"]),
        ("pattern=a", ["nothing to split by"]),
        ("pattern=a;sizes", ["not key=value"]),
        ("pattern=a;chunks=2;heads=1,2,3", ["3 counts for 2 pieces"]),
    ],
)
def test_bad_spec_strings_raise(spec, words):
    with pytest.raises(ValueError) as e:
        Dion3([nn.Parameter(torch.zeros(4, 4))], split_specs=spec)
    msg = str(e.value)
    assert "split_specs[0]" in msg and "allowed forms" in msg, msg
    for w in words:
        assert w in msg, msg


def test_specs_that_do_not_fit_the_parameter_raise():
    p = nn.Parameter(torch.zeros(10, 4))
    for spec, words in [
        ("pattern=w;sizes=4,4", "sum to 8 but dim -2 has 10"),
        ("pattern=w;chunks=3", "do not divide"),
        ("pattern=w;heads=3", "does not divide"),
    ]:
        with pytest.raises(ValueError, match=words) as e:
            Dion3([{"params": [p], "names": ["w"]}], split_specs=spec)
        assert "'w'" in str(e.value)
    for key, value in [("split_heads", -1), ("split_heads", 1.5), ("split_auto", "yes"), ("split_specs", 3)]:
        with pytest.raises(ValueError, match=key):
            Dion3([p], **{key: value})


def test_spec_forms():
    assert parse_spec("pattern=a.*.b; sizes=4, 2 ,2") == SplitSpec(
        "pattern=a.*.b; sizes=4, 2 ,2", "a.*.b", sizes=(4, 2, 2)
    )
    two = Dion3([nn.Parameter(torch.zeros(4, 4))], split_specs="pattern=a;chunks=2 | pattern=b;interleave=2")
    three = Dion3([nn.Parameter(torch.zeros(4, 4))], split_specs=["pattern=a;chunks=2", "pattern=b;interleave=2"])
    assert (
        two.param_groups[0]["split_specs"]
        == three.param_groups[0]["split_specs"]
        == ("pattern=a;chunks=2", "pattern=b;interleave=2")
    )


# ----------------------------------------------------------------- automatic specs
def test_auto_split_specs_builtin_models():
    from torchtitan.models.gpt_oss import gptoss_configs
    from torchtitan.models.gpt_oss.model.model import GptOssModel
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    with torch.device("meta"):
        gpt = GptOssModel(gptoss_configs["debugmodel"])
        llama = Transformer(llama3_args["debugmodel"])
    specs = auto_split_specs(gpt)
    assert specs == ["pattern=layers.*.moe.experts.mlp1_weight;interleave=2"]
    pieces = split_pieces(
        "layers.3.moe.experts.mlp1_weight", tuple(gpt.layers["3"].moe.experts.mlp1_weight.shape), {"split_specs": specs}
    )
    h = gptoss_configs["debugmodel"].moe_inter_dim
    assert pieces == [slice(0, 2 * h - 1, 2), slice(1, 2 * h, 2)]  # swiglu: gate = h[..., ::2], up = h[..., 1::2]
    assert auto_split_specs(llama) == []
    # the plugin's call: user specs first (they win), then the automatic ones
    opts = with_auto_split_specs({"split_specs": "pattern=*.mlp1_weight;interleave=2;heads=4"}, gpt)
    assert opts["split_specs"] == ("pattern=*.mlp1_weight;interleave=2;heads=4", *specs)
    assert with_auto_split_specs({"split_auto": False}, gpt)["split_specs"] == ()


def test_auto_split_specs_fused_modules():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_heads, self.n_kv_heads, self.head_dim = HEADS, KV_HEADS, HEAD_DIM
            self.wqkv = nn.Linear(D, Q + 2 * KV, bias=False)

    class FF(nn.Module):
        def __init__(self):
            super().__init__()
            self.w13 = nn.Linear(D, 2 * FFN, bias=False)

    class Args:
        hidden_dim = FFN

    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(2):
        layer = nn.Module()
        layer.attention, layer.feed_forward = Attn(), FF()
        model.layers.append(layer)
    assert auto_split_specs(model, Args()) == [
        f"pattern=layers.*.attention.wqkv.weight;sizes={Q},{KV},{KV}",
        "pattern=layers.*.feed_forward.w13.weight;chunks=2",
    ]
    assert auto_split_specs(model) == [f"pattern=layers.*.attention.wqkv.weight;sizes={Q},{KV},{KV}"]  # w13 unconfirmed
