"""The project's benchmarks and quality runs, importable; scripts/ holds their command lines.

Shared pieces live once: the Llama-shaped parameter model and its synthetic gradients
(llama.py), ranks under torchrun (ranks.py), timers and measured ceilings (timing.py), table
cells and JSON files (output.py). Not part of the installed package (it needs a checkout:
docs/, data/, scripts/), so it is imported with the repository root on sys.path, as scripts/
and the tests do.
"""
