"""The torchtitan 0.3 adapter: Python config functions instead of TOML.

- ``optimizers.Dion3Optimizers``: an ``OptimizersContainer`` whose ``Config`` takes torchtitan's
  own ``ParamGroupConfig`` list with ``optimizer_name`` "Dion3", "Muon", "NorMuon" or "PRMuon"
  (next to torchtitan's "AdamW", "Adam", "DistMuon").
- ``metrics.Dion3MetricsProcessor``: torchtitan's metrics processor that also logs the
  optimizer metrics.
- ``recipes``: config functions for ``--module dion3_titan.titan03.recipes --config <name>``.
- ``train``: ``python -m dion3_titan.train`` on 0.3 (CPU shims when no accelerator).

Only the adapters (titan02/, titan03/) and the shared glue beside them (train.py, cpu_shims.py,
data/) import torchtitan.
"""
