"""The project's benchmarks and quality runs, importable; scripts/ holds their command lines.

Shared pieces live once: the Llama-shaped parameter model, its synthetic gradients and the
llama3 arguments bench_train trains (llama.py), ranks under torchrun (ranks.py), timers,
quartiles and measured ceilings (timing.py), table cells and JSON files (output.py), the
checkout, commit and device name of a result (machine.py). A benchmark of several concerns is
split by concern into modules named after it (step_*.py, quality_*.py, train_*.py). Not part of
the installed package (it needs a checkout: docs/, data/, scripts/), so it is imported with the
repository root on sys.path, as scripts/ and the tests do.
"""
