"""The [optimizer] TOML keys: generated from Dion3Config. A bad config (value, unknown key,
wrong type, in the TOML or an override) is reported as one line before torchtitan starts (the
launch tests run the real scripts/train_debug.sh and torchrun)."""

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch

from tests.spawn import repo_env, torchrun
from tests.titan_helpers import CONFIGS, REPO, ensure_corpus, logged_losses

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

    from dion3_titan.titan02.plugin import wrap_builder

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

    from dion3_titan.titan02.optimizers import dion3_options

    cfg = ConfigManager().parse_args(["--optimizer.name", "dion3"])
    with pytest.raises(ValueError, match="custom_config_module = 'dion3_titan.job_config'"):
        dion3_options(cfg.optimizer)


def test_cli_overrides_reach_dion3_options() -> None:
    from dion3_titan.titan02.optimizers import dion3_options

    cfg = _titan_config(
        "--optimizer.name",
        "dion3",
        "--optimizer.fraction",
        "0.5",
        "--optimizer.ns_restarts",
        "1",
        "3",
        "--optimizer.flavor",
        "normuon",
    )
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
    from dion3_titan.titan02.optimizers import build_dion3_optimizers, dion3_options

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
    from dion3_titan.titan02.optimizers import build_dion3_optimizers

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

    from dion3_titan.titan02.optimizers import build_dion3_optimizers

    cfg = _titan_config(
        "--optimizer.name",
        "dion3",
        "--optimizer.cuda_graph_warmup",
        warmup,
        *(["--optimizer.cuda_graph", "True"] if graph else []),
    )
    with pytest.raises(ValueError) as err:
        build_dion3_optimizers([torch.nn.Linear(8, 8)], cfg.optimizer, parallel_dims=None)
    assert f"[optimizer] cuda_graph_warmup={warmup}: must be an integer >= 1" in str(err.value), str(err.value)
    # and by the check before any rank starts (check_config), in one line
    from dion3_titan.titan02.check_config import ConfigError, parse_job_config

    args = ["--optimizer.cuda_graph_warmup", warmup, *(["--optimizer.cuda_graph", "True"] if graph else [])]
    with pytest.raises(ConfigError) as err:
        parse_job_config(["--job.config_file", str(LLAMA), *args])
    assert str(err.value).startswith(f"[optimizer] cuda_graph_warmup={warmup}: must be an integer >= 1")
    assert "\n" not in str(err.value)


def test_cuda_graph_warmup_one_is_accepted() -> None:
    import torch

    from dion3_titan.optim.cuda_graph import GraphedOptimizer
    from dion3_titan.optim.dion3 import Dion3
    from dion3_titan.titan02.optimizers import build_dion3_optimizers

    cfg = _titan_config("--optimizer.name", "dion3", "--optimizer.cuda_graph_warmup", "1")
    build_dion3_optimizers([torch.nn.Linear(8, 8)], cfg.optimizer, parallel_dims=None)  # graph off: eager
    opt = Dion3([torch.nn.Parameter(torch.randn(8, 8))])
    assert GraphedOptimizer(opt, warmup_steps=1).warmup_steps == 1
    with pytest.raises(ValueError, match=r"cuda_graph_warmup=0: must be an integer >= 1"):
        GraphedOptimizer(opt, warmup_steps=0)


# ------------------------------------------------------------------ one-line config errors
def _edited(tmp_path: Path, old: str, new: str) -> Path:
    text = LLAMA.read_text()
    assert old in text
    path = tmp_path / "edited.toml"
    path.write_text(text.replace(old, new, 1))
    return path


