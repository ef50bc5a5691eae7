"""Config functions for the 0.3 integration tests: the shipped recipes, built by a Trainer that
records (without changing training) each logged step's exact loss, the optimizers it built and
a digest of the final parameters, to `<dump_folder>/inspect/rank<r>.json`; plus recipes with a
bad optimizer kwarg. Used as `--module tests.titan03.inspect_recipes --config <name>`."""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.trainer import Trainer

from dion3_titan.titan03 import recipes
from tests.titan_helpers import local_hashes, nonfinite_record, param_digest, plan_of, poison_gradient


class InspectingTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._record: dict[str, Any] = {
            "rank": torch.distributed.get_rank(),
            "losses": {},
            "optimizers": self._describe_optimizers(),
        }
        log = self.metrics_processor.log

        def log_and_record(step: int, loss: float, *args: Any, **kwargs: Any) -> None:
            self._record["losses"][str(step)] = float(loss)
            self._write()
            log(step, loss, *args, **kwargs)

        self.metrics_processor.log = log_and_record
        self._write()

    def _describe_optimizers(self) -> dict[str, Any]:
        opts = self.optimizers
        return {
            "container": type(opts).__name__,
            "pre_hooks": len(opts._optimizer_step_pre_hooks),
            "optimizers": [
                {
                    "class": type(o).__name__,
                    "groups": [
                        {
                            "names": list(g.get("param_names", [])),
                            "fraction": g.get("fraction"),
                            "flavor": g.get("flavor"),
                            "lr": g["lr"],
                            # the mesh dims each parameter is sharded over
                            "sharded_over": [
                                sorted(
                                    {
                                        p.device_mesh.mesh_dim_names[i]
                                        for i, pl in enumerate(p.placements)
                                        if pl.is_shard()
                                    }
                                )
                                if hasattr(p, "placements")
                                else []
                                for p in g["params"]
                            ],
                        }
                        for g in o.param_groups
                    ],
                }
                for o in opts.optimizers
            ],
            # each orthogonalized matrix (or piece of a fused weight) and its shape
            "plan": plan_of(opts.optimizers),
        }

    def forward_backward_step(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().forward_backward_step(*args, **kwargs)
        poison_gradient(self.model_parts, self.config.dump_folder, self.step)
        return loss

    def train(self) -> None:
        super().train()
        self._record["param_digest"] = param_digest(self.model_parts)
        self._record["local_hashes"] = local_hashes(self.model_parts)
        self._record["nonfinite"] = nonfinite_record(self.optimizers.optimizers)
        # the step counters of torchtitan's own optimizers (AdamW: each parameter's "step")
        self._record["titan_steps"] = [
            sorted({float(st["step"]) for st in o.state.values() if "step" in st})
            for o in self.optimizers.optimizers
            if not hasattr(o, "nonfinite")
        ]
        self._write()

    def _write(self) -> None:
        folder = Path(self.config.dump_folder) / "inspect"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{self._record['rank']}.json").write_text(json.dumps(self._record))


def _inspecting(config: Trainer.Config) -> InspectingTrainer.Config:
    return InspectingTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})


def llama3_debug_dion3() -> InspectingTrainer.Config:
    return _inspecting(recipes.llama3_debug_dion3())


def llama3_debug_muon() -> InspectingTrainer.Config:
    return _inspecting(recipes.llama3_debug_muon())


def deepseek_v3_debug_dion3() -> InspectingTrainer.Config:
    return _inspecting(recipes.deepseek_v3_debug_dion3())


def _with_dion3_kwargs(config: Trainer.Config, **kwargs: Any) -> InspectingTrainer.Config:
    first = config.optimizer.param_groups[0]
    groups = [
        ParamGroupConfig(
            pattern=first.pattern,
            optimizer_name=first.optimizer_name,
            optimizer_kwargs={**first.optimizer_kwargs, **kwargs},
        ),
        *config.optimizer.param_groups[1:],
    ]
    return _inspecting(
        dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, param_groups=groups))
    )


def llama3_debug_dion3_compressed() -> InspectingTrainer.Config:
    """Compressed sync across HSDP replicas (the replicate degree is set on the command line)."""
    return _with_dion3_kwargs(recipes.llama3_debug_dion3(), replicate_sync="compressed")


def deepseek_v3_debug_dion3_random() -> InspectingTrainer.Config:
    """The MoE debug model with random selection (rows that do not depend on the sync)."""
    return _with_dion3_kwargs(recipes.deepseek_v3_debug_dion3(), selection="random")


def deepseek_v3_debug_dion3_random_compressed() -> InspectingTrainer.Config:
    """The same under compressed sync across HSDP replicas."""
    return _with_dion3_kwargs(recipes.deepseek_v3_debug_dion3(), selection="random", replicate_sync="compressed")


def llama3_debug_dion3_skip() -> InspectingTrainer.Config:
    """nonfinite = "skip" (a test plants an inf gradient)."""
    return _with_dion3_kwargs(recipes.llama3_debug_dion3(), nonfinite="skip")


def bad_fraction() -> InspectingTrainer.Config:
    return _with_dion3_kwargs(recipes.llama3_debug_dion3(), fraction=1.5)


def bad_flavor() -> InspectingTrainer.Config:
    return _with_dion3_kwargs(recipes.llama3_debug_dion3(), flavor="x")


def misspelled_key() -> InspectingTrainer.Config:
    return _with_dion3_kwargs(recipes.llama3_debug_dion3(), fractoin=0.5)
