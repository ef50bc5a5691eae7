"""Plot or tabulate ``scripts/bench_step.py`` results.

PNG (needs matplotlib): one panel per JSON file, a bar per configuration with the optimizer
step time relative to AdamW, like the paper's Figure 1 (graph rows hatched).
``--markdown``: a Markdown table per JSON file, for docs/benchmarks.md.

    python scripts/plot_step.py out/bench_step_7b_muon_w1.json out/bench_step_1b_muon_w2.json -o step.png
    python scripts/plot_step.py out/*.json --markdown
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

# Bar colours by family: AdamW, the Muon baselines, Dion3 adding one contribution at a time.
COLORS = {
    "adamw": "#7f7f7f",
    "muon_torch": "#bcbd22",
    "muon": "#d62728",
    "dion3_f1_torch": "#ff7f0e",
    "dion3_f1_torch_nomb": "#e377c2",
    "dion3_f1_kernels": "#9467bd",
    "dion3_f1_gram": "#1f77b4",
    "dion3_f1/2": "#17becf",
    "dion3_f1/4": "#2ca02c",
}


def load(path: Path, only: str = "") -> dict:
    """A result file; ``only``: comma-separated glob patterns of the configuration names to keep."""
    data = json.loads(path.read_text())
    if "meta" not in data or "results" not in data:
        raise ValueError(f"{path}: not a bench_step.py result (no 'meta'/'results')")
    if only:
        patterns = only.split(",")
        data["results"] = [r for r in data["results"] if any(fnmatch.fnmatch(r["name"], p) for p in patterns)]
    return data


def base_name(name: str) -> str:
    return name.removesuffix("+graph")


def heading(meta: dict) -> str:
    shape = meta["shape"]
    layers = f"{shape['layers']} layers"
    fsdp = " FSDP2" if meta.get("fsdp2") else ""
    return (
        f"{meta['model']} ({params(meta['params'])}, {layers}) | {meta['device']} x{meta['world']}{fsdp} | "
        f"{meta['flavor']} | median of {meta['steps']} steps"
    )


# ----------------------------------------------------------------------------- markdown
def cell(value: object, spec: str) -> str:
    """``spec`` "auto": 3 significant digits below 100, whole numbers above."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    if spec == "auto":
        spec = ".0f" if abs(value) >= 100 or value == 0 else ".3g"
    return format(value, spec)


def params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e7 else f"{n / 1e6:.2f}M"


def markdown(data: dict) -> str:
    meta, rows = data["meta"], data["results"]
    lines = [f"### {heading(meta)}", ""]
    for note in meta.get("notes", []):
        lines.append(f"Note: {note}  ")
    lines.append(
        f"Matmul rate (measured): fp16 {cell(meta['matmul_tflops_fp16'], 'auto')} TFLOP/s, "
        f"bf16 {cell(meta['matmul_tflops_bf16'], 'auto')} TFLOP/s; timer: {meta['timer']}; "
        f"torch {meta['torch']}; {meta['date']}."
    )
    lines.append("")
    lines.append(
        "| Configuration | CUDA graph | GPU ms (IQR) | x Muon | x AdamW | Host ms | Comm MB | "
        "NS TFLOP | Floor ms | Note |"
    )
    lines.append("|---|:-:|--:|--:|--:|--:|--:|--:|--:|---|")
    for r in rows:
        graph = "yes" if r.get("graph") else ""
        if r.get("status") != "ok":
            lines.append(f"| {r['label']} | {graph} | {r.get('status')} | | | | | | | {r.get('note', '')} |")
            continue
        gpu = f"{r['gpu_ms']:.2f} ({r['gpu_ms_q1']:.2f}-{r['gpu_ms_q3']:.2f})"
        lines.append(
            f"| {r['label']} | {graph} | {gpu} | {cell(r.get('x_muon'), '.2f')} | {cell(r.get('x_adamw'), '.1f')} | "
            f"{cell(r.get('host_ms'), '.2f')} | {cell(r.get('comm_mb'), 'auto')} | {cell(r.get('ns_tflop'), 'auto')} | "
            f"{cell(r.get('floor_ms'), 'auto')} | {r.get('note', '')} |"
        )
    lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- figure
def bars(data: dict) -> list[tuple[str, float, bool, str]]:
    """(label, step time / AdamW, graphed, colour) of every timed configuration."""
    out = []
    for r in data["results"]:
        ratio = r.get("x_adamw")
        if r.get("status") == "ok" and isinstance(ratio, (int, float)):
            out.append((r["label"], float(ratio), bool(r.get("graph")), COLORS.get(base_name(r["name"]), "#8c564b")))
    return out


def plot(datasets: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            f"plot_step.py: the PNG needs matplotlib ({exc}); pip install matplotlib, or use --markdown"
        ) from exc
    widths = [max(4.0, 0.55 * len(bars(d)) + 1.5) for d in datasets]
    fig, axes = plt.subplots(
        1, len(datasets), figsize=(sum(widths), 5.5), squeeze=False, gridspec_kw={"width_ratios": widths}
    )
    for ax, data in zip(axes[0], datasets):
        items = bars(data)
        xs = range(len(items))
        for x, (_, ratio, graphed, color) in zip(xs, items):
            ax.bar(x, ratio, color=color, hatch="//" if graphed else None, edgecolor="black", linewidth=0.5)
            ax.text(x, ratio, f"{ratio:.1f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([label for label, *_ in items], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("optimizer step time / AdamW")
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_title(heading(data["meta"]), fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle("Optimizer step time relative to AdamW (hatched: CUDA graph)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path, help="bench_step.py result files")
    p.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: next to the first JSON)")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables instead of plotting")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated glob patterns of configuration names, e.g. "
        "'adamw,muon,dion3_f1_*+graph,dion3_f1/?+graph'",
    )
    args = p.parse_args(argv)
    datasets = [load(path, args.only) for path in args.json]
    if args.markdown:
        sys.stdout.write("\n".join(markdown(d) for d in datasets))
        return
    plot(datasets, args.output or args.json[0].with_suffix(".png"))


if __name__ == "__main__":
    main()
