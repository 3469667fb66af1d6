"""The steps of benchmarks/gpu_check.py, one module each; _check.py says what a step is handed."""