# (edit of the debug config's lines, command-line overrides, the one line that reports it)
CHECKS = {
    "bad-value": ((), ("--optimizer.fraction", "0"), "[optimizer] fraction=0.0: must be a number in (0, 1]"),
    "bad-choice": (
        ('flavor = "normuon"', 'flavor = "x"'),
        (),
        "[optimizer] flavor='x': allowed values are ('muon', 'normuon')",
    ),
    "unknown-key": (
        ("fraction = 0.25", "fractoin = 0.25"),
        (),
        "[optimizer] fractoin: unknown key (did you mean 'fraction'?)",
    ),
    "unknown-section": (("[optimizer]", "[optimiser]"), (), "[optimiser]: unknown section (did you mean 'optimizer'?)"),
    "wrong-type": (("momentum = 0.95", 'momentum = "high"'), (), "[optimizer] momentum='high': must be a number"),
    "wrong-type-bool": (
        ("fraction_lr_transfer = true", 'fraction_lr_transfer = "yes"'),
        (),
        "[optimizer] fraction_lr_transfer='yes': must be true or false",
    ),
    "wrong-item-type": (
        ("ns_restarts = [2]", "ns_restarts = [2.5]"),
        (),
        "[optimizer] ns_restarts=[2.5]: must be a list of integers",
    ),
    "wrong-type-titan-key": (("steps = 20", "steps = 2.5"), (), "[training] steps=2.5: must be an integer"),
    "titan-literal": (
        ('mode = "none"', 'mode = "some"'),
        (),
        "[activation_checkpoint] mode='some': must be one of ('selective', 'full', 'memory_budget', 'none')",
    ),
    "no-custom-module": (
        ('custom_config_module = "dion3_titan.job_config"', ""),
        (),
        '[optimizer] adamw_lr: unknown key (a dion3_titan key: set [job] custom_config_module = "dion3_titan.job_config")',
    ),
    "cli-wrong-type": (
        (),
        ("--optimizer.fraction", "abc"),
        "Error parsing --optimizer.fraction: no type matching {None}|FLOAT could be instantiated from ['abc'].",
    ),
    "cli-unknown-key": (
        (),
        ("--optimizer.fractoin", "0.5"),
        "Unrecognized options: --optimizer.fractoin, 0.5 (did you mean --optimizer.fraction?)",
    ),
    "pp-validation-batch": (
        (),
        ("--parallelism.pipeline_parallel_degree", "2"),
        "[validation] local_batch_size=2: with pipeline_parallel_degree=2 it must be a multiple "
        "of the 4 pipeline microbatches (training.local_batch_size / pipeline_parallel_microbatch_size); "
        "set it to 4, or set [validation] enable = false",
    ),
    "adamw-lr": ((), ("--optimizer.adamw_lr", "-1"), "[optimizer] adamw_lr=-1.0: must be a number >= 0"),
    "adamw-beta1": ((), ("--optimizer.beta1", "1.5"), "[optimizer] beta1=1.5: must be a number in [0, 1)"),
    "adamw-weight-decay": (
        (),
        ("--optimizer.adamw_weight_decay", "-0.1"),
        "[optimizer] adamw_weight_decay=-0.1: must be a number >= 0",
    ),
    "graph-warmup": (
        (),
        ("--optimizer.cuda_graph_warmup", "0"),
        "[optimizer] cuda_graph_warmup=0: must be an integer >= 1 (eager steps before capture: kernels "
        "compile and buffers are allocated there, which capture cannot do)",
    ),
    "not-toml": (("[job]", "[job"), (), None),  # message from tomllib, checked by prefix below
}


def _check_case(tmp_path: Path, case: str) -> tuple[list[str], str | None]:
    edit, overrides, line = CHECKS[case]
    config = _edited(tmp_path, *edit) if edit else LLAMA
    return ["--job.config_file", str(config), *overrides], line


@pytest.mark.parametrize("case", list(CHECKS))
def test_bad_config_is_one_line(tmp_path: Path, case: str) -> None:
    from dion3_titan.titan02.check_config import ConfigError, parse_job_config

    args, line = _check_case(tmp_path, case)
    with pytest.raises(ConfigError) as err:
        parse_job_config(args)
    message = str(err.value)
    assert "\n" not in message
    if line is None:
        assert message.startswith("--job.config_file: not valid TOML: "), message
    else:
        assert message == line


