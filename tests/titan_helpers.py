"""Launch real torchtitan training (torchrun, gloo on CPU, FSDP2) for the integration tests.

Run as a script under torchrun, this file is `dion3_titan.train` with a Trainer subclass that
records, without changing training, what the tests assert on: each logged step's exact loss,
the built optimizers' param groups and hooks, a digest of the final parameters and where each
step's non-finite flag came from. Records go to `<dump_folder>/inspect/rank<r>.json`. A
`<dump_folder>/poison.json` written before the run (`write_poison`) plants an inf in one
gradient of one step, after backward and before clipping. With `--runs <file>` it trains several jobs in turn in
one launch (`run_titans`): starting torchrun and its ranks costs more than a short run itself.
"""

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.spawn import REPO, repo_env, torchrun


def plan_of(optimizers) -> list[dict]:
    """Each orthogonalized matrix (or piece of a fused weight) of the optimizers' megabatch
    plans, with its full shape (both torchtitan generations' inspected runs report it)."""
    return [
        {
            "name": m.name,
            "piece": None
            if m.layout.piece is None
            else [m.layout.piece.start, m.layout.piece.stop, m.layout.piece.step],
            "shape": list(m.layout.global_shape),
        }
        for o in optimizers
        for sg in getattr(o, "shape_groups", [])
        for m in sg.members
    ]


CONFIGS = REPO / "configs"
_CAUSE = re.compile(r"Error|Exception|terminate called|Abort|abort\(|Signal \d+|Traceback|FATAL", re.I)


@dataclass
class TitanRun:
    returncode: int
    output: str  # stdout + stderr of torchrun
    records: list[dict[str, Any]]  # one inspect record per rank (rank order)

    def report(self, tail: int = 4000) -> str:
        """What a failed launch's assertion shows: the lines that name an error or an abort
        anywhere in the output (a rank's cause often comes long before torchrun's closing
        report), then the output's last ``tail`` characters."""
        causes = [line for line in self.output.splitlines() if _CAUSE.search(line)][:40]
        return "\n".join(["lines naming a cause:", *causes, "", "the output's end:", self.output[-tail:]])

    def losses(self) -> dict[int, float]:
        """Exact per-step losses as logged by the metrics processor of the first rank that
        computes the loss (rank 0; with pipeline parallelism, the first last-stage rank: the
        other stages log -1 summed over their data-parallel ranks)."""
        return {int(k): v for k, v in self._loss_record()["losses"].items()}

    def grad_norms(self) -> dict[int, float]:
        """Exact per-step gradient norms (before clipping), as logged with the losses."""
        return {int(k): v for k, v in self._loss_record()["grad_norms"].items()}

    def _loss_record(self) -> dict[str, Any]:
        for record in self.records:
            if record["losses"] and min(record["losses"].values()) >= 0:
                return record
        raise AssertionError("no rank logged a loss")


def run_titan(
    config: str | Path,
    dump_folder: Path,
    *overrides: str,
    nproc: int = 2,
    timeout: float = 300,
) -> TitanRun:
    """torchrun `nproc` ranks of this file with `--job.config_file config` and `overrides`."""
    target = [str(Path(__file__).resolve()), "--job.config_file", str(config), "--job.dump_folder", str(dump_folder)]
    return torchrun_inspected([*target, *overrides], dump_folder, nproc, timeout)


def torchrun_inspected(target: list[str], dump_folder: Path, nproc: int, timeout: float) -> TitanRun:
    """torchrun `nproc` ranks of `target` (a script, or `-m module`, with its arguments) on gloo;
    the ranks' records are read back from `dump_folder`/inspect."""
    proc = _torchrun(target, nproc, timeout)
    return TitanRun(proc.returncode, proc.stdout + proc.stderr, _records(dump_folder, nproc))


def run_titans(
    runs: dict[str, tuple[str | Path, Path, tuple[str, ...]]], nproc: int = 2, timeout: float = 900
) -> dict[str, TitanRun]:
    """Independent trainings in turn in one torchrun launch of `nproc` ranks: name -> (config,
    dump_folder, overrides), as `run_titan` takes them. Each run gets its own console output and
    records. A failing run ends the launch; the runs after it report that they did not run.
    (Not for a run that resumes another's checkpoint: that must be a fresh process.)"""
    spec = [
        {"name": name, "args": ["--job.config_file", str(config), "--job.dump_folder", str(folder), *overrides]}
        for name, (config, folder, overrides) in runs.items()
    ]
    spec_file = next(iter(runs.values()))[1].parent / f"runs-{'-'.join(runs)}.json"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(spec))
    proc = _torchrun([str(Path(__file__).resolve()), "--runs", str(spec_file)], nproc, timeout)
    out, err = _by_run(proc.stdout), _by_run(proc.stderr)
    results, stopped = {}, None
    for name, (_, folder, _) in runs.items():
        output = out.get(name, "") + err.get(name, "")
        if f"{RUN_MARK} done {name}\n" in proc.stdout:
            results[name] = TitanRun(0, output, _records(folder, nproc))
        elif stopped is None and name in out:
            stopped = name  # the run that failed: its output ends with torchrun's report
            results[name] = TitanRun(proc.returncode or 1, output, _records(folder, nproc))
        else:
            why = f"run {name!r} did not run: the launch stopped in run {stopped!r}:\n"
            results[name] = TitanRun(1, why + (results[stopped].output if stopped else proc.stdout + proc.stderr), [])
    return results


