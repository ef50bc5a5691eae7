"""The [optimizer] TOML keys: generated from Dion3Config, and bad values stop the job before
step 1 with a message naming the key (the launch tests run real torchrun + torchtitan)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.titan_helpers import CONFIGS, ensure_corpus, logged_losses, run_titan

LLAMA = CONFIGS / "llama3_debug_dion3.toml"


def _titan_config(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.custom_config_module", "dion3_titan.job_config", *args])


def test_every_optimizer_config_key_is_an_optimizer_key() -> None:
    from dion3_titan.optim.config import Dion3Config
    from dion3_titan.optim.prmuon import PRMuonConfig

    cfg = _titan_config()
    for f in dataclasses.fields(Dion3Config) + dataclasses.fields(PRMuonConfig):
        assert hasattr(cfg.optimizer, f.name), f.name
        assert getattr(cfg.optimizer, f.name) is None, f.name  # unset: the named optimizer's default
    assert cfg.optimizer.adamw_weight_decay is None


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(16, 8)
        self.w1 = torch.nn.Linear(8, 24, bias=False)
        self.norm = torch.nn.RMSNorm(8)


def _groups(cfg) -> dict[str, tuple[float, float]]:
    """(lr, weight_decay) of each param group the plugin builds for ``cfg`` on a tiny model."""
    from torchtitan.components.optimizer import build_optimizers

    from dion3_titan.plugin import wrap_builder

    container = wrap_builder(build_optimizers)([_Tiny()], cfg.optimizer, parallel_dims=None)
    groups = [g for o in container.optimizers for g in o.param_groups]
    return {g.get("algorithm", "torch"): (g["lr"], g["weight_decay"]) for g in groups}


def test_config_without_lr_gets_the_dion3_defaults(tmp_path: Path) -> None:
    """A shipped Dion3 config with its lr and weight_decay lines removed trains the matrices at
    Dion3's lr 0.02 without weight decay, not at torchtitan's AdamW defaults (8e-4, 0.1); the
    AdamW group (adamw_lr 0.003 in that file) is not decayed either."""
    text = LLAMA.read_text()
    lines = [line for line in text.splitlines() if not line.startswith(("lr =", "weight_decay ="))]
    assert len(lines) == len(text.splitlines()) - 2
    path = tmp_path / "no_lr.toml"
    path.write_text("\n".join(lines))
    cfg = _titan_config("--job.config_file", str(path))
    assert cfg.optimizer.name == "dion3" and cfg.optimizer.lr is None and cfg.optimizer.weight_decay is None
    assert _groups(cfg) == {"dion3": (0.02, 0.0), "adamw": (0.003, 0.0)}


def test_weight_decay_keys_per_group() -> None:
    """weight_decay decays the matrices, adamw_weight_decay the AdamW group (0 when unset)."""
    cfg = _titan_config("--optimizer.name", "dion3", "--optimizer.lr", "0.01", "--optimizer.weight_decay", "0.1")
    assert _groups(cfg) == {"dion3": (0.01, 0.1), "adamw": (0.01, 0.0)}
    cfg = _titan_config("--optimizer.name", "normuon", "--optimizer.adamw_weight_decay", "0.05")
    assert _groups(cfg) == {"dion3": (0.02, 0.0), "adamw": (0.02, 0.05)}


def test_adamw_keeps_torchtitan_defaults() -> None:
    """With our keys loaded, name = "AdamW" still gets torchtitan's own lr and weight decay."""
    assert _groups(_titan_config("--optimizer.implementation", "foreach")) == {"torch": (8e-4, 0.1)}


def test_dion3_without_the_extension_says_which_key_to_set() -> None:
    from torchtitan.config import ConfigManager

    from dion3_titan.plugin import dion3_options

    cfg = ConfigManager().parse_args(["--optimizer.name", "dion3"])
    with pytest.raises(ValueError, match="custom_config_module = 'dion3_titan.job_config'"):
        dion3_options(cfg.optimizer)


def test_cli_overrides_reach_dion3_options() -> None:
    from dion3_titan.plugin import dion3_options

    cfg = _titan_config("--optimizer.name", "dion3", "--optimizer.fraction", "0.5",
                        "--optimizer.ns_restarts", "1", "3", "--optimizer.flavor", "normuon")
    opts = dion3_options(cfg.optimizer)
    assert opts["fraction"] == 0.5 and opts["flavor"] == "normuon"
    assert tuple(opts["ns_restarts"]) == (1, 3)


