"""Launch real torchtitan training (torchrun, gloo on CPU, FSDP2) for the integration tests.

Run as a script under torchrun, this file is `dion3_titan.train` with a Trainer subclass that
records, without changing training, what the tests assert on: each logged step's exact loss,
the built optimizers' param groups and hooks, and a digest of the final parameters. Records go
to `<dump_folder>/inspect/rank<r>.json`.
"""

import json
import re
import subprocess
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


@dataclass
class TitanRun:
    returncode: int
    output: str  # stdout + stderr of torchrun
    records: list[dict[str, Any]]  # one inspect record per rank (rank order)

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
    env = repo_env()
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks on a 2-core CI machine
    proc = subprocess.run(
        torchrun(nproc, *target, rank0_logs=True), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    records = []
    for r in range(nproc):
        path = dump_folder / "inspect" / f"rank{r}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
    return TitanRun(proc.returncode, proc.stdout + proc.stderr, records)


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

    out = {}
    for model in model_parts:
        for name, p in model.named_parameters():
            local = (p.to_local() if hasattr(p, "to_local") else p).detach().float().contiguous()
            out[name] = hashlib.sha256(local.numpy().tobytes()).hexdigest()
    return out


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

        def train(self) -> None:
            super().train()
            self._record["param_digest"] = param_digest(self.model_parts)
            self._record["local_hashes"] = local_hashes(self.model_parts)
            self._write()

        def _write(self) -> None:
            folder = Path(self.job_config.job.dump_folder) / "inspect"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank{self._record['rank']}.json"
            path.write_text(json.dumps(self._record))

    return InspectingTrainer


if __name__ == "__main__":
    from dion3_titan.train import main

    main(_inspecting_trainer())
