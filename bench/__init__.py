"""Timing: kernel benchmarks against their baselines (``pallascheck bench``) and the
harness's own speed (``pallascheck bench --harness``), on one timing core."""
