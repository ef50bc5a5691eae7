"""The comm model (benchmarks/comm_model.py): its arithmetic against hand counts on small models,
and its optimizer bytes per link against ``Dion3.comm_stats`` of one real gloo step (FSDP over 4
ranks and HSDP 2 x 2, gradients mode)."""

import math
import random

import pytest
import torch
import torch.nn as nn

from benchmarks.comm_model import Sync, model_step
from benchmarks.comm_params import parse_shapes, routed_params
from benchmarks.comm_plan import Mesh
from dion3_titan.dist.comm import all_reduce_bytes
from dion3_titan.kernels.flops import ns_flops
from dion3_titan.optim.config import Dion3Config
from tests.inputs import random_grads
from tests.spawn import spawn

pytestmark = pytest.mark.timeout(600)


def _steps(text, cfg, mesh, sync=None):
    return model_step(routed_params(parse_shapes(text), cfg), cfg, mesh, sync or Sync())


def _bytes(step, name, link=None):
    return sum(t.nbytes for t in step.transfers if t.name == name and link in (None, t.link))


def _shape(rng, lo=3, hi=300):
    return rng.randint(lo, hi), rng.randint(lo, hi)


# ----------------------------------------------------------------------------- hand counts
@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_one_matrix_under_fsdp_hand_counted(seed, flavor):
    """One d_out x d_in matrix on S ranks: rank 0 owns it, receives k x W from every other rank
    (fp16, the NS input; NorMuon's float32 second moment in two more columns) and sends each
    its k x W back (fp16, the NS result; NorMuon's new second moment, row denominator and
    matrix scale in six more columns); one all-reduce of the matrix's norm before."""
    rng = random.Random(seed)
    (d_out, d_in), S = _shape(rng), rng.randint(2, 6)
    f = rng.choice([1.0, 0.25, 0.125])
    cfg = Dion3Config(fraction=f, flavor=flavor)
    steps = _steps(f"w={d_out}x{d_in}", cfg, Mesh(1, S, S))
    k = max(1, math.ceil(f * math.ceil(d_out / S) - 1e-9))
    sent, width, res = (d_in + 2, d_in + 6, 2) if flavor == "normuon" else (d_in, d_in, 2)
    norm = 2 * (S - 1) * 4  # a ring all-reduce of one float32
    for r, step in enumerate(steps):
        assert _bytes(step, "row norms all-reduce") == norm
        assert _bytes(step, "rows gather (all-to-all)") == ((S - 1) * k * sent * 2 if r == 0 else 0)
        assert _bytes(step, "results scatter (all-to-all)") == (0 if r == 0 else k * width * res)
        assert step.by_link() == {"shard": norm + ((S - 1) * k * sent * 2 if r == 0 else k * width * res)}
        want = ns_flops(S * k, d_in, "auto", 5, (2,), symmetric=True) if r == 0 else 0.0
        assert step.ns_flops == pytest.approx(want)
        # FSDP2: fp32 gradient reduce-scatter and the bf16 all-gather (forward and backward)
        chunk = math.ceil(d_out / S) * d_in
        assert _bytes(step, "grad reduce-scatter") == (S - 1) * chunk * 4
        assert _bytes(step, "param all-gather") == 2 * (S - 1) * chunk * 2
        assert _bytes(step, "grad all-reduce") == 0  # no replicas


def test_owners_balance_equal_matrices(seed):
    """n equal matrices on S ranks: owners go round the ranks, so rank r owns ceil or floor of
    n / S and receives, in the scatter, the k x C blocks of the matrices the others own."""
    rng = random.Random(seed)
    (d_out, d_in), S, n = _shape(rng, 8), rng.randint(2, 5), rng.randint(2, 9)
    cfg = Dion3Config(fraction=0.25)
    steps = _steps(",".join(f"w{i}={d_out}x{d_in}" for i in range(n)), cfg, Mesh(1, S, S))
    k = max(1, math.ceil(0.25 * math.ceil(d_out / S) - 1e-9))
    for r, step in enumerate(steps):
        own = len(range(r, n, S))
        assert _bytes(step, "rows gather (all-to-all)") == (S - 1) * own * k * d_in * 2
        assert _bytes(step, "results scatter (all-to-all)") == (n - own) * k * d_in * 2


