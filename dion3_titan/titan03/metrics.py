"""torchtitan 0.3's metrics processor, also logging Dion3's optimizer metrics
(dion3_titan/optimizer_metrics.py: time, communication, update RMS, selection) on its logging steps:
``metrics=Dion3MetricsProcessor.Config(log_freq=10)`` with
``Dion3Optimizers.Config(optimizer_metrics=True, ...)``. TensorBoard/W&B get them under
``optimizer/...``; the console gets one ``[dion3]`` line."""

from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from dion3_titan.optimizer_metrics import console_line


class Dion3MetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    @property
    def optimizers(self):
        return self._dion3_optimizers

    @optimizers.setter
    def optimizers(self, value) -> None:
        # The trainer hands the optimizers container over once it is built: it learns the
        # logging steps here, so it measures exactly those steps.
        self._dion3_optimizers = value
        if hasattr(value, "collect_metrics"):
            value.log_freq = self.config.log_freq

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        opts = self.optimizers
        ours = opts.collect_metrics() if hasattr(opts, "collect_metrics") else {}
        if hasattr(opts, "collect_metrics"):
            opts.align_step(step)
        if ours:
            logger.info(console_line(step, ours))
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics={**(extra_metrics or {}), **ours})