RUN_MARK = "@@ titan run"  # rank 0's console line at each run's start and end (run_titans)


def _by_run(text: str) -> dict[str, str]:
    """A launch's console text cut at each run's start line: name -> that run's part."""
    parts = re.split(rf"^{RUN_MARK} start (\S+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _torchrun(target: list[str], nproc: int, timeout: float) -> subprocess.CompletedProcess:
    env = repo_env()
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks on a 2-core CI machine
    return subprocess.run(
        torchrun(nproc, *target, rank0_logs=True), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def _records(dump_folder: Path, nproc: int) -> list[dict[str, Any]]:
    records = []
    for r in range(nproc):
        path = dump_folder / "inspect" / f"rank{r}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
    return records


def write_poison(dump_folder: Path, step: int, param: str, rank: int = 0) -> None:
    """Make the inspected run at ``dump_folder`` plant an inf in the first local entry of
    ``param``'s gradient on ``rank`` at ``step`` (after backward, before clipping)."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    (dump_folder / "poison.json").write_text(json.dumps({"step": step, "param": param, "rank": rank}))


def poison_gradient(model_parts, dump_folder: str, step: int) -> None:
    """What ``write_poison`` asked for, if it asked for this step on this rank."""
    path = Path(dump_folder) / "poison.json"
    if not path.exists():
        return
    import torch

    from dion3_titan.dist.layout import to_local

    spec = json.loads(path.read_text())
    if spec["step"] != step or spec["rank"] != torch.distributed.get_rank():
        return
    for model in model_parts:
        for name, p in model.named_parameters():
            if name == spec["param"] and p.grad is not None:
                with torch.no_grad():
                    to_local(p.grad).view(-1)[0] = float("inf")
                return
    raise AssertionError(f"poison: no gradient of {spec['param']!r} on this rank")


def nonfinite_record(optimizers) -> dict[str, Any]:
    """Per optimizer of ours: where its steps' non-finite flags came from, and the steps it skipped."""
    ours = [o for o in optimizers if hasattr(o, "nonfinite")]
    return {
        "flag_sources": [o.nonfinite.flag_sources for o in ours],
        "skipped_steps": [o.skipped_steps for o in ours],
    }


def param_digest(model_parts) -> dict[str, float]:
    """Sum of |p| of every parameter, as a full tensor (a collective on every rank)."""
    digest = {}
    for model in model_parts:
        for name, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            digest[name] = float(full.detach().double().abs().sum())
    return digest


def local_hashes(model_parts) -> dict[str, str]:
    """A hash of the bytes of each parameter's local shard on this rank (equal on two ranks
    exactly when their shards are bit-identical: HSDP replicas of the same shard)."""
    import hashlib

    from dion3_titan.dist.layout import to_local

    out = {}
    for model in model_parts:
        for name, p in model.named_parameters():
            # the plain tensor behind a DTensor shard or a wrapper (float8 training weights)
            local = to_local(p.detach()).float().cpu().contiguous()
            out[name] = hashlib.sha256(local.numpy().tobytes()).hexdigest()
    return out


def hsdp_replicas_identical(run: TitanRun) -> bool:
    """On 4 ranks of HSDP 2 x 2, ranks r and r + 2 hold the same shard in the two replicas
    (torchtitan's mesh puts the replicate dim outside the shard dim): bit-identical there,
    different between the shards."""
    hashes = [record["local_hashes"] for record in run.records]
    return len(hashes) == 4 and hashes[0] == hashes[2] and hashes[1] == hashes[3] and hashes[0] != hashes[1]


def checkpoint_from(run_dir: Path, step: int, dump_folder: Path) -> Path:
    """``dump_folder`` holding only ``run_dir``'s checkpoint of ``step`` (a run there resumes
    from it)."""
    import shutil

    (dump_folder / "checkpoint").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoint" / f"step-{step}", dump_folder / "checkpoint" / f"step-{step}")
    return dump_folder


def ensure_corpus() -> Path:
    """The small offline corpus + tokenizer at its default place (built once, ~6 s)."""
    from dion3_titan.data.build import DEFAULTS, build, default_out, is_built

    out = REPO / default_out("small")
    if not is_built(str(out)):
        build("small", str(out), val_percent=2.0, **DEFAULTS["small"])
    return out


def logged_losses(output: str) -> dict[int, float]:
    """Losses from torchtitan's console lines ("step: 3  loss:  7.12345 ...")."""
    clean = re.sub(r"\x1b\[[0-9;]*m", "", output)
    return {int(s): float(l) for s, l in re.findall(r"step:\s*(\d+)\s+loss:\s*([-\d.naif]+)", clean)}


# --------------------------------------------------------------------- inside torchrun
def _inspecting_trainer() -> type:
    import torch
    from torchtitan.train import Trainer

    class InspectingTrainer(Trainer):
        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            self._record: dict[str, Any] = {
                "rank": torch.distributed.get_rank(),
                "optimizers": self._describe_optimizers(),
                "losses": {},
                "grad_norms": {},
            }
            log = self.metrics_processor.log

            def log_and_record(
                step: int, loss: float, max_loss: float, grad_norm: float, *args: Any, **kwargs: Any
            ) -> None:
                self._record["losses"][str(step)] = float(loss)
                self._record["grad_norms"][str(step)] = float(grad_norm)
                self._write()
                log(step, loss, max_loss, grad_norm, *args, **kwargs)

            self.metrics_processor.log = log_and_record
            self._write()

        def _describe_optimizers(self) -> dict[str, Any]:
            opts = self.optimizers
            return {
                "container": type(opts).__name__,
                "pre_hooks": len(opts._optimizer_step_pre_hooks),
                "post_hooks": len(opts._optimizer_step_post_hooks),
                "parts": [
                    {
                        "class": type(o).__name__,
                        "groups": [
                            {
                                "algorithm": g.get("algorithm", type(o).__name__),
                                "names": list(g.get("names", [])),
                                "shapes": [list(p.shape) for p in g["params"]],
                                # class of each parameter's local tensor (float8 weights wrap theirs)
                                "local_classes": sorted(
                                    {type(p.to_local() if hasattr(p, "to_local") else p).__name__ for p in g["params"]}
                                ),
                                "lr": g["lr"],
                                "fraction": g.get("fraction"),
                                "flavor": g.get("flavor"),
                            }
                            for g in o.param_groups
                        ],
                    }
                    for o in opts.optimizers
                ],
                # the megabatch plan: each orthogonalized matrix (or piece) and its shape
                "plan": plan_of(opts.optimizers),
            }

        def forward_backward_step(self, *args: Any, **kwargs: Any) -> Any:
            loss = super().forward_backward_step(*args, **kwargs)
            poison_gradient(self.model_parts, self.job_config.job.dump_folder, self.step)
            return loss

        def train(self) -> None:
            super().train()
            # before main's teardown, which frees captured optimizer steps
            self._record["cuda_graph_captured"] = bool(getattr(self.optimizers, "captured", False))
            self._record["param_digest"] = param_digest(self.model_parts)
            self._record["local_hashes"] = local_hashes(self.model_parts)
            self._record["nonfinite"] = nonfinite_record(self.optimizers.optimizers)
            self._write()

        def _write(self) -> None:
            folder = Path(self.job_config.job.dump_folder) / "inspect"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank{self._record['rank']}.json"
            path.write_text(json.dumps(self._record))

    return InspectingTrainer


def _run_each(spec_file: str) -> None:
    """Every run of `spec_file` in turn (`run_titans`), each through `dion3_titan.train.main` as
    a launch of its own would run it, on one process group: torchtitan builds its trainer on
    the group it finds; its teardown of the group is held back until the last run is done."""
    import gc
    import os

    import torch.distributed as dist

    from dion3_titan.train import main

    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    trainer = _inspecting_trainer()
    rank0 = os.environ.get("RANK", "0") == "0"

    def mark(line: str) -> None:
        if rank0:
            for stream in (sys.stdout, sys.stderr):
                print(f"{RUN_MARK} {line}", file=stream, flush=True)

    from torchtitan.config import ConfigManager

    for run in json.loads(Path(spec_file).read_text()):
        mark(f"start {run['name']}")
        sys.argv[1:] = run["args"]
        # torchtitan's main parses parse_args's default: sys.argv[1:] as it was at import
        ConfigManager.parse_args.__defaults__ = (run["args"],)
        main(trainer)
        gc.collect()  # the finished run's model and optimizer, before the next run builds its own
        mark(f"done {run['name']}")
    dist.destroy_process_group = destroy
    if dist.is_initialized():
        destroy()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--runs"]:
        _run_each(sys.argv[2])
    else:
        from dion3_titan.train import main

        main(_inspecting_trainer())
