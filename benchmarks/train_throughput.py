"""Throughput of real torchtitan training with AdamW, Muon and Dion3: llama3 at about 1B
parameters on one device, trained on the project's offline corpus.

Each optimizer is one training run in its own process (benchmarks/train_child.py), which runs
what `python -m dion3_titan.train` runs (torchtitan's Trainer and main, the plugin registered),
with the environment torchrun gives a single rank and a Trainer subclass that only adds clocks.
The config is the project's llama3 debug config of that optimizer (`configs/llama3_debug_gpu_*`
on a GPU, `configs/llama3_debug_*` on a CPU) with the model, batch and step count below; it is
written to `outputs/bench_train/<name>/config.toml` (beside the run's log) and into the JSON.

  * model: torchtitan's llama3 Transformer (``LLAMA3_ARGS`` in benchmarks/llama.py), dim 2048,
    16 layers, 16 heads, 8 KV heads, SwiGLU hidden 8192 (about 1.0B parameters), vocabulary of
    the corpus's BPE tokenizer;
  * precision: on one GPU torchtitan applies no FSDP; it trains fp32 parameters under bf16
    autocast (its AMP path); on a CPU everything is fp32;
  * optimizer step: captured in a CUDA graph where the plugin's default does so (the Dion3
    engine on a GPU), eager elsewhere (AdamW is torchtitan's own, never captured);
  * the "+compile" rows: torchtitan's ``[compile] enable = true`` with components model and
    loss (each TransformerBlock and the loss compiled by torch.compile, inductor), beside the
    captured optimizer step. Compilation happens in the first step, inside the untimed warm-up;
    the child counts compilations per step and a row that compiled during its timed steps fails.

Measured per step (the Trainer subclass, rank 0):
  * step ms: wall time of torchtitan's ``train_step`` (next batch, forward, backward, clipping,
    optimizer, scheduler, logging), with a device synchronize at its end, so each step starts
    on an idle device;
  * optimizer ms: ``optimizers.step()`` timed by CUDA events recorded around the call on the
    current stream (no sync of ours inside the step: the device time from the point backward
    and clipping finished to the point the step's last kernel finished, host gaps included);
    on a CPU, perf_counter around the call;
  * peak memory: ``torch.cuda.max_memory_allocated`` read just before torchtitan's own per-step
    log resets it, maximum over all steps (warm-up and graph capture included); on a CPU the
    process's peak RSS.
The parent reports medians over the steps after the first ``--warmup``: tokens/s (tokens per
step over the median step time), step ms with its quartiles, optimizer ms and the optimizer's
share (median over steps of optimizer ms / step ms), and the loss of the first and last steps
(the loss must fall).

The whole step's time drifts from run to run by more than the optimizers differ (a card's clocks
and the host move over minutes), so ``--rounds N`` runs the selection N times, every second
round in reverse order (A B C, C B A, ...): a drift over the call then weighs on every run
alike. A second table pools each run's timed steps over its rounds (tokens/s from the median of
all of them) and gives each run's tokens/s as a share of AdamW's.

Controls, run only when ``--only`` names them (``CONTROL_RUNS``): AdamW and Dion3 f = 1/8 at
lr 0, which keep the weights they started from, so the two differ in the optimizer alone (an
lr-0 run's share is of AdamW's at lr 0); and Dion3 f = 1/8 without the CUDA graph.

    python scripts/bench_train.py --out results/          # one GPU: 7 runs
    python scripts/bench_train.py --only adamw,dion3_f1/8 --rounds 2   # ABBA: adamw, f1/8, f1/8, adamw
    python scripts/bench_train.py --tiny                  # CPU smoke test: tiny model, 4 steps

A Markdown table goes to stdout; JSON (bench_train_<model>.json) to ``--out`` (a folder or a
.json file; default $OUT), rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.llama import LLAMA3_ARGS
from benchmarks.machine import ROOT, device_name
from benchmarks.output import fmt, output_path, write_json
from benchmarks.timing import quartiles
from benchmarks.train_child import FLAVOR, MODEL_ENV, RECORD

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: torchtitan depends on tomli
    import tomli as tomllib

ROPE_THETA = 500000  # llama3's


@dataclass(frozen=True)
class Run:
    name: str
    label: str
    config: str  # the project config it starts from: configs/llama3_debug[_gpu]_<config>.toml
    optimizer: dict = field(default_factory=dict)  # [optimizer] keys changed from that config
    compile: bool = False  # torchtitan's [compile] enable, components model and loss


RUNS = [
    Run("adamw", "AdamW (torchtitan's)", "adamw"),
    Run("muon", "Muon (Dion3 engine, f = 1, Muon flavor)", "muon"),
    Run("dion3_f1", "Dion3 f = 1 (NorMuon)", "dion3", {"fraction": 1.0}),
    Run("dion3_f1/4", "Dion3 f = 1/4 (NorMuon)", "dion3", {"fraction": 0.25}),
    Run("dion3_f1/8", "Dion3 f = 1/8 (NorMuon)", "dion3", {"fraction": 0.125}),
    Run("adamw+compile", "AdamW (torchtitan's), compiled", "adamw", compile=True),
    Run("dion3_f1/4+compile", "Dion3 f = 1/4 (NorMuon), compiled", "dion3", {"fraction": 0.25}, compile=True),
]
# Controls that --only selects (no default run includes them): what a step costs apart from the
# optimizer. At lr 0 every run keeps the weights it started from (the same seed), so two such
# runs differ in the optimizer's work and machinery alone, not in the weights they train.
CONTROL_RUNS = [
    Run("adamw+lr0", "AdamW (torchtitan's), lr 0", "adamw", {"lr": 0.0}),
    Run("dion3_f1/8+lr0", "Dion3 f = 1/8 (NorMuon), lr 0", "dion3", {"fraction": 0.125, "lr": 0.0, "adamw_lr": 0.0}),
    Run(
        "dion3_f1/8+eager", "Dion3 f = 1/8 (NorMuon), no CUDA graph", "dion3", {"fraction": 0.125, "cuda_graph": False}
    ),
]
COMPILE_COMPONENTS = ["model", "loss"]  # torchtitan's [compile] components of the "+compile" rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(LLAMA3_ARGS), default="1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="local batch size (sequences per step)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the statistics")
    p.add_argument("--corpus", choices=("small", "large"), default="large", help="offline corpus (and its tokenizer)")
    p.add_argument(
        "--only",
        help="comma-separated run names: "
        + ",".join(r.name for r in RUNS + CONTROL_RUNS)
        + " (default: all but the controls)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="run the selection this many times, every second round reversed"
    )
    p.add_argument("--timeout-s", type=float, default=300, help="per run")
    p.add_argument("--out", help="folder or .json file for the JSON (default $OUT)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, seq 64, batch 2, 4 steps")
    a = p.parse_args(argv)
    if a.tiny:
        a.model, a.seq_len, a.batch, a.steps, a.warmup, a.corpus = "tiny", 64, 2, 4, 2, "small"
    if not 0 <= a.warmup < a.steps:
        p.error(f"--warmup must be in [0, --steps), got {a.warmup} with --steps {a.steps}")
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    return a


def selected_runs(only: str | None) -> list[Run]:
    if not only:
        return list(RUNS)
    names = only.split(",")
    known = RUNS + CONTROL_RUNS
    unknown = set(names) - {r.name for r in known}
    if unknown:
        raise SystemExit(f"--only: unknown run(s) {sorted(unknown)}; known: {[r.name for r in known]}")
    return [r for r in known if r.name in names]


def ensure_corpus(size: str) -> Path:
    """The offline corpus + tokenizer at its default place, built when missing."""
    from dion3_titan.data.build import DEFAULTS, build, default_out, is_built

    out = ROOT / default_out(size)
    if not is_built(str(out)):
        t0 = time.perf_counter()
        print(f"building the {size} corpus at {out} ...", flush=True)
        build(size, str(out), val_percent=2.0, **DEFAULTS[size])
        print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def job_config(run: Run, args: argparse.Namespace, corpus: Path, dump: Path, on_gpu: bool) -> dict:
    """The project's debug config of this optimizer with the benchmark's model, data and steps."""
    base = ROOT / "configs" / f"llama3_debug{'_gpu' if on_gpu else ''}_{run.config}.toml"
    cfg = tomllib.loads(base.read_text())
    cfg["job"].update(dump_folder=str(dump), description=f"bench_train: {run.label}")
    cfg["metrics"].update(log_freq=1, enable_tensorboard=False)  # every step logs (peak memory is read there)
    cfg["model"].update(flavor=FLAVOR, hf_assets_path=str(corpus / "tokenizer"))
    cfg["training"].update(
        dataset_path=str(corpus), seq_len=args.seq_len, local_batch_size=args.batch, steps=args.steps
    )
    cfg["lr_scheduler"]["warmup_steps"] = min(cfg["lr_scheduler"]["warmup_steps"], args.steps)
    cfg["validation"]["enable"] = False
    cfg["checkpoint"]["enable"] = False
    cfg["optimizer"].update(run.optimizer)
    cfg.setdefault("compile", {}).update(enable=run.compile, components=COMPILE_COMPONENTS)
    return cfg


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (str, list)):
        return json.dumps(v)  # a JSON string or list of numbers/strings is valid TOML
    raise TypeError(f"no TOML form for {v!r}")


def write_toml(cfg: dict, path: Path) -> None:
    lines = []
    for section, keys in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in keys.items()]
        lines.append("")
    path.write_text("\n".join(lines))


def model_args(model: str, corpus: Path) -> dict:
    vocab = json.loads((corpus / "meta.json").read_text())["vocab_size"]
    return {**LLAMA3_ARGS[model], "vocab_size": vocab, "rope_theta": ROPE_THETA}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: Path, margs: dict, log: Path, timeout_s: float) -> tuple[int, float]:
    """One training process of this module, with the environment torchrun gives a single rank
    (torchrun itself would add a second interpreter start, ~6 s on a small CPU, to each run).
    (exit code, seconds); 124 on timeout."""
    cmd = [sys.executable, "-m", "benchmarks.train_child", "--job.config_file", str(config)]
    env = {**os.environ, MODEL_ENV: json.dumps(margs)}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"  # a checkout, installed or not
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def compiles_in(steps: list[dict], warmup: int) -> tuple[int, int]:
    """torch.compile's compilations during the warm-up steps and during the timed steps (the
    child records a running count at the end of every step)."""
    before = steps[warmup - 1]["compiles"] if warmup else 0
    return before, steps[-1]["compiles"] - before


def summarize(run: Run, record: dict, warmup: int) -> dict:
    """The row of one finished run: medians over the steps after ``warmup``. A row that
    compiled during its timed steps is marked failed (its times include compilation), and so is
    a compiled row whose compilations were not counted (that check could not fail then)."""
    timed = record["steps"][warmup:]
    step_ms = [s["step_ms"] for s in timed]
    opt_ms = [s["optimizer_ms"] for s in timed]
    q1, median, q3 = quartiles(step_ms)
    warm_compiles, timed_compiles = compiles_in(record["steps"], warmup)
    status = "ok"
    if timed_compiles:
        status = f"failed: {timed_compiles} compilations in timed steps (raise --warmup)"
    elif record["compiled"] and not warm_compiles:  # the count itself is broken (train_child.compile_count)
        status = "failed: compiled, but no compilation counted"
    return {
        "name": run.name,
        "label": run.label,
        "status": status,
        "compiled": record["compiled"],
        "compiles_in_warmup": warm_compiles,
        "compiles_in_timed_steps": timed_compiles,
        "cuda_graph": record["cuda_graph"],
        "cuda_graph_captured": record["cuda_graph_captured"],
        "tokens_per_s": record["tokens_per_step"] / (median / 1e3),
        "step_ms": median,
        "step_ms_iqr": [q1, q3],
        "optimizer_ms": statistics.median(opt_ms),
        "optimizer_share": statistics.median(o / s for o, s in zip(opt_ms, step_ms, strict=True)),
        "peak_gb": max(s["peak_gb"] for s in record["steps"]),
        "first_loss": record["steps"][0]["loss"],
        "final_loss": record["steps"][-1]["loss"],
        "timed_steps": len(timed),
        "record": record,
    }


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def schedule(runs: list[Run], rounds: int) -> list[tuple[int, Run]]:
    """(round, run) in the order they run: the selection, then reversed, and so on."""
    return [(r, run) for r in range(rounds) for run in (runs if r % 2 == 0 else runs[::-1])]


def pooled(rows: list[dict], warmup: int) -> list[dict]:
    """One row per run name over its finished rounds: tokens/s from the median of every timed
    step of every round, the median optimizer ms, and tokens/s as a share of its AdamW run's
    (``adamw_of``; None without that row)."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    out = []
    for name in names:
        done = [r for r in rows if r["name"] == name and r["status"] == "ok"]
        if not done:
            continue
        steps = [s for r in done for s in r["record"]["steps"][warmup:]]
        step_ms = statistics.median(s["step_ms"] for s in steps)
        out.append(
            {
                "name": name,
                "label": done[0]["label"],
                "rounds": len(done),
                "tokens_per_s": done[0]["record"]["tokens_per_step"] / (step_ms / 1e3),
                "step_ms": step_ms,
                "optimizer_ms": statistics.median(s["optimizer_ms"] for s in steps),
                "tokens_per_s_each_round": [r["tokens_per_s"] for r in done],
            }
        )
    speed = {p["name"]: p["tokens_per_s"] for p in out}
    for p in out:
        adamw = speed.get(adamw_of(p["name"]))
        p["vs_adamw"] = None if adamw is None else p["tokens_per_s"] / adamw
    return out