def test_missing_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dion3_titan.titan02.check_config import main

    with pytest.raises(SystemExit) as exit_:
        main(["--job.config_file", str(tmp_path / "none.toml")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err  # torchtitan's own traceback of the missing file is silenced
    assert err == f"--job.config_file: no such file: {tmp_path / 'none.toml'}\n"


# ------------------------------------------------------------------ real launches
# One launch per kind of failure path is enough here: every message itself is checked
# in-process above (test_bad_config_is_one_line); these check what reaches the console.
LAUNCH_CASES = ["wrong-type"]


def _console(proc: subprocess.CompletedProcess) -> list[str]:
    return [l.rstrip() for l in (proc.stdout + proc.stderr).splitlines() if l.strip()]


def _env() -> dict[str, str]:
    return repo_env(OMP_NUM_THREADS="1")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["bad-value"])  # an override (every message: test_bad_config_is_one_line)
def test_train_debug_sh_ends_with_the_one_line(tmp_path: Path, case: str) -> None:
    """scripts/train_debug.sh checks the config before torchrun: the reason is the last line."""
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("scripts/train_debug.sh runs ./.venv (scripts/setup_env.sh creates it)")
    ensure_corpus()
    args, line = _check_case(tmp_path, case)
    proc = subprocess.run(
        ["bash", "scripts/train_debug.sh", *args[2:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**_env(), "CONFIG": args[1]},
        timeout=300,
    )
    console = _console(proc)
    assert proc.returncode == 2, console[-20:]
    assert console[-1] == line, console[-20:]
    assert not logged_losses(proc.stdout + proc.stderr)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", LAUNCH_CASES)
def test_torchrun_reports_the_one_line(tmp_path: Path, case: str) -> None:
    """`torchrun -m dion3_titan.train` on 2 gloo ranks: every rank stops before torchtitan
    starts; rank 0 prints the reason as one line and no traceback, and torchrun's failure
    report (printed after it; see docs/training.md) gives the same line as the root cause."""
    ensure_corpus()
    args, line = _check_case(tmp_path, case)
    cmd = torchrun(2, "-m", "dion3_titan.train", *args, "--job.dump_folder", str(tmp_path / "out"))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=300)
    console = _console(proc)
    assert proc.returncode != 0
    assert console[0] == line, console[:5]  # the first thing on the console
    assert console.count(line) == 1, console  # rank 0 only
    assert f"traceback : {line}" in [l.strip() for l in console], console[-12:]  # torchrun's root cause
    # the only traceback is torchrun's own (ChildFailedError); none from a worker
    assert sum("Traceback (most recent call last)" in l for l in console) == 1, console
    assert not logged_losses(proc.stdout + proc.stderr)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse_and_validate(path: Path) -> None:
    from torchtitan.protocols.train_spec import get_train_spec

    from dion3_titan.names import NAMES
    from dion3_titan.titan02.check_config import parse_job_config
    from dion3_titan.titan02.optimizers import dion3_options

    cfg = parse_job_config(["--job.config_file", str(path)])  # ConfigError (one line) if not
    spec = get_train_spec(cfg.model.name)
    assert cfg.model.flavor in spec.model_args, f"{path.name}: no flavor {cfg.model.flavor!r}"
    if cfg.optimizer.name in NAMES:
        dion3_options(cfg.optimizer)
    else:
        assert cfg.optimizer.name in ("AdamW", "Adam")


def test_cuda_graph_default_names_why_it_stays_off_here() -> None:
    """cuda_graph unset: captured where it works; on this CPU machine the reason it is not."""
    from types import SimpleNamespace

    import torch

    from dion3_titan import Dion3
    from dion3_titan.titan02.optimizers import Dion3OptimizersContainer

    p = torch.nn.Parameter(torch.randn(8, 16))
    for name, selection, words in [("dion3", "l1", "CUDA"), ("prmuon", "l1", "two graphs"), ("dion3", "random", "")]:
        holder = SimpleNamespace(optimizers=[Dion3([p], lr=0.02, selection=selection)])
        why = Dion3OptimizersContainer._graph_blocker(holder, SimpleNamespace(name=name))
        assert why and words in why, (name, selection, why)


def test_titan03_start_names_the_torch_it_needs(monkeypatch) -> None:
    """torchtitan 0.3 on a torch without DataParallelMeshDims stops with one line, not an
    ImportError from inside torchtitan."""
    import torch.distributed.fsdp as fsdp

    from dion3_titan.titan03.train import _require_torch_for_titan03

    _require_torch_for_titan03()  # this torch has it: nothing happens
    monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    with pytest.raises(SystemExit, match=r"torchtitan 0.3 needs a torch with .*DataParallelMeshDims.*torchtitan 0.2.2"):
        _require_torch_for_titan03()


def test_an_optimizer_name_nobody_builds_is_refused_before_ranks_start() -> None:
    """torchtitan itself would fail on it only after every rank built its model, without the
    allowed names; check_config names them."""
    from dion3_titan.titan02.check_config import ConfigError, parse_job_config

    with pytest.raises(ConfigError) as err:
        parse_job_config(["--job.config_file", str(LLAMA), "--optimizer.name", "dion4"])
    assert str(err.value) == (
        "[optimizer] name='dion4': allowed values are ('dion3', 'muon', 'normuon', 'prmuon') (this plugin) "
        "or ('Adam', 'AdamW') (torchtitan's)"
    )
    parse_job_config(["--job.config_file", str(LLAMA), "--optimizer.name", "AdamW"])
