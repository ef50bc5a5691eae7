"""Time one optimizer step of AdamW, Muon and Dion3 on Llama-shaped parameters (paper Sec. 8.2,
App. D.2, Fig. 1, Tables 1, 5, 6).

The model is a plain holder of parameters with the shapes of paper Table 4 (separate
wq/wk/wv/wo and w1/w2/w3 as torchtitan's llama3 has them, fp32 as FSDP2 keeps them). No
forward pass: every step's gradients are fresh N(0, 1) draws (fixed seed, never zeros) written
in place into the same ``p.grad`` tensors, which is what a CUDA-graph replay needs. Under
torchrun with more than one rank every layer and then the root are ``fully_shard``-ed (FSDP2).
A row whose name ends in ``+norm`` hands Dion3 the gradients' total norm before each step, as
torchtitan's gradient clipping does, so it makes no finiteness pass of its own (microsoft/dion
makes none either way). ``--weight-decay`` applies to every row alike.

Per configuration (all in one run):
  * GPU ms: median over ``--steps`` steps of CUDA events around ``step()`` (after warm-up), the
    per-step maximum over ranks; on a CPU, perf_counter (the CPU runs synchronously);
  * host ms: perf_counter around ``step()``, stopped before any sync of ours (it includes the
    optimizer's own host syncs: eager Dion3 checks gradients and NS results for finiteness);
  * comm MB: bytes received by a rank in one step, from ``opt.comm_stats`` (reset before the
    step; a replayed graph runs no Python, so graph rows report their last eager step's count);
  * NS TFLOP / floor ms: the Newton-Schulz FLOPs this rank runs, counted from the optimizer's
    own plan (padded shapes, owners, Gram vs standard, symmetric products at half cost where
    the backend has symmetric kernels), over the bf16/fp16 matmul rate measured in this run.

    python scripts/bench_step.py --model 7b --layers 16 --budget-s 180          # 1 GPU, ~3 min
    torchrun --nproc_per_node 2 scripts/bench_step.py --model 1b --budget-s 180  # 2 GPUs, ~1.5 min
    python scripts/bench_step.py --tiny                                          # CPU smoke test

When ``import dion`` works (microsoft/dion, the paper authors' code, on PYTHONPATH) the same run
adds its rows: ``dion.Muon`` with Gram NS + kernels and its Dion3-family optimizer of the
benchmarked flavor (``Dion3`` for NorMuon, ``Dion2`` for Muon) at f = 1, 1/2, 1/4, eager and
under its ``CudaGraphOptimizer``; the xDion column divides our row by its counterpart.

``--settings`` runs each of our Dion3 rows again under module settings (e.g.
``cute_symm.GENERAL=0`` or ``cute_symm.PAIR_MIN_N=4096+cute_symm.GROUP=16``), as
"<row>[<variant>]" right after it: an A/B of a kernel switch inside one run, each beside the
same anchor row.

Execution order puts the eager stack first, then the graph rows, then torch.optim.Muon and
megabatching off; ``--budget-s`` skips (and reports) any configuration predicted to end past it.

The pieces: the configurations and their order (step_configs.py), what each one steps and its
NS FLOPs (step_runners.py), timing one (step_timing.py), the floors, ratios and table
(step_report.py); this module holds the command line and the run over the configurations.

A table is printed at the end; JSON goes to ``--out`` (a .json file or a folder; default $OUT), named
bench_step_<model>_<flavor>_w<world>.json in a folder, rewritten after every configuration.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.llama import MODELS, GradFiller, ModelShape, build_model, count_params
from benchmarks.output import fmt, output_path, write_json
from benchmarks.ranks import all_ranks_true, finish, init_distributed, log, rank, world_size
from benchmarks.step_configs import (
    GRAPH_WARMUP,
    WEIGHT_DECAY,
    anchor_module,
    applied,
    build_configs,
    estimate_s,
    run_priority,
)
from benchmarks.step_report import attach_adamw_floor, attach_flops, attach_ratios, print_table
from benchmarks.step_runners import graphed_optimizer_class, unavailable_reason
from benchmarks.step_timing import free_memory, not_run, run_config
from benchmarks.timing import copy_gbps, matmul_tflops


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="7b",
        choices=[m for m in MODELS if m != "tiny"],
        help="paper Table 4 shapes, or 1b_train: the llama3 model scripts/bench_train.py trains",
    )
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--layers", type=int, default=None, help="use this many layers instead of the model's")
    p.add_argument("--vocab", type=int, default=None, help="embedding/output rows (default 32000)")
    p.add_argument("--flavor", default="muon", choices=["muon", "normuon"])
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "triton", "cute"],
        help="backend of the '+ kernels' rows and after",
    )
    p.add_argument(
        "--gram-algorithm",
        default="auto",
        choices=["gram", "auto"],
        help="ns_algorithm of the '+ Gram NS' rows and after: 'auto' (the optimizer's default) runs "
        "standard NS on square matrices, 'gram' runs Gram NS on every batch",
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=WEIGHT_DECAY,
        help="of every row (0: Dion3's update leaves the rows it does not select unread, as in bench_train)",
    )
    p.add_argument("--steps", type=int, default=25, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (graph rows: at least 5)")
    p.add_argument("--only", default="", help="comma-separated glob patterns of config names")
    p.add_argument(
        "--settings",
        default="",
        help="comma-separated variants, each MODULE.ATTR=VALUE[+...] (e.g. cute_symm.GENERAL=0): each of "
        "our Dion3 rows also runs under each, as '<row>[<variant>]', right after it in the same process",
    )
    p.add_argument(
        "--budget-s", type=float, default=1e9, help="skip configurations predicted to end after this many seconds"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="re-raise errors other than OOM (tests)")
    p.add_argument("--out", default=None, help="JSON file or folder (default $OUT)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing each configuration, print its N costliest kernels (GPU)",
    )
    return p.parse_args(argv)


def model_shape(args: argparse.Namespace) -> tuple[str, ModelShape, list[str]]:
    name = "tiny" if args.tiny else args.model
    shape = MODELS[name]
    notes = []
    if args.layers is not None and args.layers != shape.layers:
        notes.append(
            f"{args.layers} of {shape.layers} layers of the {name} shapes (--layers): "
            "step times cover that many layers; embeddings/output are whole"
        )
        shape = ModelShape(shape.hidden, args.layers, shape.heads, shape.kv_heads, shape.mlp_hidden, shape.vocab)
    if args.vocab is not None:
        shape = ModelShape(shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.mlp_hidden, args.vocab)
    return name, shape, notes


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        configs = build_configs(args)
    except ValueError as exc:  # a bad --settings: one line, before anything runs
        raise SystemExit(str(exc)) from None
    t_start = time.time()
    device, mesh = init_distributed(args.device)
    world = world_size()
    name, shape, notes = model_shape(args)
    torch.manual_seed(args.seed)
    graph_cls, graph_note = graphed_optimizer_class()
    if graph_note and device.type == "cuda":
        notes.append(graph_note)
    anchor_note = anchor_module()[1]
    if anchor_note:
        notes.append(f"no microsoft/dion rows: {anchor_note}")

    size = (2, 128) if args.tiny else (4, 8192)  # (batch, side) of the measured matmul
    tflops = matmul_tflops(device, torch.float16, *size)
    tflops_bf16 = matmul_tflops(device, torch.bfloat16, *size)
    gbps = copy_gbps(device, (1 << 16) if args.tiny else (1 << 28))
    free_memory(device)
    log(
        f"{describe_device(device)} x{world}: matmul fp16 {tflops:.3g} / bf16 {tflops_bf16:.3g} TFLOP/s, "
        f"copy {gbps:.0f} GB/s"
    )

    model = build_model(shape, device, mesh, args.seed)
    grads = GradFiller(model, device, args.seed + 1)
    n_params = count_params(shape)
    size = f"{n_params / 1e9:.2f}B" if n_params >= 1e7 else f"{n_params / 1e6:.2f}M"
    title = (
        f"{name} ({size} params: hidden {shape.hidden}, {shape.layers} layers, "
        f"heads {shape.heads}/{shape.kv_heads}, mlp {shape.mlp_hidden}, vocab {shape.vocab}) | "
        f"{describe_device(device)} x{world}{' FSDP2' if world > 1 else ''} | flavor {args.flavor} | "
        f"median of {args.steps} steps, ms"
    )
    log(title)
    for n in notes:
        log(f"NOTE: {n}")
    meta = {
        "title": title,
        "notes": notes,
        "model": name,
        "shape": shape.__dict__,
        "params": n_params,
        "device": describe_device(device),
        "world": world,
        "fsdp2": world > 1,
        "flavor": args.flavor,
        "kernels": args.kernels,
        "gram_algorithm": args.gram_algorithm,
        "weight_decay": args.weight_decay,
        "steps": args.steps,
        "warmup": args.warmup,
        "matmul_tflops_fp16": tflops,
        "matmul_tflops_bf16": tflops_bf16,
        "copy_gbps": gbps,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "timer": "cuda events" if device.type == "cuda" else "perf_counter (cpu)",
        "graph_warmup_steps": GRAPH_WARMUP,
        "complete": False,
    }
    path = output_path(args.out, f"bench_step_{name}_{args.flavor}_w{world}.json") if rank() == 0 else None

    rows: list[dict] = []
    flops: dict[str, float | None] = {}
    walls: dict[str, float] = {}
    for cfg in sorted(configs, key=run_priority):
        why = unavailable_reason(cfg, device, graph_note)
        if why:
            rows.append(not_run(cfg, "unavailable", why))
            continue
        expected_end = time.time() - t_start + estimate_s(cfg, walls)
        if not all_ranks_true(expected_end < args.budget_s, device):
            rows.append(
                not_run(cfg, "skipped", f"would end after --budget-s {args.budget_s:.0f} (at ~{expected_end:.0f} s)")
            )
            log(f"  {cfg.name:<22} skipped (budget)")
            continue
        t_cfg = time.time()
        with applied(cfg.settings):
            row = run_config(cfg, model, grads, device, args, graph_cls)
        row["wall_s"] = walls[cfg.name] = time.time() - t_cfg
        flops[cfg.name] = row.pop("_ns_flops", None)
        rows.append(row)
        write_json(path, {"meta": meta, "results": rows})  # partial results survive a later crash
        log(
            f"  {cfg.name:<22} {row['status']:<6} {fmt(row.get('gpu_ms'), '.2f', 9)} ms "
            f"({row['wall_s']:.0f} s) {row.get('note', '')}"
        )
    order = [c.name for c in configs]
    rows.sort(key=lambda r: order.index(r["name"]))
    attach_flops(rows, flops, {"float16": tflops, "bfloat16": tflops_bf16}, device)
    attach_adamw_floor(rows, model, gbps, device)
    attach_ratios(rows, args.flavor)

    meta.update(wall_s=time.time() - t_start, complete=True)
    if rank() == 0:
        print_table(meta, rows)
        write_json(path, {"meta": meta, "results": rows})
        if path is not None:
            print(f"wrote {path}")
        print(f"total {time.time() - t_start:.0f} s")
    finish(device)


if __name__ == "__main__":
    main()
