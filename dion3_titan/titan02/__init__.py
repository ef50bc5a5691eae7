"""The torchtitan 0.2 adapter: TOML job configs. The same roles as titan03/, under the same
file names where the role is the same:

- ``optimizers``: ``Dion3OptimizersContainer`` (torchtitan's OptimizersContainer with Dion3,
  Muon, NorMuon or PRMuon) and ``build_dion3_optimizers``, torchtitan's builder signature.
- ``job_config``: the ``[optimizer]`` keys (public name ``dion3_titan.job_config``), and
  ``check_config``: the whole job config checked before any rank builds anything.
- ``plugin``: every built-in model's TrainSpec wrapped so our names build our container, plus
  two fixes to torchtitan 0.2.2.
- ``metrics``: torchtitan's metrics processor, also logging the optimizer metrics.
- ``cpu_shims``: training on CPU (gloo) when no accelerator is present.
- ``train``: ``python -m dion3_titan.train`` on 0.2.

Only the adapters (and the shared glue beside them: train.py, cpu_shims.py, data/) import
torchtitan.
"""
