"""The comm model's command (scripts/bench_comm.py): per-link bytes, NS FLOPs and a step-time
estimate of one training step of a model on a mesh of nodes, for several row fractions f and
replicate sync modes, as markdown tables (and JSON with ``--json``).

Bytes are per rank per step (the mean over ranks) on the intra-node links (NVLink) and across
nodes. The time estimate charges each kind of collective its busiest rank's intra-node bytes
at the NVLink rate of one GPU plus its busiest node's inter-node bytes at the node's network
rate, and Newton-Schulz its busiest rank's FLOPs at the NS rate; nothing overlaps. The
gradient sync (FSDP2's reduce-scatter and replicate all-reduce), the optimizer's collectives,
the scalar all-reduces and NS add up to "total"; FSDP2's parameter all-gathers are the same in
every mode and are shown apart (they overlap the forward and backward passes).

    python scripts/bench_comm.py --model llama3-8b --nodes 8 --gpus-per-node 8 --mesh hsdp \\
        --inter-node-gbps 400 --intra-node-gbps 3600 --ns-tflops 691
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from fractions import Fraction

import torch

from benchmarks.comm_model import RankStep, Sync, model_step
from benchmarks.comm_params import TITAN_MODELS, parse_shapes, routed_params, titan_model
from benchmarks.comm_plan import Mesh
from benchmarks.output import write_json
from dion3_titan.optim.config import Dion3Config

SYNCS = {"gradients": Sync(), "split": Sync(replicate_ns="split"), "compressed": Sync("compressed")}
GB = 1e9
PHASES = ("fsdp", "optimizer", "scalars")


@dataclass(frozen=True)
class Rates:
    intra_gbps: float  # NVLink, per GPU and direction, Gb/s
    inter_gbps: float  # network, per node and direction, Gb/s
    ns_tflops: float  # NS rate of one GPU
    ns_source: str  # where the NS rate comes from


def summarize(steps: list[RankStep], mesh: Mesh, rates: Rates) -> dict:
    """Per kind of collective: mean bytes per rank (intra, inter), the busiest rank's intra and
    busiest node's inter bytes, its calls and time; then NS and the time totals."""
    kinds: dict[tuple, dict] = {}
    for st in steps:
        for t in st.transfers:
            e = kinds.setdefault(
                (t.phase, t.name, t.link),
                {
                    "phase": t.phase,
                    "name": t.name,
                    "link": t.link,
                    "calls": t.calls,
                    "intra": 0,
                    "inter": 0,
                    "intra_max": 0,
                    "node_inter": {},
                },
            )
            e["intra"] += t.intra
            e["inter"] += t.inter
            e["intra_max"] = max(e["intra_max"], t.intra)
            node = mesh.node(st.rank)
            e["node_inter"][node] = e["node_inter"].get(node, 0) + t.inter
    intra_bps, inter_bps = rates.intra_gbps * GB / 8, rates.inter_gbps * GB / 8
    rows = []
    for e in kinds.values():
        node_max = max(e.pop("node_inter").values())
        rows.append(
            {
                **e,
                "intra": e["intra"] / len(steps),
                "inter": e["inter"] / len(steps),
                "node_inter_max": node_max,
                "time_ms": 1e3 * (e["intra_max"] / intra_bps + node_max / inter_bps),
            }
        )
    flops = [st.ns_flops for st in steps]
    times = {
        "grad_sync": sum(r["time_ms"] for r in rows if r["phase"] == "fsdp" and r["name"] != "param all-gather"),
        "optimizer": sum(r["time_ms"] for r in rows if r["phase"] == "optimizer"),
        "scalars": sum(r["time_ms"] for r in rows if r["phase"] == "scalars"),
        "ns": 1e3 * max(flops) / (rates.ns_tflops * 1e12),
        "param_all_gather": sum(r["time_ms"] for r in rows if r["name"] == "param all-gather"),
    }
    times["total"] = times["grad_sync"] + times["optimizer"] + times["scalars"] + times["ns"]
    return {
        "collectives": rows,
        "ns_tflop_max": max(flops) / 1e12,
        "ns_tflop_mean": sum(flops) / len(flops) / 1e12,
        "times_ms": times,
    }


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < 2 else "--:" for i in range(len(header))) + "|",
    ]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _gb(x: float) -> str:
    return "0" if x == 0 else f"{x / GB:.3g}" if x >= GB / 1000 else "<0.001"


