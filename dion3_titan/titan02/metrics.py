"""torchtitan 0.2's metrics processor, also logging our optimizers' metrics
(dion3_titan/optimizer_metrics.py: time, communication, update RMS, selection) on its logging
steps, with `[optimizer] optimizer_metrics = true`. TensorBoard/W&B get them under
``optimizer/...``; the console gets one ``[dion3]`` line. plugin.register wraps every model's
metrics builder with ``wrap_metrics_builder``."""

import weakref
from collections.abc import Callable
from typing import Any

from torchtitan.tools.logging import logger

from dion3_titan.optimizer_metrics import console_line

# The containers of this process (optimizers.Dion3OptimizersContainer), whose metrics the
# processor logs.
LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LOG_FREQ = [10]  # torchtitan's metrics.log_freq, read when its metrics processor is built


def should_log(step: int) -> bool:
    """torchtitan's MetricsProcessor.should_log rule."""
    return step == 1 or step % _LOG_FREQ[0] == 0


def wrap_metrics_builder(original: Callable | None) -> Callable:
    """torchtitan's metrics processor whose ``log`` also reports our optimizers' metrics."""
    from torchtitan.components.metrics import build_metrics_processor

    original = original or build_metrics_processor

    def build(job_config, *args, **kwargs):
        processor = original(job_config, *args, **kwargs)
        _LOG_FREQ[0] = job_config.metrics.log_freq
        log = processor.log

        def log_with_optimizer(step, *a, extra_metrics=None, **k):
            extra = dict(extra_metrics or {})
            ours: dict[str, float] = {}
            for container in list(LIVE):
                ours.update(container.collect_metrics())
                container.align_step(step)
            if ours:  # the console line; TensorBoard/W&B get them through extra_metrics
                logger.info(console_line(step, ours))
            return log(step, *a, extra_metrics={**extra, **ours}, **k)

        processor.log = log_with_optimizer
        return processor

    return build
