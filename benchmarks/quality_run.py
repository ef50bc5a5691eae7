"""Training-quality evidence on one GPU (issue 9): the same llama3-style model, data order,
initial weights and LR schedule for every optimizer, run one after another.

Runs (in this order; ``--runs`` picks a subset by name prefix):
  adamw_lr<η>        AdamW on every parameter, at each lr of ``--adamw-lrs``
then for each base lr of ``--matrix-lrs`` (suffix ``_lr<η>`` when there are several or the one
value is not the default, ``_mu<μ>`` for a non-default ``--momentum``):
  muon_torch         torch.optim.Muon (its own conventions: Nesterov, lr x sqrt(max(1, out/in)))
  muon_plain         the Muon baseline: every row, standard NS5 with Muon's quintic, lr x
                     sqrt(out/in) (our engine; tests/test_dion3_core.py holds it to a textbook Muon)
  dion3_f1_standard  Dion3 f=1, standard NS (Polar Express coefficients, our default)
  dion3_f1_gram      Dion3 f=1, Gram NS
  dion3_f0.25        Dion3 f=1/4, lr transfer η/√f (our default), NS algorithm "auto"
  normuon_plain, dion3n_*   the same four with the NorMuon flavor (the paper's main setting)
  prmuon             Periodic Row-wise Muon (dion3_titan.optim.prmuon)
  msdion3n_f<f>      microsoft/dion's Dion3 (NorMuon flavor, ``import dion``: the paper authors'
                     code) at f = ``--fraction``, lr η/√f (it has no lr transfer of its own), for
                     a side-by-side check of ours; only when ``--runs`` names it, skipped when
                     ``dion`` cannot be imported
Block matrices go to the orthogonalizing optimizer through ``routing.build_param_groups``;
embeddings, the output head and norms to AdamW (``--scalar-lr``, no weight decay; App. D.1).

Schedule (App. D.1): linear warmup, constant, linear cooldown over the last 25% of steps.
Validation loss on a fixed held-out set every ``--eval-every`` steps; forward+backward and
optimizer-step times per step (CUDA events around ``step()``, after a synchronize so only the
step is timed; perf_counter on CPU). After every run the whole JSON is rewritten to
``--out``/quality.json, so an interrupted command still returns the runs it finished.

The pieces: the model (benchmarks/quality_model.py, no torchtitan needed), the data
(quality_data.py), the runs and their optimizers (quality_optim.py), one run's training loop and
the step calibration (quality_train.py); this module holds the command line and the report.

    python scripts/quality_run.py --out /tmp/q                      # GPU preset
    python scripts/quality_run.py --tiny --data /tmp/tiny --out /tmp/q   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict

import torch

from benchmarks.machine import ROOT, device_name, git_commit
from benchmarks.output import write_json
from benchmarks.quality_data import TrainBatches, load_corpus, val_batches
from benchmarks.quality_model import PRESETS, ModelConfig, Transformer, count_params
from benchmarks.quality_optim import MATRIX_LR, MOMENTUM, default_runs, missing
from benchmarks.quality_train import calibrate_steps, train_one
from benchmarks.quality_train import lr_multiplier as lr_multiplier  # tests/test_quality_script.py


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, few steps: CPU smoke run")
    p.add_argument("--data", help="corpus folder (default data/quality)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default $OUT)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (gpu 500, tiny 4)")
    p.add_argument("--batch", type=int, help="sequences per step (gpu 16 x 1024 tokens, tiny 2 x 16)")
    p.add_argument("--warmup", type=int, help="warmup steps (default 5%% of steps, at least 1)")
    p.add_argument("--cooldown-frac", type=float, default=0.25)
    p.add_argument("--final-lr-frac", type=float, default=0.0, help="lr multiplier at the last step")
    p.add_argument("--eval-every", type=int, help="validation every N steps (gpu steps/10, tiny steps/2)")
    p.add_argument("--val-tokens", type=int, help="validation tokens, a cap (gpu 262144, tiny 64)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--runs", help="comma-separated name prefixes of the runs to do (default all)")
    p.add_argument("--adamw-lrs", type=lambda s: [float(v) for v in s.split(",")], default=[5e-4, 1e-3, 1.5e-3])
    p.add_argument("--adamw-weight-decay", type=float, default=0.1, help="AdamW runs, matrices only")
    p.add_argument(
        "--matrix-lrs",
        type=lambda s: [float(v) for v in s.split(",")],
        default=[MATRIX_LR],
        help="base lr(s) of the orthogonalized matrices; every Muon-family run per value "
        "(run names get an _lr suffix unless the only value is the default)",
    )
    p.add_argument("--matrix-weight-decay", type=float, default=0.01, help="App. D.1")
    p.add_argument("--momentum", type=float, default=MOMENTUM)
    p.add_argument("--fraction", type=float, default=0.25, help="f of the compressed Dion3 run")
    p.add_argument("--scalar-lr", type=float, default=3e-3, help="AdamW lr of embeddings/head/norms in non-AdamW runs")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip, 0 = off")
    p.add_argument("--cuda-graph", action="store_true", help="Dion3 runs: capture the step in a CUDA graph")
    p.add_argument("--time-budget-s", type=float, help="shrink --steps to fit (gpu 340 s; 0 = never)")
    p.add_argument("--overhead", type=float, default=1.35, help="calibration: step cost vs an AdamW step")
    p.add_argument("--calibration-steps", type=int, default=8)
    p.add_argument("--min-steps", type=int, default=100, help="calibration never goes below this")
    p.add_argument("--deadline-s", type=float, help="skip a run that would end after this (gpu 400 s)")
    a = p.parse_args(argv)
    gpu = not a.tiny
    a.preset = "tiny" if a.tiny else "gpu"
    a.data = a.data or os.path.join(ROOT, "data", "quality")
    a.steps = a.steps or (500 if gpu else 4)
    a.batch = a.batch or (16 if gpu else 2)
    a.val_tokens = a.val_tokens or (1 << 18 if gpu else 64)
    a.evals = 10 if gpu else 2  # validation points besides step 0
    a.time_budget_s = (340.0 if gpu else 0.0) if a.time_budget_s is None else a.time_budget_s
    a.deadline_s = (400.0 if gpu else 0.0) if a.deadline_s is None else a.deadline_s
    if not a.out:
        p.error("--out is required when $OUT is not set")
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # tiny matrices: threads only add contention on a busy CPU
    try:
        return run_all(args, argv)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside pytest: leave it as found


def run_all(args: argparse.Namespace, argv: list[str] | None) -> dict:
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "quality.json")

    train_ids, val_ids, corpus = load_corpus(args.data, device)
    cfg = ModelConfig(**{**asdict(PRESETS[args.preset]), "vocab_size": corpus["vocab_size"]})
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    runs = default_runs(args)
    unavailable = {kind: missing(kind) for kind in ("prmuon", "ms_dion3")}
    calibration = None
    if args.time_budget_s > 0:
        probe = TrainBatches(train_ids, cfg.seq_len, args.batch, args.calibration_steps + 3, args.seed + 1)
        calibration = calibrate_steps(model, init_state, probe, args, len(runs), device)
    # Defaults that follow the (possibly calibrated) number of steps.
    args.warmup = args.warmup or max(1, args.steps // 20)
    args.eval_every = args.eval_every or max(1, args.steps // args.evals)
    data = TrainBatches(train_ids, cfg.seq_len, args.batch, args.steps, args.seed)
    val = val_batches(val_ids, cfg.seq_len, args.batch, args.val_tokens)

    tokens_per_step = args.batch * cfg.seq_len
    params = count_params(model)
    report: dict = {
        "meta": {
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "argv": sys.argv if argv is None else ["scripts/quality_run.py", *argv],
            "args": {k: v for k, v in vars(args).items()},
            "device": device_name(device),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "git_commit": git_commit(),
            "model": asdict(cfg),
            "params": params,
            "tokens_per_step": tokens_per_step,
            "train_tokens_per_run": tokens_per_step * args.steps,
            "epochs_per_run": round(tokens_per_step * args.steps / train_ids.numel(), 3),
            "val_tokens": sum(y.numel() for _, y in val),
            "flops_per_step": 6 * params["total"] * tokens_per_step,
            "corpus": {k: v for k, v in corpus.items() if k != "sha256"},
            "calibration": calibration,
            "schedule": "linear warmup, constant, linear cooldown over the last "
            f"{args.cooldown_frac:.0%} to x{args.final_lr_frac:g}",
        },
        "runs": {},
    }
    print(
        f"{device_name(device)}: {params['total'] / 1e6:.1f}M params ({params['matrix'] / 1e6:.1f}M matrix), "
        f"{args.steps} steps x {tokens_per_step} tokens, {len(runs)} runs; calibration {calibration}",
        flush=True,
    )
    longest = 0.0
    for spec in runs:
        elapsed = time.perf_counter() - started
        if unavailable.get(spec.kind):
            report["runs"][spec.name] = {"spec": asdict(spec), "status": f"skipped: {unavailable[spec.kind]}"}
        elif args.deadline_s > 0 and elapsed + longest > args.deadline_s:
            report["runs"][spec.name] = {"spec": asdict(spec), "status": f"skipped: deadline ({elapsed:.0f} s)"}
        else:
            try:
                result = train_one(spec, model, init_state, data, val, args, device)
            except Exception as e:  # one broken optimizer must not lose the other runs
                trace = traceback.format_exc()
                print(trace, file=sys.stderr, flush=True)
                result = {"spec": asdict(spec), "status": f"error: {type(e).__name__}: {e}", "traceback": trace[-4000:]}
            longest = max(longest, result.get("wall_s", 0.0))
            report["runs"][spec.name] = result
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = report["runs"][spec.name]
        print(
            f"{spec.name:20s} {r['status'][:60]:12s} final_val={r.get('final_val')} "
            f"opt_ms={r.get('median_opt_ms')} fwd_bwd_ms={r.get('median_fwd_bwd_ms')} wall_s={r.get('wall_s')}",
            flush=True,
        )
        report["meta"]["total_wall_s"] = round(time.perf_counter() - started, 2)
        write_json(out_path, report, indent=None)
    print(f"wrote {out_path} ({report['meta']['total_wall_s']} s)")
    return report


if __name__ == "__main__":
    main()