def collectives_table(results: dict[str, dict]) -> str:
    """One f: rows are kinds of collective, columns each sync mode's intra / inter GB per rank."""
    order: dict[tuple, None] = {}
    for r in results.values():
        for c in r["collectives"]:
            order[(c["phase"], c["name"], c["link"])] = None
    header = ["phase", "collective (mesh link)"] + [f"{s} {side}" for s in results for side in ("intra", "inter")]
    rows = []
    for key in sorted(order, key=lambda k: PHASES.index(k[0])):  # stable: first seen first
        cells = [key[0], f"{key[1]} ({key[2]})"]
        for r in results.values():
            c = next((c for c in r["collectives"] if (c["phase"], c["name"], c["link"]) == key), None)
            cells += [_gb(c["intra"]), _gb(c["inter"])] if c else ["-", "-"]
        rows.append(cells)
    return _table(header, rows)


def summary_table(results: list[tuple[str, str, dict]]) -> str:
    header = [
        "f",
        "sync",
        "grad sync GB intra",
        "inter",
        "optimizer GB intra",
        "inter",
        "NS TFLOP/rank",
        "t grad sync ms",
        "t optimizer comm ms",
        "t NS ms",
        "t total ms",
        "t param all-gather ms",
    ]
    rows = []
    for f, sync, r in results:

        def side(phase, key, r=r):
            return sum(c[key] for c in r["collectives"] if c["phase"] == phase and c["name"] != "param all-gather")

        t = r["times_ms"]
        rows.append(
            [
                f,
                sync,
                _gb(side("fsdp", "intra")),
                _gb(side("fsdp", "inter")),
                _gb(side("optimizer", "intra")),
                _gb(side("optimizer", "inter")),
                f"{r['ns_tflop_max']:.3g}",
                f"{t['grad_sync']:.0f}",
                f"{t['optimizer']:.0f}",
                f"{t['ns']:.0f}",
                f"{t['total']:.0f}",
                f"{t['param_all_gather']:.0f}",
            ]
        )
    return _table(header, rows)


def ns_rate(given: float | None) -> tuple[float, str]:
    """``given`` TFLOP/s, else a batched fp16 matmul measured on this machine's GPU."""
    if given is not None:
        return given, "given (--ns-tflops)"
    if not torch.cuda.is_available():
        raise SystemExit("no GPU here to measure the NS rate on: give --ns-tflops")
    from benchmarks.timing import matmul_tflops

    rate = matmul_tflops(torch.device("cuda"), torch.float16)
    return rate, f"measured: fp16 batched matmul on {torch.cuda.get_device_name()}"


