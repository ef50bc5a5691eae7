"""Time the row engine's kernels (dion3_titan/kernels/row_engine/) on Llama matrix shapes, for
several tile configurations, against the torch path's ops and the memory floor.

Each pass runs over every matrix of the model the way a step does (one launch per matrix),
captured in a CUDA graph and replayed (no launch gaps), median of ``--reps`` replays. Bytes are
the fewest each pass must move (each input read once, each output written once); GB/s is
those bytes over the time, beside the measured device-to-device copy rate.

    python scripts/bench_row_engine.py --model 7b --layers 8 --out $OUT/row_engine.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.llama import MODELS, layer_matrices
from benchmarks.output import write_json
from benchmarks.timing import copy_gbps, graph_ms
from dion3_titan.kernels import row_engine as rk
from dion3_titan.kernels.torch_ops import _fused_update_reference
from dion3_titan.optim.update import l1_scores, top_rows

CANDIDATES = {  # (BLOCK_R, BLOCK_C, num_warps)
    "accumulate": [(1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (1, 1024, 4)],
    "gather": [(2, 1024, 4), (1, 2048, 8), (4, 512, 4)],
    "update": [(2, 1024, 4), (1, 2048, 8), (1, 1024, 4), (4, 512, 4), (1, 4096, 8)],
}


def shapes(model: str, layers: int) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix of ``layers`` layers of ``model``, in step order."""
    return layer_matrices(MODELS[model]) * layers


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="7b", choices=[m for m in MODELS if m != "tiny"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--kinds", default="accumulate,gather,update", help="passes to time, comma-separated")
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dev = "cuda"
    mats = shapes(args.model, args.layers)
    M = [torch.randn(1, r, c, device=dev) for r, c in mats]
    G = [torch.randn(1, r, c, device=dev) for r, c in mats]
    W = [torch.randn(1, r, c, device=dev) * 0.02 for r, c in mats]
    L1 = [torch.empty(1, r, device=dev) for r, _ in mats]
    SQ = [torch.empty(1, r, device=dev) for r, _ in mats]
    ks = [max(1, int(args.fraction * r + 0.999)) for r, _ in mats]
    rows = [top_rows(torch.rand(1, r, device=dev), k) for (r, _), k in zip(mats, ks)]
    O = [torch.randn(1, k, c, device=dev).half() for (_, c), k in zip(mats, ks)]
    slots = [rk.row_slots(rw, r) for rw, (r, _) in zip(rows, mats)]
    dens = [torch.rand(1, k, device=dev) + 0.5 for k in ks]  # NorMuon's epilogue factors
    scales = [torch.rand(1, device=dev) + 0.5 for _ in ks]
    lr, decay = torch.tensor(1e-4, device=dev), torch.tensor(0.9999, device=dev)
    numel = sum(r * c for r, c in mats)
    sel = sum(k * c for k, (_, c) in zip(ks, mats))
    nbytes = {  # the fewest bytes each pass moves
        "accumulate": 12 * numel + 8 * sum(r for r, _ in mats),  # read M, G; write M; the row sums
        "gather": 4 * sel + 2 * sel,  # read the selected rows; write them in fp16
        "update": 8 * numel + 2 * sel + 8 * sel,  # read + write W; read O; read + write M's rows (NorMuon)
    }
    passes = {
        "accumulate": lambda: [rk.accumulate_scores(m, g, a, b) for m, g, a, b in zip(M, G, L1, SQ)],
        "gather": lambda: [rk.gather_rows(m, r, o) for m, r, o in zip(M, rows, O)],
        "update": lambda: [
            rk.update_rows(w, m, o, s, lr, decay, 0.95, d, c) for w, m, o, s, d, c in zip(W, M, O, slots, dens, scales)
        ],
    }

    def torch_update():
        for w, m, o, r, d, c in zip(W, M, O, rows, dens, scales):
            _fused_update_reference(w, (o.float() / d[..., None]) * c[:, None, None], r, lr, decay)
            idx = r.unsqueeze(-1).expand(-1, -1, m.shape[-1])
            m.scatter_(1, idx, m.gather(1, idx).mul_(0.95))

    torch_passes = {  # the torch path's ops for the same work
        "accumulate": lambda: (torch._foreach_add_(M, G), [l1_scores(m) for m in M]),
        "gather": lambda: [m.gather(1, r.unsqueeze(-1).expand(-1, -1, m.shape[-1])).half() for m, r in zip(M, rows)],
        "update": torch_update,
    }
    bw = copy_gbps(torch.device(dev))
    print(
        f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; {len(mats)} matrices, {numel / 1e9:.3f} B elements, "
        f"f = {args.fraction}"
    )
    report = {
        "device": torch.cuda.get_device_name(),
        "copy_gbps": bw,
        "model": args.model,
        "layers": args.layers,
        "fraction": args.fraction,
        "results": [],
        "best": {},
    }
    for kind, fn in passes.items():
        if kind not in args.kinds.split(","):
            continue
        floor = nbytes[kind] / bw / 1e6
        t_ms = graph_ms(torch_passes[kind], args.reps)
        print(f"{kind:<10} floor {floor:6.2f} ms | torch path {t_ms:6.2f} ms")
        report["results"].append({"kind": kind, "config": "torch", "ms": t_ms, "floor_ms": floor})
        best = None
        for cfg in CANDIDATES[kind]:
            rk.TILES[kind] = cfg
            ms = graph_ms(fn, args.reps)
            gbps = nbytes[kind] / ms / 1e6
            print(f"{kind:<10} {str(cfg):<16} {ms:6.2f} ms  {gbps:5.0f} GB/s  ({ms / floor:4.2f}x floor)")
            report["results"].append({"kind": kind, "config": list(cfg), "ms": ms, "gbps": gbps, "floor_ms": floor})
            if best is None or ms < best[1]:
                best = (cfg, ms)
        rk.TILES[kind] = best[0]
        report["best"][kind] = list(best[0])
    print("best", json.dumps(report["best"]))
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