@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_compressed_hsdp_hand_counted(seed, flavor):
    """HSDP R x S, compressed: no gradient all-reduce; one score all-reduce of the local rows
    of every shape group (f < 1); the owner's gathered matrix split over the replicas with exact
    counts (replica r orthogonalizes (r+1)n//R - rn//R of its n matrices: the others' copies of
    its share come to it, and its results go to the others, in the NS dtype); AdamW gradients
    all-reduced by the optimizer; NS once per share."""
    rng = random.Random(seed)
    (d_out, d_in), R, S = _shape(rng, 8), rng.randint(2, 4), rng.randint(2, 4)
    emb = _shape(rng)
    cfg = Dion3Config(fraction=0.25, flavor=flavor)
    mesh = Mesh(R, S, S)
    steps = _steps(f"w={d_out}x{d_in},embed={emb[0]}x{emb[1]}", cfg, mesh, Sync("compressed"))
    k = max(1, math.ceil(0.25 * math.ceil(d_out / S) - 1e-9))
    emb_local = [len(range(s * -(-emb[0] // S), min(emb[0], (s + 1) * -(-emb[0] // S)))) * emb[1] for s in range(S)]
    for rank, step in enumerate(steps):
        r, s = divmod(rank, S)
        rows = len(range(s * -(-d_out // S), min(d_out, (s + 1) * -(-d_out // S))))
        n = 1 if s == 0 else 0  # the one matrix's owner is shard rank 0
        share = (r + 1) * n // R - r * n // R
        assert _bytes(step, "grad all-reduce") == 0
        scored = k < rows  # every local row selected: no scores to agree on
        assert _bytes(step, "scores all-reduce") == (2 * (R - 1) * -(-rows // R) * 4 if scored else 0)
        assert _bytes(step, "momentum mean (all-to-all)") == (R - 1) * share * S * k * d_in * 4
        assert _bytes(step, "results all-gather (all-to-all)") == (n - share) * S * k * d_in * 2
        assert _bytes(step, "AdamW gradient all-reduce") == 2 * (R - 1) * -(-emb_local[s] // R) * 4
        want = ns_flops(S * k, d_in, "auto", 5, (2,), symmetric=True) if share else 0.0
        assert step.ns_flops == pytest.approx(want)
        # gradients mode: the gradient shards' all-reduce instead, and no replicate traffic
        grad = _steps(f"w={d_out}x{d_in},embed={emb[0]}x{emb[1]}", cfg, mesh)[rank]
        chunks = [math.ceil(d_out / S) * d_in, math.ceil(emb[0] / S) * emb[1]]
        assert _bytes(grad, "grad all-reduce") == sum(2 * (R - 1) * -(-c // R) * 4 for c in chunks)
        assert "replicate" not in grad.by_link()


def test_links_of_a_group_spanning_nodes():
    """FSDP over 2 nodes of 2 GPUs: an all-to-all's bytes from the other node cross nodes; a
    ring reduce-scatter sends 1 of its 3 chunks across nodes (hierarchical)."""
    steps = _steps("w0=8x16,w1=8x16,w2=8x16,w3=8x16", Dion3Config(fraction=0.5), Mesh(1, 4, 2))
    block = 1 * 16  # k = 1 of 2 local rows, 16 columns, fp16 NS input and results
    for step in steps:
        gather = next(t for t in step.transfers if t.name == "rows gather (all-to-all)")
        assert (gather.intra, gather.inter) == (block * 2, 2 * block * 2)  # owns one matrix
        scatter = next(t for t in step.transfers if t.name == "results scatter (all-to-all)")
        assert (scatter.intra, scatter.inter) == (block * 2, 2 * block * 2)
        rs = next(t for t in step.transfers if t.name == "grad reduce-scatter")
        assert (rs.calls, rs.intra, rs.inter) == (4, 4 * 2 * 2 * 16 * 4, 4 * 2 * 16 * 4)


def test_hsdp_replicate_traffic_is_inter_node_and_shard_intra():
    steps = _steps("w=64x32,embed=40x32,norm=32", Dion3Config(fraction=0.25), Mesh(4, 2, 2), Sync("compressed"))
    for step in steps:
        for t in step.transfers:
            if t.link == "shard":
                assert t.inter == 0, t
            if t.link == "replicate":
                assert t.intra == 0, t
    assert _bytes(steps[0], "grad-norm all-reduce", "replicate") == all_reduce_bytes(1, 4, 4)


def test_replicate_ns_split_shares_the_owner_batch():
    """gradients + replicate_ns = split: replica r orthogonalizes (r+1)n//R - rn//R of its
    owner's n matrices and receives the others' results (NS dtype); the gradient all-reduce
    stays."""
    text = ",".join(f"w{i}={16}x{24}" for i in range(5))
    cfg, mesh = Dion3Config(fraction=1.0, flavor="normuon"), Mesh(2, 2, 2)
    repeat, split = _steps(text, cfg, mesh), _steps(text, cfg, mesh, Sync(replicate_ns="split"))
    cost = ns_flops(16, 24, "auto", 5, (2,), symmetric=True)
    for rank in range(4):
        r, s = divmod(rank, 2)
        own = 3 if s == 0 else 2
        share = (r + 1) * own // 2 - r * own // 2
        assert repeat[rank].ns_flops == pytest.approx(own * cost)
        assert split[rank].ns_flops == pytest.approx(share * cost)
        assert _bytes(split[rank], "results all-gather (all-to-all)") == (own - share) * 16 * 24 * 2
        assert _bytes(split[rank], "grad all-reduce") == _bytes(repeat[rank], "grad all-reduce") > 0


def test_titan_models_route_as_the_plugin():
    """llama3 8B from torchtitan's own definition: 7 matrices per layer to Dion3, embeddings,
    output and norms to AdamW, 8.03B parameters, nothing split."""
    from benchmarks.comm_params import titan_model

    params = routed_params(titan_model("llama3-8b"), Dion3Config())
    matrices = [p for p in params if p.matrix]
    assert len(matrices) == 7 * 32 and all(p.pieces is None for p in matrices)
    assert {p.name for p in params if not p.matrix} >= {"tok_embeddings.weight", "output.weight", "norm.weight"}
    assert sum(p.numel for p in params) == 8_030_261_248
    assert [p.gathers for p in params if p.name in ("norm.weight", "output.weight")] == [1, 1]


# ----------------------------------------------------------------------------- real gloo ranks
SHAPES = "a=18x64,a2=18x64,b=2x64,tall=96x24,sq=32x32,fused=40x32,e=4x8x24,embed=50x32,norm=32"
SPLIT = "pattern=fused;sizes=24,8,8"
CONFIGS = [
    dict(fraction=0.25, flavor="muon"),
    dict(fraction=1.0, flavor="muon"),
    dict(fraction=0.25, flavor="normuon"),
    dict(fraction=1.0, flavor="normuon"),
    dict(fraction=0.25, flavor="normuon", selection_scope="global"),
    dict(fraction=0.25, flavor="muon", selection_dim="cols"),
]


def _gloo_worker(rank, world, hsdp, sync, out_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from dion3_titan import Dion3
    from dion3_titan.optim.routing import build_param_groups

    got = []
    for options in CONFIGS:
        model = parse_shapes(SHAPES).to_empty(device="cpu")
        for p in model.parameters():
            nn.init.normal_(p)
        if hsdp:
            fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        else:
            fully_shard(model)
        opt = Dion3(
            build_param_groups(model.named_parameters()), backend="torch", split_specs=SPLIT, **options, **SYNCS[sync]
        )
        params = list(model.parameters())
        for p, g in zip(params, random_grads(7, [p.shape for p in params], row_scale=True)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.comm_stats.reset()
        opt.step()
        got.append((opt.comm_stats.calls, dict(opt.comm_stats.by_link)))
    torch.save(got, f"{out_path}.{rank}")


SYNCS = {
    "gradients": {},
    "compressed": {"replicate_sync": "compressed"},
    "split": {"replicate_ns": "split"},
}


@pytest.mark.parametrize(
    "hsdp,sync",
    [(False, "gradients"), (True, "gradients"), (True, "compressed"), (True, "split")],
    ids=["fsdp4", "hsdp2x2", "hsdp2x2-compressed", "hsdp2x2-split"],
)
def test_bytes_equal_comm_stats(tmp_path, hsdp, sync):
    """The model's optimizer bytes per link equal comm_stats.by_link of one real step, on every
    rank: shard-group all-to-alls (uneven and empty shards, split pieces, a shared shape
    group), score all-gathers (global scope, column selection) and, under HSDP, the expert
    stack's all-gather across replicas (it is whole on each shard rank); compressed sync and
    replicate_ns = "split": the score all-reduces, the split of each owner's batch over the
    replicas and the AdamW gradient all-reduce."""
    out = tmp_path / "stats"
    spawn(4, _gloo_worker, hsdp, sync, str(out))
    mesh = Mesh(2, 2, 2) if hsdp else Mesh(1, 4, 4)
    modes = {"gradients": Sync(), "compressed": Sync("compressed"), "split": Sync(replicate_ns="split")}
    for i, options in enumerate(CONFIGS):
        cfg = Dion3Config(split_specs=SPLIT, **options)
        steps = model_step(routed_params(parse_shapes(SHAPES), cfg), cfg, mesh, modes[sync])
        for rank in range(4):
            calls, real = torch.load(f"{out}.{rank}")[i]
            want = {k: v for k, v in steps[rank].by_link().items() if v}
            assert {k: v for k, v in real.items() if v} == want, (options, rank)
            assert calls == steps[rank].calls(), (options, rank)
            assert want.get("shard", 0) > 0
            assert ("replicate" in want) == hsdp


# ----------------------------------------------------------------------------- the command
def test_command_tables_json_and_times(tmp_path, capsys):
    """scripts/bench_comm.py on a custom model: every (f, sync) in the JSON; a collective's
    time is its busiest rank's intra bytes over NVLink plus its busiest node's inter bytes over
    the network; NS time is the busiest rank's FLOPs at the NS rate; the totals add up."""
    import json

    from benchmarks.comm_report import main

    out = tmp_path / "comm.json"
    main(
        ["--shapes", "w=64x128,v=64x128,t=96x64,embed=100x64,norm=64", "--nodes", "2", "--gpus-per-node", "2",
         "--inter-node-gbps", "100", "--intra-node-gbps", "800", "--ns-tflops", "50", "--json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "| f | sync |" in printed and "ns_rate_source: given" in printed
    data = json.loads(out.read_text())
    assert [(r["fraction"], r["sync"]) for r in data["results"]] == [
        (f, s) for f in ("1", "1/4", "1/8") for s in ("gradients/repeat", "gradients/split", "compressed")
    ]
    for r in data["results"]:
        for c in r["collectives"]:
            assert c["time_ms"] == pytest.approx(1e3 * (c["intra_max"] / 100e9 + c["node_inter_max"] / 12.5e9))
        t = r["times_ms"]
        assert t["ns"] == pytest.approx(1e3 * r["ns_tflop_max"] / 50)
        assert t["total"] == pytest.approx(t["grad_sync"] + t["optimizer"] + t["scalars"] + t["ns"])
        names = {c["name"] for c in r["collectives"]}
        assert ("grad all-reduce" in names) == (r["sync"] != "compressed")


def test_command_needs_an_ns_rate_without_a_gpu(monkeypatch):
    from benchmarks.comm_report import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--ns-tflops"):
        main(["--shapes", "w=64x128", "--nodes", "1", "--gpus-per-node", "2"])
