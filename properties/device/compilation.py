"""How the harness compiles: JAX's persistent compilation cache under
``.pallascheck/jax-cache``, and quick XLA:CPU compiles for the interpreters.

Where the time goes: in interpret mode nearly all of a check's time is XLA:CPU
compiling the interpreted kernel (a large program of loops and dynamic slices), not
running it. Two things cut that cost without checking less:

- the on-disk cache lets every pytest-xdist worker, ``verify --jobs`` process and
  later run reuse an executable compiled once. JAX writes entries atomically
  (temporary file, then rename), so concurrent workers are safe. Executables that
  call back into Python (the TPU and Mosaic GPU interpreters) are not cacheable;
  JAX skips them.
- XLA:CPU's LLVM back end at optimisation level 1, without its expensive passes,
  compiles faster (the matmul and layer-norm properties: 26.8 s instead of 32.2 s). XLA:CPU never enables
  fast-math, so every operation still rounds as IEEE says; what may change is the
  order of the terms inside one XLA dot and whether a multiply-add is fused. Both are
  inside every bound here: a sum of b terms in any order is within gamma_{b-1}, which
  is what the bounds charge for one block, and a fused multiply-add rounds once where
  the model charges twice. Level 0 is not used: XLA's unoptimised tanh is less
  accurate than the activation models allow (tests/test_activation_models.py fails
  gelu_tanh's f32 derivative at 1.1x its bound there; it passes at level 1, and that
  test runs under these flags in every session).
"""

from __future__ import annotations

import os

import jax
import threadpoolctl

from pallascheck.kernels.backends import Backend

CACHE_ENV_VAR = "PALLASCHECK_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join(".pallascheck", "jax-cache")
QUICK_CPU_FLAGS = ("--xla_backend_optimization_level=1", "--xla_llvm_disable_expensive_passes=true")
# XLA:CPU's thunks in one sequential order, run on the calling thread. The Mosaic GPU
# interpreter runs each warpgroup as its own XLA:CPU program on a Python thread; the
# concurrency-optimised order lets a program run independent thunks on XLA's intra-op
# pool (one thread per core) and wait for them there. A warpgroup waiting at a barrier
# holds a pool thread inside a Python callback, the outer kernel call holds another,
# and on a 2-core machine the other warpgroups' programs then wait for a thread no one
# frees: the warp-specialised dk/dv kernel with GQA, causal and a mask never finished
# (0 of 6 runs; 4 of 4 with this flag; tests/test_attention.py). The order of
# independent operations changes no value.
INTERPRETER_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
# Host BLAS threads of a worker process on a GPU backend. Below
# runner.DEVICE_ORACLE_ELEMENTS the oracles are numpy on arrays of at most ~1e5
# elements, where a BLAS thread per core gains nothing and its spinning threads take
# the cores XLA compiles on. Measured on an H100 host (16 cores), 8 processes at once,
# each a first layout then 128 cases: the first layout took 1.5-3.6 s with one BLAS
# thread against 3.3-5.1 s with 16 (GLU), 2.8-5.4 s against 5.7-8.0 s (attention).
WORKER_BLAS_THREADS = 1
# XLA:GPU flags of a worker process (never a user's process, never a benchmark's).
# XLA autotunes every new GEMM shape of xla_reference and of the device oracles by
# compiling and timing candidate kernels, for programs a check runs a few times. Off,
# XLA takes its default GEMM kernel: the same products, summed in another order at
# most (every budget of the runs below is the same to the last digit).
# `verify --backend mosaic_gpu --examples 15` on an H100, empty cache, no durations
# file, runs interleaved: 83.2 and 87.0 s with autotuning (849 and 900 s of unit
# time), 66.6 and 68.4 s without (656 and 674 s). The device oracles' programs, run
# a thousand times a case at the production tier, autotune their own GEMMs
# (properties/device/programs.py).
GPU_WORKER_FLAGS = ("--xla_gpu_autotune_level=0",)


