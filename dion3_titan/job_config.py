"""The public name of the torchtitan 0.2 adapter's `[optimizer]` keys, as every TOML writes it:
`[job] custom_config_module = "dion3_titan.job_config"`. The keys are titan02/job_config.py's;
importing it registers the plugin."""

from dion3_titan.titan02.job_config import JobConfig, Optimizer

__all__ = ["JobConfig", "Optimizer"]