def _fraction(text: str) -> float:
    return float(Fraction(text))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", choices=tuple(TITAN_MODELS), help="a torchtitan model, built on the meta device")
    what.add_argument("--shapes", help='a custom model, e.g. "w=4096x4096,e=64x1408x2048,embed=128256x4096"')
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument(
        "--mesh",
        choices=("hsdp", "fsdp"),
        default="hsdp",
        help="hsdp: replicas x shards, shards within a node; fsdp: one shard group of every rank",
    )
    ap.add_argument("--shards", type=int, help="HSDP shard degree (default: --gpus-per-node)")
    ap.add_argument("--flavor", choices=("muon", "normuon"), default="muon")
    ap.add_argument("--fractions", default="1,1/4,1/8", help="row fractions f, comma-separated")
    ap.add_argument(
        "--syncs", default=",".join(SYNCS), help=f"of {tuple(SYNCS)} (split: gradients + replicate_ns split)"
    )
    ap.add_argument("--selection-scope", choices=("local", "global"), default="local")
    ap.add_argument("--ns-algorithm", choices=("auto", "gram", "standard"), default="auto")
    ap.add_argument("--inter-node-gbps", type=float, default=400.0, help="network per node and direction, Gb/s")
    ap.add_argument(
        "--intra-node-gbps",
        type=float,
        default=3600.0,
        help="NVLink per GPU and direction, Gb/s (3600 = 450 GB/s, H100/H200 NVLink 4)",
    )
    ap.add_argument("--ns-tflops", type=float, help="NS rate of one GPU (default: measured on this machine's GPU)")
    ap.add_argument("--param-bytes", type=int, default=2, help="FSDP2 param dtype bytes (bf16 mixed precision)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    syncs = [s.strip() for s in args.syncs.split(",") if s.strip()]
    if unknown := set(syncs) - set(SYNCS):
        raise SystemExit(f"--syncs: unknown {sorted(unknown)}; allowed: {tuple(SYNCS)}")
    world = args.nodes * args.gpus_per_node
    shards = world if args.mesh == "fsdp" else (args.shards or args.gpus_per_node)
    mesh = Mesh(world // shards, shards, args.gpus_per_node)
    if mesh.replicas == 1:
        syncs = syncs[:1]  # one replica: nothing crosses replicas, every sync mode is the same
    rate, source = ns_rate(args.ns_tflops)
    rates = Rates(args.intra_node_gbps, args.inter_node_gbps, rate, source)
    model = titan_model(args.model) if args.model else parse_shapes(args.shapes)
    fractions = [f.strip() for f in args.fractions.split(",") if f.strip()]
    results, blocks = [], []
    for f in fractions:
        cfg = Dion3Config(
            fraction=_fraction(f),
            flavor=args.flavor,
            selection_scope=args.selection_scope,
            ns_algorithm=args.ns_algorithm,
        )
        params = routed_params(model, cfg)
        per_sync = {
            SYNCS[s].label(): summarize(model_step(params, cfg, mesh, SYNCS[s], args.param_bytes), mesh, rates)
            for s in syncs
        }
        blocks.append(
            f"f = {f}: GB per rank per step, intra-node / inter-node (mean over ranks)\n\n"
            + collectives_table(per_sync)
        )
        results += [(f, s, r) for s, r in per_sync.items()]
    matrices = [p for p in params if p.matrix]
    assumptions = {
        "model": args.model or f"custom: {args.shapes}",
        "parameters": sum(p.numel for p in params),
        "dion3_matrices": len(matrices),
        "dion3_elements": sum(p.numel for p in matrices),
        "mesh": f"{args.mesh} R={mesh.replicas} x S={mesh.shards} on {args.nodes} nodes x {args.gpus_per_node} GPUs",
        "flavor": args.flavor,
        "selection_scope": args.selection_scope,
        "ns_algorithm": args.ns_algorithm,
        "intra_node_gbps": args.intra_node_gbps,
        "inter_node_gbps": args.inter_node_gbps,
        "ns_tflops": rate,
        "ns_rate_source": source,
        "dtypes": f"FSDP2 param all-gather {args.param_bytes} B, gradient reduce fp32, rows to their owner fp16 "
        f"(the NS input; fp32 momentum under compressed sync), results fp16 (NorMuon: three float32 scalars "
        "beside each row)",
    }
    print("Assumptions:")
    for k, v in assumptions.items():
        print(f"  {k}: {v:,}" if isinstance(v, int) else f"  {k}: {v}")
    print(
        "  time: per kind of collective, busiest rank's intra bytes / NVLink + busiest node's inter bytes / "
        "network; NS: busiest rank's FLOPs (symmetric products at half cost) / NS rate; no overlap\n"
    )
    for b in blocks:
        print(b + "\n")
    print("Summary (GB per rank per step, mean over ranks; times of the busiest rank or node)\n")
    print(summary_table(results))
    print(
        "\nt total: gradient sync + optimizer collectives + scalars + NS. FSDP2's parameter all-gathers "
        "(every mode alike, overlapped with forward and backward) are not in it."
    )
    if mesh.replicas == 1:
        print("One replica: nothing crosses replicas, so the replicate sync modes coincide (gradients shown).")
    if args.json:
        write_json(
            args.json,
            {
                "command": sys.argv,
                "assumptions": assumptions,
                "results": [{"fraction": f, "sync": s, **r} for f, s, r in results],
            },
        )
