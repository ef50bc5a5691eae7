"""The project's benchmarks and quality runs, importable: scripts/ holds their command lines.

Shared pieces live once: the Llama-shaped parameter model (llama.py), timers (timing.py), and
number formatting and JSON output (output.py). Not part of the installed package (it needs a
checkout: docs/, data, scripts/), so it is imported with the repository root on sys.path, as
scripts/ and the tests do.
"""