def adamw_of(name: str) -> str:
    """The AdamW run a run's tokens/s is compared with: the lr-0 control for an lr-0 run."""
    return "adamw+lr0" if name.endswith("+lr0") else "adamw"


def pooled_markdown(rows: list[dict]) -> str:
    lines = [
        "| Optimizer | rounds | tokens/s (each round) | step ms | optimizer ms | tokens/s ÷ AdamW's |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for p in rows:
        each = ", ".join(f"{t:.0f}" for t in p["tokens_per_s_each_round"])
        share = "" if p["vs_adamw"] is None else f"{100 * p['vs_adamw']:.1f}%"
        lines.append(
            f"| {p['label']} | {p['rounds']} | {p['tokens_per_s']:.0f} ({each}) | {p['step_ms']:.1f} | "
            f"{p['optimizer_ms']:.2f} | {share} |"
        )
    return "\n".join(lines)


def run_one(run: Run, args: argparse.Namespace, corpus: Path, folder: Path, on_gpu: bool, round_: int = 0) -> dict:
    dump = folder / (run.name.replace("/", "_") + (f"_round{round_}" if args.rounds > 1 else ""))
    dump.mkdir(parents=True, exist_ok=True)
    (dump / RECORD).unlink(missing_ok=True)  # never report an earlier run's record
    config, cfg = dump / "config.toml", job_config(run, args, corpus, dump, on_gpu)
    write_toml(cfg, config)
    log = dump / "train.log"
    print(f"== {run.name}: {run.label} (log: {log})", flush=True)
    rc, wall = launch(config, model_args(args.model, corpus), log, args.timeout_s)
    record_path = dump / RECORD
    if rc != 0 or not record_path.exists():
        why = "timed out" if rc == 124 else f"exit code {rc}"
        print(f"   FAILED ({why}); last lines of its log:\n{log_tail(log)}", flush=True)
        return {
            "name": run.name,
            "label": run.label,
            "round": round_,
            "status": f"failed: {why}",
            "wall_s": wall,
            "config": cfg,
        }
    row = summarize(run, json.loads(record_path.read_text()), args.warmup)
    row.update(round=round_, wall_s=wall, config=cfg)
    print(
        f"   {row['tokens_per_s']:.0f} tokens/s, step {row['step_ms']:.1f} ms, loss {row['first_loss']:.3f} -> "
        f"{row['final_loss']:.3f}, {wall:.0f} s{'' if row['status'] == 'ok' else ' ' + row['status'].upper()}",
        flush=True,
    )
    return row


def graph_cell(row: dict) -> str:
    if not row["cuda_graph"]:
        return ""
    return "yes" if row["cuda_graph_captured"] else "not captured"


def markdown(rows: list[dict], memory: str) -> str:
    head = (
        f"| Optimizer | compiled | CUDA graph | tokens/s | step ms (IQR) | optimizer ms | optimizer share "
        f"| {memory} GB | loss at step 1 | loss at end |"
    )
    lines = [head, "|---|:-:|:-:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        label = r["label"] + (f" (round {r['round'] + 1})" if r.get("round") else "")
        if "step_ms" not in r:  # the run did not finish
            lines.append(f"| {label} | | | {r['status']} | | | | | | |")
            continue
        iqr = f"{fmt(r['step_ms'], '.1f', 0)} ({r['step_ms_iqr'][0]:.1f}-{r['step_ms_iqr'][1]:.1f})"
        tokens = fmt(r["tokens_per_s"], ".0f", 0) if r["status"] == "ok" else r["status"]
        lines.append(
            f"| {label} | {'yes' if r['compiled'] else ''} | {graph_cell(r)} | {tokens} | {iqr} | "
            f"{fmt(r['optimizer_ms'], '.2f', 0)} | {fmt(100 * r['optimizer_share'], '.1f', 0)}% | "
            f"{fmt(r['peak_gb'], '.1f', 0)} | {fmt(r['first_loss'], '.3f', 0)} | {fmt(r['final_loss'], '.3f', 0)} |"
        )
    return "\n".join(lines)


def meta(args: argparse.Namespace, corpus: Path, on_gpu: bool) -> dict:
    margs = model_args(args.model, corpus)
    return {
        "model": args.model,
        "model_args": margs,
        "seq_len": args.seq_len,
        "local_batch_size": args.batch,
        "steps": args.steps,
        "warmup_steps_untimed": args.warmup,
        "rounds": args.rounds,
        "warmup_covers": "kernel compilation, the optimizer graph's eager steps and capture, and torch.compile "
        "(+compile rows; compilations are counted per step and must all fall in the warm-up)",
        "compile_components": COMPILE_COMPONENTS,
        "corpus": str(corpus.relative_to(ROOT)),
        "device": device_name(torch.device("cuda" if on_gpu else "cpu")),
        "precision": "bf16 autocast (torchtitan AMP), fp32 parameters" if on_gpu else "fp32",
        "memory": "torch.cuda.max_memory_allocated" if on_gpu else "process peak RSS",
        "optimizer_timer": "cuda events around optimizers.step()"
        if on_gpu
        else "perf_counter around optimizers.step()",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = selected_runs(args.only)
    on_gpu = torch.cuda.is_available()
    corpus = ensure_corpus(args.corpus)
    out = output_path(args.out, f"bench_train_{args.model}.json")
    folder = ROOT / "outputs" / "bench_train"  # configs, logs, records; the JSON has what matters
    data = {"meta": meta(args, corpus, on_gpu), "results": [], "pooled": []}
    for round_, run in schedule(runs, args.rounds):
        data["results"].append(run_one(run, args, corpus, folder, on_gpu, round_))
        data["pooled"] = pooled(data["results"], args.warmup)
        write_json(out, data)
    m = data["meta"]
    print(
        f"\n### llama3 {args.model} | {m['device']} x1 | seq {args.seq_len} x batch {args.batch} | "
        f"{m['precision']} | median of {args.steps - args.warmup} steps after {args.warmup}\n"
    )
    print(markdown(data["results"], "peak GPU" if on_gpu else "peak RSS"))
    print(f"\nPooled over {args.rounds} round(s), in the order run:\n")
    print(pooled_markdown(data["pooled"]))
    if out:
        print(f"\nJSON: {out}")
    return 0 if all(r["status"] == "ok" for r in data["results"]) else 1
