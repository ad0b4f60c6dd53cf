"""What a run was asked to check and what it will not: the kernels, dtypes and layouts
asked for that no check covers, each with its reason. verify and fuzz print these next
to their verdict (never folded into a PASS), write them to --json, and ``--strict``
fails on any of them.

A name that matches nothing (a dtype, a kernel, a backend) is refused before anything
runs, with the close matches: a run of nothing is never green.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence

from pallascheck.kernels.backends import ALIASES, NAMES, Backend, get_backend
from pallascheck.properties.spec import KernelSpec

# What people write for the dtypes the specs name.
DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "single": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
    "e4m3": "float8_e4m3fn",
    "e4m3fn": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
}


def canonical_dtype(name: str) -> str:
    """The dtype a ``--dtype`` value names: an alias (``e4m3``, ``bf16``) resolved, any
    other name kept as written (checked against the selected kernels later)."""
    return DTYPE_ALIASES.get(name.lower(), name)


@dataclasses.dataclass(frozen=True)
class NotChecked:
    """Something asked for that no check covers: ``kernel`` (with ``dtype`` "-" for
    every dtype) and why."""

    kernel: str
    dtype: str
    why: str

    def line(self) -> str:
        return f"{self.kernel}{'' if self.dtype == '-' else ' ' + self.dtype}: {self.why}"


def did_you_mean(name: str, known: Sequence[str], aliases: Mapping[str, str] | None = None) -> str:
    """``did you mean 'x'?`` from ``aliases`` or the close matches among ``known``; else the known names."""
    if aliases and name.lower() in aliases and aliases[name.lower()] in known:
        return f"did you mean {aliases[name.lower()]!r}?"
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"known: {', '.join(known)}"


def backend(name: str | None) -> Backend:
    """The backend named (None: $PALLASCHECK_BACKEND or interpret); a ValueError with the
    close matches for a name that is none."""
    try:
        return get_backend(name)
    except ValueError as err:
        base = (name or "").partition(":")[0]
        if base in NAMES or base in ALIASES:
            raise  # a known backend with a bad seed: the message says what is wrong
        raise ValueError(f"--backend {name!r} is not a backend: {did_you_mean(base, [*NAMES, *ALIASES])}") from err


def dtypes(asked: Sequence[str], specs: Mapping[str, KernelSpec], on: Backend) -> list[NotChecked]:
    """The kernel x dtype pairs ``asked`` that the selected ``specs`` do not have on
    ``on``; a ValueError naming each asked dtype that no selected kernel has there."""
    known = sorted({d for spec in specs.values() if spec.runs_on(on) for d in spec.dtypes_for(on)})
    unknown = [d for d in asked if d not in known]
    if unknown and specs:
        raise ValueError(
            "; ".join(
                f"--dtype {d!r} matches no selected kernel on {on}: {did_you_mean(d, known, DTYPE_ALIASES)}"
                for d in unknown
            )
        )
    return [
        NotChecked(name, d, f"{name} has no {d} version on {on} (it has {', '.join(spec.dtypes_for(on))})")
        for name, spec in specs.items()
        if spec.runs_on(on)
        for d in asked
        if d not in spec.dtypes_for(on)
    ]


def print_not_checked(items: Sequence[NotChecked], covered_by: str) -> None:
    """The NOT CHECKED block of a run's summary (nothing where every asked thing was
    covered); ``covered_by``: what covers a thing in this run ("check", "task")."""
    if not items:
        return
    print(f"\nNOT CHECKED ({len(items)}; asked for, and no {covered_by} covered it):")
    for item in items:
        print(f"  {item.line()}")
