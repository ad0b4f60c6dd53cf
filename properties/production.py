"""The production shape tier: the sizes models run at, per kernel family.

The small tier (each spec's ``cases``) is fast and reaches every code path of a
kernel, but some bugs only show at scale: a pipeline slot reused after thousands of
steps, a group of 1024 rows, a reduction of 16384 terms. ``--shapes production``
draws the named layouts below instead, each taken from a real model (the values
drawn in them, adversarial kinds included, are the family's own, as in the small
tier). A layout whose check would not fit the device is skipped by rule and said so
(``plan``): its footprint, bytes per element of the check's largest array (the
oracle's, or the kernel's or xla_reference's where that is larger), set from the peak
device memory of one production check per family on an H100 (docs/results.md) with
about 20% to spare, against what JAX may allocate on the device.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from hypothesis import strategies as st

from pallascheck.kernels.backends import Backend
from pallascheck.properties import strategies
from pallascheck.properties.spec import Case


@dataclasses.dataclass(frozen=True)
class Layout:
    """One production layout: its name (model and shape), the fields of the family's
    Domain it sets (the spec's own domain keeps the rest: a narrowed domain of a
    user's kernel stays narrowed), and the device bytes its check needs."""

    name: str
    fields: dict[str, Any]
    needs: int


def _attention() -> tuple[Layout, ...]:
    def layout(
        name: str, b: int, s: int, h: int, hkv: int, d: int, causal: tuple[bool, ...], biases: tuple[str, ...] = ()
    ) -> Layout:
        """``biases``: the bias layouts drawn, one in every case (none: no bias). The
        device oracle slices a large case by batch row and kv head, never along an axis
        its bias broadcasts over (attention_slices.py), and unsliced it would not fit:
        a layout draws only the biases that let it slice on both, b x h x s x s
        elements."""
        domain = dict(heads=((b, h, hkv),), seq_q=(s,), seq_kv=None, head_dims=(d,), causal=causal, sm_scales=(None,))
        # a bias layout leaves ``bias`` to the spec's domain: a kernel that takes none keeps none
        domain.update(dict(bias_layouts=biases, bias_always=True) if biases else dict(bias=False))
        # xla_reference holds the whole [b, h, s, s] logits in the input dtype and f32
        # (16.5 GiB at b2 h16 s4096, 33 bytes an element: 40 allowed), the oracle 16
        # float64 [group, s, s] arrays of one slice (attention_slices.py). A bias of
        # b x h x s x s elements adds its gradient's arrays: a check with a full bias at
        # b2 s2000 h16 peaked at 4.5 GiB on an H100, 37.7 bytes an element with the
        # slices' (about 32 without a bias at b2 s4096): 8 more allowed
        per_element = 40 + (8 if biases else 0)
        needs = per_element * b * h * s * s + 16 * 8 * (h // hkv) * s * s
        return Layout(f"{name}: b{b} s{s} h{h}/{hkv} d{d}", domain, needs)

    both = (False, True)
    return (
        layout("llama-3 8B", 1, 4096, 32, 8, 128, (True,)),
        layout("llama-3 8B 8k", 1, 8192, 32, 8, 128, (True,)),
        layout("llama-3 70B", 1, 4096, 64, 8, 128, (True,)),
        layout("gemma-2 9B", 1, 8192, 16, 8, 256, (True,)),
        layout("mistral 7B 32k", 1, 32768, 32, 8, 128, (True,)),
        layout("MHA b2 4k", 2, 4096, 16, 16, 128, both),
        layout("BERT-large 2k", 4, 2048, 16, 16, 64, (False,)),
        layout("unaligned 4000", 2, 4000, 16, 16, 64, both),
        layout("MQA 16k", 1, 16384, 16, 1, 128, (True,)),
        # relative-position biases: T5's per head, a full one per batch row and head
        layout("per-head bias (T5-style), GQA 2k", 1, 2048, 32, 8, 128, both, ("full", "per_head")),
        layout("full bias, unaligned 2000", 2, 2000, 16, 16, 64, both, ("full",)),
    )


def _matmul() -> tuple[Layout, ...]:
    def layout(name: str, m: int, k: int, n: int) -> Layout:
        # 15.8 GiB at 8192^3: 253 bytes per element of the largest array (300 allowed)
        return Layout(f"{name}: {m}x{k} @ {k}x{n}", dict(m=(m,), n=(n,), k=(k,)), 300 * max(m * n, m * k, k * n))

    return (
        layout("square 8192", 8192, 8192, 8192),
        layout("llama-3 8B MLP up, 8k tokens", 8192, 4096, 14336),
        layout("llama-2 7B MLP up, unaligned tokens", 4000, 4096, 11008),
        layout("llama-3 70B MLP down, decode", 1, 28672, 8192),
        layout("llama-3 8B MLP up, decode batch 16", 16, 4096, 14336),
        layout("llama-3 8B MLP up, decode batch 64", 64, 4096, 14336),
    )


def _ragged_dot() -> tuple[Layout, ...]:
    def layout(name: str, m: int, k: int, n: int, groups: int) -> Layout:
        # 1.9 GiB at m8192 k2048 n1024 g8: 122 bytes per element of the largest array
        # (150 allowed). xla_reference, lax.ragged_dot, runs densely on a GPU: at m32768
        # k2048 n1408 g64 its VJP asked for an f32 [g, m, k] (16 GiB) and for 27.7 GiB in
        # one buffer, 10.9 bytes per element of g x m x max(k, n) (16 allowed)
        return Layout(
            f"{name}: m{m} k{k} n{n} g{groups}",
            dict(m=(m,), n=(n,), k=(k,), groups=(groups,)),
            max(150 * max(m * n, m * k, groups * k * n), 16 * groups * m * max(k, n)),
        )

    return (
        layout("Mixtral 8x7B", 8192, 4096, 14336, 8),
        layout("1024 rows per group", 8192, 2048, 1024, 8),
        layout("Qwen1.5-MoE 60 experts", 32768, 2048, 1408, 64),
        layout("DeepSeek-V3 256 experts", 16384, 7168, 256, 256),
        layout("64k tokens, 32 experts", 65536, 1024, 1024, 32),
    )


def _gated_linear_unit() -> tuple[Layout, ...]:
    def layout(name: str, tokens: tuple[int, ...], d: int, f: int) -> Layout:
        t = math.prod(tokens)
        # 35.9 GiB at 8192 tokens, d4096 f14336: 164 bytes per element of the largest
        # array, the [t, 2f] projections (200 allowed)
        return Layout(
            f"{name}: tokens {tokens} d{d} f{f}",
            dict(leading=(tokens,), d=(d,), f=(f,), fan_in_weights=True),
            200 * max(t * 2 * f, t * d, d * 2 * f),
        )

    return (
        layout("llama-3 8B, 8k tokens", (8192,), 4096, 14336),
        layout("llama-2 13B, batch 2 x 2000", (2, 2000), 5120, 13824),
        layout("llama-3 8B, decode batch 16", (16,), 4096, 14336),
    )


FAMILIES: dict[str, Callable[[], tuple[Layout, ...]]] = {
    "attention": _attention,
    "matmul": _matmul,
    "ragged_dot": _ragged_dot,
    "gated_linear_unit": _gated_linear_unit,
}


# How many worker processes share each device (verify's and fuzz's --jobs on fewer
# GPUs): each plans with its share of the device's memory. Two verify workers that
# each planned with the whole H100 ran out of memory on a ragged_dot layout.
SHARING_ENV_VAR = "PALLASCHECK_PROCESSES_PER_DEVICE"


def share_devices(processes_per_device: int) -> None:
    """Declare that this process's workers share each device ``processes_per_device``
    ways (the workers inherit it through the environment)."""
    os.environ[SHARING_ENV_VAR] = str(max(1, processes_per_device))


def _sharing() -> int:
    value = os.environ.get(SHARING_ENV_VAR, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${SHARING_ENV_VAR} must be a positive integer, got {value!r}")
    return int(value)


def memory_limit(backend: Backend) -> int:
    """Bytes JAX may allocate where the backend's oracles run: the device's allocator
    limit on a GPU, divided among the processes that share it; the host's physical
    memory on the CPU."""
    if backend.platform != "cpu":
        stats = jax.devices(backend.platform)[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) // _sharing()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclasses.dataclass(frozen=True)
class Plan:
    fitting: tuple[Layout, ...]
    skipped: tuple[str, ...]  # one line per layout that does not fit, saying why


def plan(family: str, backend: Backend) -> Plan:
    """The family's production layouts that fit ``backend``'s memory, and the rest."""
    limit = memory_limit(backend)
    shared = f" to each of the {_sharing()} processes sharing it" if _sharing() > 1 else ""
    fitting, skipped = [], []
    for layout in FAMILIES[family]():
        if layout.needs <= limit:
            fitting.append(layout)
        else:
            skipped.append(
                f"{layout.name}: its check needs ~{layout.needs / 2**30:.0f} GiB, the device allows "
                f"{limit / 2**30:.0f} GiB{shared}"
            )
    return Plan(tuple(fitting), tuple(skipped))


def production_cases(
    family: str, family_cases: Callable[..., st.SearchStrategy[Case]], domain: Any
) -> Callable[[str, Backend], st.SearchStrategy[Case]]:
    """A spec's ``production`` strategy: one of the family's fitting layouts per
    Hypothesis example (shared by its cases), set in the spec's ``domain``, values
    drawn by ``family_cases(dtype, backend, domain=...)``."""

    def production(dtype: str, backend: Backend, layout: str | None = None) -> st.SearchStrategy[Case]:
        """``layout``: only the layouts whose name contains it."""
        planned = plan(family, backend)
        fitting = [l for l in planned.fitting if layout is None or layout in l.name]
        if not fitting:
            raise ValueError(
                f"no production layout of {family}{f' named {layout!r}' if layout else ''} fits "
                f"{backend}'s memory; skipped: " + "; ".join(planned.skipped)
            )
        chosen = strategies.layout(f"{family}.production", st.sampled_from(fitting))
        return chosen.flatmap(
            lambda layout: family_cases(dtype, backend, domain=dataclasses.replace(domain, **layout.fields))
        )

    return production


def planned(names: Sequence[str], backend: Backend) -> tuple[list[str], list[str]]:
    """``names`` without the production families none of whose layouts fit
    ``backend``'s memory (this process's share of it), and lines for the output: per
    family the layouts drawn and those skipped by the memory rule, then the families
    left out and what to do. A family left in would fail every task of a run, a crash
    booked against a kernel that is not at fault."""
    lines, unfit = [], []
    for family in [n for n in names if n in FAMILIES]:
        p = plan(family, backend)
        lines.append(f"{family}: {len(p.fitting)} production layouts: " + ", ".join(l.name for l in p.fitting))
        lines += [f"  skipped by the memory rule: {line}" for line in p.skipped]
        if not p.fitting:
            unfit.append(family)
    if unfit:
        fewer = " (fewer --jobs give each process a larger share)" if _sharing() > 1 else ""
        lines.append(f"not checked: {', '.join(unfit)}: no production layout fits{fewer}")
    return [n for n in names if n not in unfit], lines
