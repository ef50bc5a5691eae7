"""What the rows of scripts/bench_step.py are compared with (the NS FLOP floor at the measured
matmul rate, AdamW's memory floor, the Muon, AdamW and microsoft/dion rows) and the table."""

from __future__ import annotations

import torch
import torch.nn as nn

from benchmarks.output import fmt
from benchmarks.ranks import reduce_max
from benchmarks.step_configs import anchor_of
from dion3_titan.dist.layout import to_local


def ns_rate(row: dict, tflops: dict[str, float]) -> float:
    """The measured matmul TFLOP/s of the dtype a row's Newton-Schulz runs in."""
    bf16 = row["kind"] == "torch_muon" or row["options"].get("ns_dtype") == "bfloat16"
    return tflops["bfloat16" if bf16 else "float16"]


def attach_flops(
    rows: list[dict], flops: dict[str, float | None], tflops: dict[str, float], device: torch.device
) -> None:
    """NS TFLOP of the busiest rank and its floor at the measured matmul rate (None: unknown)."""
    names = list(flops)
    worst = reduce_max([-1.0 if flops[n] is None else flops[n] for n in names], device)
    for row in rows:
        if row["name"] in flops and row.get("status") == "ok":
            f = worst[names.index(row["name"])]
            row["ns_tflop"] = f / 1e12 if f >= 0 else None
            row["floor_ms"] = f / (ns_rate(row, tflops) * 1e12) * 1e3 if f >= 0 else None


def attach_adamw_floor(rows: list[dict], model: nn.Module, gbps: float, device: torch.device) -> None:
    """AdamW has no NS: its floor is memory, fp32 p, g, m, v read and p, m, v written (28 B
    per local parameter) at the measured copy bandwidth."""
    row = next((r for r in rows if r["name"] == "adamw" and r.get("status") == "ok"), None)
    local = sum(to_local(p).numel() for p in model.parameters())
    floor = reduce_max([28.0 * local / (gbps * 1e9) * 1e3], device)[0]
    if row is not None:
        row["floor_ms"] = floor
        row["note"] = "floor: memory, 28 B/param at the copy bandwidth"


def attach_ratios(rows: list[dict], flavor: str) -> None:
    ok = {r["name"]: r for r in rows if r.get("status") == "ok"}
    for row in rows:
        if row.get("status") != "ok":
            continue
        for ref, key in (("muon", "x_muon"), ("adamw", "x_adamw"), (anchor_of(row["name"], flavor), "x_dion")):
            row[key] = row["gpu_ms"] / ok[ref]["gpu_ms"] if ref in ok and ok[ref]["gpu_ms"] > 0 else None


def print_table(meta: dict, rows: list[dict]) -> None:
    print(f"\n{meta['title']}")
    for n in meta["notes"]:
        print(f"NOTE: {n}")
    head = (
        f"{'config':<22} {'GPU ms':>9} {'IQR':>13} {'xMuon':>6} {'xAdamW':>7} {'xDion':>6} {'host ms':>8} "
        f"{'comm MB':>8} {'NS TFLOP':>9} {'floor ms':>9} {'mem GB':>7}  note"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        iqr = f"{r['gpu_ms_q1']:.1f}-{r['gpu_ms_q3']:.1f}" if r.get("status") == "ok" else "-"
        note = r.get("note", "") if r.get("status") == "ok" else f"[{r.get('status')}] {r.get('note', '')}"
        print(
            f"{r['name']:<22} {fmt(r.get('gpu_ms'), '.2f', 9)} {iqr:>13} {fmt(r.get('x_muon'), '.2f', 6)} "
            f"{fmt(r.get('x_adamw'), '.1f', 7)} {fmt(r.get('x_dion'), '.2f', 6)} {fmt(r.get('host_ms'), '.2f', 8)} {fmt(r.get('comm_mb'), 'auto', 8)} "
            f"{fmt(r.get('ns_tflop'), 'auto', 9)} {fmt(r.get('floor_ms'), 'auto', 9)} "
            f"{fmt(r.get('peak_mem_gb'), '.1f', 7)}  {note}"
        )
