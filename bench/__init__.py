"""The benchmarks of jetflow_pl: decode speed and tau against autoregressive decoding, continuous batching,
the automatic budget, export parity, distillation and regeneration throughput, and the studies behind the
docs (ablation, head study). Each module is a script run from the repository root as
`python -m bench.NAME` (e.g. `python -m bench.decode --help`; `python -m bench.run_all` runs the suite); its
results are JSON files in bench/results/ (see bench/results/README.md), and `python -m bench.plot` redraws
the figures from them. The modules also import each other's shared helpers (`from bench.decode import ...`).
"""
