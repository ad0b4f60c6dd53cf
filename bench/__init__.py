"""Timing: kernel benchmarks against their baselines (``pallascheck bench``) and the
harness's own speed (``python -m studies.harness``), on one timing core."""
