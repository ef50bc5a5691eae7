"""Check a torchtitan job config (TOML + command-line overrides) before any worker builds anything.

`python -m dion3_titan.titan02.check_config --job.config_file X.toml [overrides]` parses the arguments
the way torchtitan's trainer will and reports the first problem as one line, exit code 2:

- the config file is missing or is not TOML,
- a section or key that the job config does not have (`[optimizer] fractoin`),
- an optimizer name neither this plugin nor torchtitan builds (`[optimizer] name = "dion4"`),
- a TOML value of the wrong type (`momentum = "high"`; torchtitan passes these through unchecked),
- an override the command-line parser rejects (`--optimizer.fraction abc`),
- a bad Dion3 / Periodic Row-wise Muon value (the optimizers' own validation, `dion3_options`),
  a bad value for their AdamW group (`adamw_lr`, `beta1`, `beta2`, `eps`, `adamw_weight_decay`)
  or for `cuda_graph_warmup`,
- a validation batch that pipeline parallelism cannot cut into its microbatches.

`dion3_titan.train` runs the same check on every rank before torchtitan starts (titan02/train.py),
so a direct `torchrun -m dion3_titan.train` stops with the same line; `scripts/train_debug.sh` runs this
module before torchrun, so there the line is the last one on the console.
"""

import contextlib
import dataclasses
import difflib
import io
import sys
import types
import typing
import warnings
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad job config; the message is one line naming the key."""


def parse_job_config(args: list[str]) -> Any:
    """torchtitan's JobConfig for `args` (as `torchtitan.train.main` parses them), with every
    `[optimizer]` value of our optimizers validated. Raises ConfigError (one line)."""
    from torchtitan.config import ConfigManager

    from dion3_titan.names import NAMES
    from dion3_titan.titan02.optimizers import adamw_options, dion3_options, graph_warmup

    manager = ConfigManager()
    toml = _load_toml(manager, args)
    try:
        config_cls = manager._maybe_add_custom_config(args, toml)
    except ImportError as e:
        raise ConfigError(f"[job] custom_config_module: {e}") from None
    if toml:
        check_toml(config_cls, toml)
    config = _parse_with_overrides(manager, args)
    check_pipeline_validation(config)
    check_optimizer_name(config.optimizer.name, config.model.name)
    if config.optimizer.name in NAMES:
        try:
            options = dion3_options(config.optimizer)
            adamw_options(config.optimizer)
            graph_warmup(config.optimizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if options.get("replicate_sync") == "compressed":
            check_compressed(config.parallelism)
    return config


# The names torchtitan 0.2's own build_optimizers takes (tests/test_upstream_symbols.py reads
# them from its source): every other name fails there, after every rank has built its model.
TITAN_OPTIMIZERS = ("Adam", "AdamW")


def check_optimizer_name(name: str, model: str) -> None:
    """``[optimizer] name`` is one of this plugin's or one torchtitan builds, for torchtitan's
    own models (whose optimizers torchtitan's builder makes; a model registered elsewhere may
    bring a builder that takes other names)."""
    from torchtitan.models import _supported_models

    from dion3_titan.names import NAMES

    if model in _supported_models and name not in NAMES and name not in TITAN_OPTIMIZERS:
        raise ConfigError(
            f"[optimizer] name={name!r}: allowed values are {tuple(NAMES)} (this plugin) or "
            f"{TITAN_OPTIMIZERS} (torchtitan's)"
        )


def check_compressed(parallelism: Any) -> None:
    """Compressed sync needs HSDP: replicas, each sharded by FSDP2 (whose reduction within a
    replica it keeps). Expert parallelism composes with it: the experts' FSDP2 mesh has the same
    replicate dim."""
    p = parallelism
    if p.data_parallel_replicate_degree <= 1 or p.data_parallel_shard_degree == 1:
        raise ConfigError(
            "[optimizer] replicate_sync='compressed' needs HSDP: [parallelism] data_parallel_replicate_degree > 1 "
            f"and data_parallel_shard_degree > 1 or -1 (got {p.data_parallel_replicate_degree} and "
            f"{p.data_parallel_shard_degree}); use replicate_sync='gradients'"
        )


def _load_toml(manager: Any, args: list[str]) -> dict[str, Any] | None:
    from torchtitan.tools.logging import logger as titan_logger  # logs a traceback, then re-raises

    disabled, titan_logger.disabled = titan_logger.disabled, True
    try:
        return manager._maybe_load_toml(args)
    except FileNotFoundError as e:
        raise ConfigError(f"--job.config_file: no such file: {e.filename}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--job.config_file: not valid TOML: {e}") from None
    finally:
        titan_logger.disabled = disabled


def check_toml(config_cls: type, toml: dict[str, Any]) -> None:
    """Every TOML section and key exists in `config_cls`, and every value has its field's type."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for section, values in toml.items():
        f = fields.get(section)
        if f is None or not dataclasses.is_dataclass(f.type):
            raise ConfigError(f"[{section}]: unknown section{_did_you_mean(section, fields)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of keys, got {values!r}")
        keys = {k.name: k for k in dataclasses.fields(f.type)}
        for key, value in values.items():
            if key not in keys:
                raise ConfigError(f"[{section}] {key}: unknown key{_unknown_key_hint(section, key, keys)}")
            annotation = keys[key].type
            if not _matches(value, annotation):
                raise ConfigError(f"[{section}] {key}={value!r}: must be {_describe(annotation)}")


