"""Plots and the results table of a quality run (scripts/quality_run.py's quality.json).

    python scripts/plot_quality.py OUT/quality.json --out OUT              # two PNGs
    python scripts/plot_quality.py OUT/quality.json --out OUT --markdown OUT/results.md

PNGs: loss_vs_step.png (validation loss against optimizer steps) and loss_vs_opt_time.png
(against the cumulative time spent inside ``optimizer.step()``). ``--markdown`` fills the
``<!-- BEGIN:key -->...<!-- END:key -->`` blocks of the template (default docs/results.md)
and writes the result to the given path; the blocks stay in place, so a filled file can be
refilled. matplotlib is needed for the PNGs only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from benchmarks.machine import ROOT

DEFAULT_TEMPLATE = os.path.join(ROOT, "docs", "results.md")
PNG_STEP = "loss_vs_step.png"
PNG_TIME = "loss_vs_opt_time.png"


def load(*paths: str) -> dict:
    """One report from one or more quality.json files of the same setup (e.g. the runs split
    over several GPUs): the first file's meta, every file's runs, in order."""
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    merged = reports[0]
    for other in reports[1:]:
        clash = merged["runs"].keys() & other["runs"].keys()
        if clash:
            raise ValueError(f"runs {sorted(clash)} appear in more than one JSON")
        if (
            other["meta"]["model"] != merged["meta"]["model"]
            or other["meta"]["args"]["steps"] != merged["meta"]["args"]["steps"]
        ):
            raise ValueError("the JSONs come from different setups (model or steps differ)")
        merged["runs"].update(other["runs"])
        merged["meta"]["argv_parts"] = merged["meta"].get("argv_parts", [merged["meta"]["argv"]]) + other["meta"].get(
            "argv_parts", [other["meta"]["argv"]]
        )
        merged["meta"]["total_wall_s"] = max(
            merged["meta"].get("total_wall_s", 0), other["meta"].get("total_wall_s", 0)
        )
    return merged


def finished(report: dict) -> list[tuple[str, dict]]:
    """Runs that produced a validation curve (diverged runs keep theirs, up to the blow-up)."""
    return [(n, r) for n, r in report["runs"].items() if r.get("val")]


def _y_limits(runs: list[tuple[str, dict]]) -> tuple[float, float]:
    """Zoom on the part where runs differ: from just below the best loss to the worst loss at
    about a fifth of training (the first evals are all near log(vocab) and would flatten it)."""
    finite = [v for _, r in runs for _, v in r["val"] if math.isfinite(v)]
    low = min(finite)
    early = [r["val"][min(2, len(r["val"]) - 1)][1] for _, r in runs]
    high = max(v for v in early if math.isfinite(v)) if any(math.isfinite(v) for v in early) else max(finite)
    pad = 0.05 * max(high - low, 1e-3)
    return low - pad, high + pad


def _style(name: str) -> dict:
    """AdamW dashed, our Dion3 solid, baselines dotted: the families read apart at a glance."""
    if name.startswith("adamw"):
        return {"linestyle": "--", "alpha": 0.8}
    if name.startswith("dion3"):
        return {"linestyle": "-", "linewidth": 2.0}
    return {"linestyle": ":", "linewidth": 2.0}


def opt_seconds_at(run: dict) -> list[float]:
    """Cumulative optimizer-step seconds before each validation point."""
    ms = run.get("opt_ms", [])
    cum, total = [0.0], 0.0
    for m in ms:
        total += m / 1e3
        cum.append(total)
    return [cum[min(step, len(cum) - 1)] for step, _ in run["val"]]


def plot(report: dict, out_dir: str, only: list[str] | None = None) -> list[str]:
    """The two PNGs; ``only`` (glob patterns of run names) picks the curves, since a sweep of
    dozens of runs does not read as one chart (the table keeps every run)."""
    import fnmatch

    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    runs = finished(report)
    if only:
        runs = [(n, r) for n, r in runs if any(fnmatch.fnmatchcase(n, pat) for pat in only)]
        if not runs:
            raise ValueError(f"--plot-only {only} matches no finished run")
    meta = report["meta"]
    title = f"{meta['params']['total'] / 1e6:.0f}M llama3-style, {meta['tokens_per_step']} tok/step, {meta['device']}"
    paths = []
    for fname, xlabel, xs_of in (
        (PNG_STEP, "optimizer step", lambda r: [s for s, _ in r["val"]]),
        (PNG_TIME, "cumulative optimizer.step() time (s)", opt_seconds_at),
    ):
        fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
        for name, run in runs:
            ax.plot(xs_of(run), [v for _, v in run["val"]], label=name, **_style(name))
        ax.set_ylim(*_y_limits(runs))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 if len(runs) <= 18 else 2)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- markdown
def _fmt(x: float | None, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def best_adamw(report: dict) -> tuple[str, float] | None:
    scored = [
        (n, r["final_val"])
        for n, r in report["runs"].items()
        if n.startswith("adamw") and r.get("final_val") is not None and math.isfinite(r["final_val"])
    ]
    return min(scored, key=lambda t: t[1]) if scored else None


def results_table(report: dict) -> str:
    ref = best_adamw(report)
    head = (
        "| run | optimizer | peak lr | final val loss | Δ vs best AdamW | best val loss | "
        "opt step, median ms (device) | opt step, median ms (host) | fwd+bwd, median ms | "
        "total opt time (s) | status |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )
    rows = []
    for name, r in report["runs"].items():
        spec = r["spec"]
        final = r.get("final_val")
        delta = f"{final - ref[1]:+.4f}" if final is not None and ref else "—"
        rows.append(
            f"| {name} | {spec.get('label') or spec['kind']} | {spec['lr']:g} | {_fmt(final)} | {delta} | "
            f"{_fmt(r.get('min_val'))} | {_fmt(r.get('median_opt_ms'), 2)} | {_fmt(r.get('median_host_opt_ms'), 2)} | "
            f"{_fmt(r.get('median_fwd_bwd_ms'), 2)} | {_fmt(r.get('total_opt_s'), 2)} | {r['status']} |"
        )
    note = f"\n\nΔ is against the best AdamW run ({ref[0]})." if ref else ""
    return "\n".join([head, *rows]) + note


def setup_text(report: dict) -> str:
    m = report["meta"]
    c, p, a = m["model"], m["params"], m["args"]
    corpus = m["corpus"]
    return "\n".join(
        [
            f"- Model: llama3-style decoder, dim {c['dim']}, {c['n_layers']} layers, {c['n_heads']} heads "
            f"({c['n_kv_heads']} KV heads), SwiGLU {c['ffn_dim']}, RoPE θ={c['rope_theta']:g}, untied head, "
            f"vocab {c['vocab_size']}; {p['total'] / 1e6:.1f}M parameters, {p['matrix'] / 1e6:.1f}M in block matrices.",
            f"- Data: {corpus.get('train_tokens', 0):,} training / {m['val_tokens']:,} validation tokens "
            f"({corpus.get('builder', corpus.get('source'))}, BPE vocab {corpus.get('vocab_size')}, "
            f"{corpus.get('val_percent')}% of documents held out).",
            f"- Training: {a['steps']} steps × {m['tokens_per_step']:,} tokens (seq {c['seq_len']}), "
            f"{m['train_tokens_per_run']:,} tokens per run ({m['epochs_per_run']} epochs), bf16 autocast, "
            f"grad clip {a['grad_clip']}, same init and data order (seed {a['seed']}) for every run.",
            f"- Schedule: {m['schedule']}; warmup {a['warmup']} steps.",
            f'- Matrix optimizers: base lr per run (column "peak lr"; × √(d_out/d_in) except in torch.optim.Muon), '
            f"momentum {a['momentum']}, weight decay {a['matrix_weight_decay']}; "
            f"embeddings/head/norms: AdamW lr {a['scalar_lr']:g}, β=(0.9, 0.95), no weight decay. "
            f"AdamW runs: weight decay {a['adamw_weight_decay']} on matrices only.",
            f"- Validation every {a['eval_every']} steps on the same {m['val_tokens']:,} held-out tokens. "
            f"Step-time medians skip each run's first 5 steps.",
        ]
    )


def fill_blocks(template: str, values: dict[str, str]) -> str:
    """Replace the content of every ``<!-- BEGIN:key -->...<!-- END:key -->`` block named in
    ``values``; unknown blocks are left as they are."""

    def repl(match: re.Match) -> str:
        key = match.group(1)
        if key not in values:
            return match.group(0)
        body = values[key]
        sep = "\n" if "\n" in body else ""
        return f"<!-- BEGIN:{key} -->{sep}{body}{sep}<!-- END:{key} -->"

    return re.sub(r"<!-- BEGIN:(\w+) -->.*?<!-- END:\1 -->", repl, template, flags=re.S)


def markdown(report: dict, template: str, image_prefix: str) -> str:
    m = report["meta"]
    values = {
        "date": m["date_utc"],
        "card": m["device"],
        "software": f"torch {m['torch']}, Python {m['python']}, commit {m.get('git_commit') or 'unknown'}",
        "argv": " and ".join("`python " + " ".join(argv) + "`" for argv in m.get("argv_parts", [m["argv"]])),
        "runtime": f"{m.get('total_wall_s', 0):.0f} s for all runs (calibration: {m.get('calibration')})",
        "setup": setup_text(report),
        "table": results_table(report),
        "figures": f"![validation loss vs step]({image_prefix}{PNG_STEP})\n\n"
        f"![validation loss vs optimizer time]({image_prefix}{PNG_TIME})",
    }
    return fill_blocks(template, values)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="+", help="quality.json file(s) written by scripts/quality_run.py (merged)")
    p.add_argument("--out", help="folder for the PNGs (default: the JSON's folder)")
    p.add_argument("--no-plots", action="store_true", help="markdown only (no matplotlib needed)")
    p.add_argument("--markdown", help="write the filled results page here")
    p.add_argument("--template", default=DEFAULT_TEMPLATE, help="page with BEGIN/END blocks")
    p.add_argument("--image-prefix", default="quality/", help="path of the PNGs as linked from the page")
    p.add_argument(
        "--plot-only",
        type=lambda v: v.split(","),
        default=None,
        help="comma-separated glob patterns of the runs to draw (default: all)",
    )
    a = p.parse_args(argv)
    report = load(*a.json)
    out = a.out or os.path.dirname(os.path.abspath(a.json[0]))
    if not a.no_plots:
        os.makedirs(out, exist_ok=True)
        for path in plot(report, out, a.plot_only):
            print(f"wrote {path}")
    if a.markdown:
        with open(a.template) as f:
            page = markdown(report, f.read(), a.image_prefix)
        with open(a.markdown, "w") as f:
            f.write(page)
        print(f"wrote {a.markdown}")


if __name__ == "__main__":
    sys.exit(main())