@pytest.mark.parametrize(
    "args, words",
    [
        (("--optimizer.name", "muon", "--optimizer.fraction", "0.25"), ["fraction=0.25", "'muon'", "name='dion3'"]),
        (("--optimizer.name", "normuon", "--optimizer.flavor", "muon"), ["flavor='muon'", "'normuon'"]),
        (("--optimizer.name", "normuon", "--optimizer.fraction", "1.0"), []),  # agrees with the name
        (("--optimizer.name", "dion3", "--optimizer.refresh_period", "2"), ["refresh_period", "'prmuon'"]),
        (("--optimizer.name", "prmuon", "--optimizer.refresh_period", "0"), ["refresh_period=0", ">= 1"]),
        (("--optimizer.name", "prmuon", "--optimizer.fraction", "0.5"), ["fraction=0.5", "'prmuon'"]),
        (("--optimizer.name", "dion3", "--optimizer.ns_dtype", "int8"), ["ns_dtype='int8'", "float16"]),
        (("--optimizer.name", "dion3", "--optimizer.early_step_in_backward"), ["early_step_in_backward"]),
    ],
)
def test_name_conflicts_and_unsupported_modes(args: tuple[str, ...], words: list[str]) -> None:
    from dion3_titan.plugin import build_dion3_optimizers, dion3_options

    cfg = _titan_config(*args)
    if not words:
        assert dion3_options(cfg.optimizer)["flavor"] == "normuon"
        return
    with pytest.raises((ValueError, NotImplementedError)) as err:
        build_dion3_optimizers([], cfg.optimizer, parallel_dims=None)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_prmuon_refuses_split_keys_and_skips_auto_split() -> None:
    """name='prmuon': split_specs/split_heads stop the build with their names; split_auto
    (on by default) adds nothing, so a fused weight stays one matrix."""
    import torch

    from dion3_titan.optim.split import auto_split_specs
    from dion3_titan.plugin import build_dion3_optimizers

    model, attention = torch.nn.Module(), torch.nn.Module()
    attention.wqkv = torch.nn.Linear(8, 24, bias=False)  # a fused QKV (Q 12 | K 6 | V 6 rows)
    attention.n_heads, attention.n_kv_heads, attention.head_dim = 2, 1, 6
    model.attention = attention
    assert auto_split_specs(model)  # what name='dion3' would split
    for key, value in (("split_heads", "2"), ("split_specs", "pattern=attention.wqkv.weight;chunks=3")):
        cfg = _titan_config("--optimizer.name", "prmuon", f"--optimizer.{key}", value)
        with pytest.raises(ValueError, match=r"split_specs/split_heads are not supported"):
            build_dion3_optimizers([model], cfg.optimizer, parallel_dims=None)
    cfg = _titan_config("--optimizer.name", "prmuon", "--optimizer.split_auto", "True")
    (opt,) = build_dion3_optimizers([model], cfg.optimizer, parallel_dims=None).optimizers
    assert [(m.name, m.piece) for sg in opt._groups for m in sg.members] == [("attention.wqkv.weight", None)]


@pytest.mark.parametrize("warmup", ["0", "-2"])
@pytest.mark.parametrize("graph", [True, False], ids=["cuda_graph", "no_graph"])
def test_cuda_graph_warmup_below_one_is_refused(warmup: str, graph: bool) -> None:
    """A warm-up of 0 is refused with the key and what it allows (it once became 3 silently),
    before the container needs a GPU, and even when cuda_graph is off."""
    import torch

    from dion3_titan.plugin import build_dion3_optimizers

    cfg = _titan_config("--optimizer.name", "dion3", "--optimizer.cuda_graph_warmup", warmup,
                        *(["--optimizer.cuda_graph", "True"] if graph else []))
    with pytest.raises(ValueError) as err:
        build_dion3_optimizers([torch.nn.Linear(8, 8)], cfg.optimizer, parallel_dims=None)
    assert f"[optimizer] cuda_graph_warmup={warmup}: must be an integer >= 1" in str(err.value), str(err.value)


def test_cuda_graph_warmup_one_is_accepted() -> None:
    import torch

    from dion3_titan.optim.cuda_graph import GraphedOptimizer
    from dion3_titan.optim.dion3 import Dion3
    from dion3_titan.plugin import build_dion3_optimizers

    cfg = _titan_config("--optimizer.name", "dion3", "--optimizer.cuda_graph_warmup", "1")
    build_dion3_optimizers([torch.nn.Linear(8, 8)], cfg.optimizer, parallel_dims=None)  # graph off: eager
    opt = Dion3([torch.nn.Parameter(torch.randn(8, 8))])
    assert GraphedOptimizer(opt, warmup_steps=1).warmup_steps == 1
    with pytest.raises(ValueError, match=r"cuda_graph_warmup=0: must be an integer >= 1"):
        GraphedOptimizer(opt, warmup_steps=0)


# ------------------------------------------------------------------ real launches
def _with_optimizer_line(tmp_path: Path, old: str, new: str) -> Path:
    text = LLAMA.read_text()
    assert old in text
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "old, new, words",
    [
        ("fraction = 0.25", "fraction = 1.5", ["fraction=1.5", "(0, 1]"]),
        ('flavor = "normuon"', 'flavor = "x"', ["flavor='x'", "'muon', 'normuon'"]),
        ("fraction = 0.25", "fraction = 0.25\nfractoin = 0.5", ["fractoin", "Invalid field names"]),
    ],
    ids=["fraction", "flavor", "unknown-key"],
)
def test_bad_toml_fails_before_step_1(tmp_path: Path, old: str, new: str, words: list[str]) -> None:
    ensure_corpus()
    # one rank: the job must stop while parsing/validating, before any process group exists
    run = run_titan(_with_optimizer_line(tmp_path, old, new), tmp_path / "out", nproc=1)
    assert run.returncode != 0
    assert not logged_losses(run.output), "training started"
    assert all(w in run.output for w in words), run.output[-4000:]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse_and_validate(path: Path) -> None:
    from torchtitan.protocols.train_spec import get_train_spec

    from dion3_titan.plugin import NAMES, dion3_options

    cfg = _titan_config("--job.config_file", str(path))
    spec = get_train_spec(cfg.model.name)
    assert cfg.model.flavor in spec.model_args, f"{path.name}: no flavor {cfg.model.flavor!r}"
    if cfg.optimizer.name in NAMES:
        dion3_options(cfg.optimizer)
    else:
        assert cfg.optimizer.name in ("AdamW", "Adam")