def _unknown_key_hint(section: str, key: str, keys: Any) -> str:
    from dion3_titan.titan02.job_config import PLUGIN_FIELDS, optimizer_keys

    if section == "optimizer" and (key in optimizer_keys() or key in [f[0] for f in PLUGIN_FIELDS]):
        return ' (a dion3_titan key: set [job] custom_config_module = "dion3_titan.job_config")'
    return _did_you_mean(key, keys)


def _did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _matches(value: Any, annotation: Any) -> bool:
    """Whether a TOML value fits a config field's annotation. Annotations this does not know
    are accepted (torchtitan and tyro then judge them)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or dataclasses.is_dataclass(annotation):
        return True
    if annotation is type(None):
        return value is None
    if _is_union(annotation):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        if not isinstance(value, list):
            return False
        inner = args[0] if args and (origin is list or args[-1] is Ellipsis) else Any
        return all(_matches(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return True


def _describe(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if _is_union(annotation):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin is typing.Literal:
        return f"one of {args!r}"
    if origin in (list, tuple):
        items = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {items[args[0]]}" if args and args[0] in items else "a list"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a table"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def check_pipeline_validation(config: Any) -> None:
    """With pipeline parallelism torchtitan validates through the training schedule, which cuts
    every batch into its microbatches; a validation batch that does not divide into them stops
    the job at the first validation, after `validation.freq` training steps."""
    pp, val = config.parallelism, config.validation
    if pp.pipeline_parallel_degree <= 1 or not val.enable:
        return
    microbatches = config.training.local_batch_size // pp.pipeline_parallel_microbatch_size
    if microbatches and val.local_batch_size % microbatches:
        raise ConfigError(
            f"[validation] local_batch_size={val.local_batch_size}: with pipeline_parallel_degree="
            f"{pp.pipeline_parallel_degree} it must be a multiple of the {microbatches} pipeline "
            "microbatches (training.local_batch_size / pipeline_parallel_microbatch_size); "
            f"set it to {microbatches}, or set [validation] enable = false"
        )


def _parse_with_overrides(manager: Any, args: list[str]) -> Any:
    """torchtitan's full parse (TOML, then command-line overrides through tyro). tyro reports a
    bad override as a multi-line box and exits; condense it to its one-line message."""
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
            warnings.simplefilter("ignore")
            return manager.parse_args(args)
    except SystemExit:
        raise ConfigError(_one_line(printed.getvalue()) or f"bad arguments: {' '.join(args)}") from None
    except ValueError as e:  # torchtitan's own checks while building the config
        raise ConfigError(" ".join(str(e).split())) from None


def _one_line(box: str) -> str:
    """tyro's error box -> its message, plus its first suggestion ("Perhaps you meant ...")."""
    sections: list[list[str]] = [[]]
    for raw in box.splitlines():
        line = raw.strip().strip("│╭╮╰╯").strip()
        if line and set(line) <= set("-─━"):
            sections.append([])
        elif line:
            sections[-1].append(line)
    sections = [s for s in sections if s]
    if len(sections) < 2:
        return " ".join(sections[0]) if sections else ""
    body = sections[1]  # sections[0] is the box title; the per-type "Got errors:" list is noise
    message = " ".join(body[: next((i for i, l in enumerate(body) if l.startswith("Got errors")), len(body))])
    for s in sections[2:]:
        if s[0].startswith("Perhaps you meant") and len(s) > 1:
            message += f" (did you mean {s[1].split()[0]}?)"
    return message


def main(args: list[str] | None = None) -> None:
    """Exit 2 with one line on stderr for a bad config; silent exit 0 for a good one."""
    args = sys.argv[1:] if args is None else args
    if {"-h", "--help"} & set(args):
        return  # nothing to check; the trainer prints the help
    try:
        parse_job_config(args)
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