def enable_cache(directory: str | None = None) -> str | None:
    """Point JAX's persistent cache at ``directory`` (default $PALLASCHECK_CACHE_DIR or
    .pallascheck/jax-cache); an empty $PALLASCHECK_CACHE_DIR turns it off. Returns the
    directory used, or None."""
    directory = os.environ.get(CACHE_ENV_VAR, DEFAULT_CACHE_DIR) if directory is None else directory
    if not directory:
        return None
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    # Cache every executable: each interpreted kernel compiles in well under JAX's
    # default 1 s threshold, but a run compiles thousands of them. The environment
    # carries the settings into child processes (multi-device checks, verify workers).
    settings = {
        "jax_compilation_cache_dir": directory,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
    return directory


# XLA:CPU by default computes a chain of bf16/f16 operations in f32 and rounds once
# (excess precision), so a kernel that rounds an intermediate to bf16 is run as if it
# did not: more precisely than a GPU runs it. JAX's bundled softmax subtracts its row
# max in bf16 (``row - row_max``, then the f32 cast): 4.8 times the f32-intermediate
# bound with this flag on the CPU, within it without (docs/results.md). Set only where
# a run judges declared precision (the gate's own processes), before JAX starts.
AS_WRITTEN_CPU_FLAGS = ("--xla_allow_excess_precision=false",)


def excess_precision_allowed() -> bool:
    """Whether XLA:CPU may compute low-precision intermediates in f32 in this process
    (``AS_WRITTEN_CPU_FLAGS`` not in $XLA_FLAGS)."""
    return AS_WRITTEN_CPU_FLAGS[0] not in os.environ.get("XLA_FLAGS", "").split()


def add_xla_flags(flags: tuple[str, ...]) -> None:
    """Add ``flags`` to $XLA_FLAGS, each unless the user set that flag otherwise. Only
    effective before JAX creates the backend's client; child processes inherit it."""
    current = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in flags if f.split("=")[0] not in current]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()


# The share of a GPU's memory JAX may allocate in our processes: the rest is the CUDA
# context, cuBLAS/cuDNN workspaces and the compiler's scratch (about 3 GiB on an H100).
GPU_MEMORY_FRACTION = "0.95"
# How many worker processes share each device (verify's and fuzz's --jobs on fewer
# GPUs), set by the parent for its workers: each plans with its share of the device's
# memory (properties/production.py) and allocates no more than it (``configure``).
SHARING_ENV_VAR = "PALLASCHECK_PROCESSES_PER_DEVICE"
# Set in a worker whose allocator ``configure`` held to its share: the share's count.
CAPPED_ENV_VAR = "PALLASCHECK_ALLOCATOR_SHARE"


def processes_per_device() -> int:
    """How many processes share each device ($PALLASCHECK_PROCESSES_PER_DEVICE; 1 when unset)."""
    value = os.environ.get(SHARING_ENV_VAR, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${SHARING_ENV_VAR} must be a positive integer, got {value!r}")
    return int(value)


def allocator_capped() -> bool:
    """Whether this process's allocator is held to its share of the device
    (``configure``), so that JAX's limit is that share already."""
    return os.environ.get(CAPPED_ENV_VAR) == str(processes_per_device())


def configure(backend: Backend, *, worker: bool = False) -> None:
    """Set up compilation for a run on ``backend``: the cache always, quick
    XLA:CPU compiles where the kernels run on the CPU (a GPU run's own process keeps
    XLA's defaults, so that the baselines it times are compiled as users compile them).
    ``worker``: this is one of the worker processes of ``verify``, ``fuzz`` or
    ``mutate``, never a user's process: on a GPU backend its host BLAS gets one thread
    (``WORKER_BLAS_THREADS``) and XLA does not autotune (``GPU_WORKER_FLAGS``)."""
    enable_cache()
    if backend.platform == "cpu":
        add_xla_flags(QUICK_CPU_FLAGS + INTERPRETER_FLAGS)
        return
    # several processes share one GPU: each allocates what it uses, up to
    # GPU_MEMORY_FRACTION of the device (JAX's default 0.75 left the largest production
    # layouts, 64-66 GiB checks, out on an 80 GiB H100: 59 GiB allowed)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
    if worker:
        threadpoolctl.threadpool_limits(WORKER_BLAS_THREADS, user_api="blas")
        add_xla_flags(GPU_WORKER_FLAGS)
        # Workers sharing a GPU each allocate at most their share. Each grows its own
        # pool and keeps what it frees: on an H100 two verify workers, each unit
        # within its share by the memory rule, ran out of memory together
        # (docs/results.md, 2026-11-28); held to its share, a worker that needs more
        # is refused alone, and the other is not. A fraction the user set is kept.
        share = processes_per_device()
        if share > 1 and os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == GPU_MEMORY_FRACTION:
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{float(GPU_MEMORY_FRACTION) / share:.4f}"
            os.environ[CAPPED_ENV_VAR] = str(share)
