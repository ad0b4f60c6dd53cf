"""The per-case time limit of ``verify`` and pytest's ``spec_tests``: a kernel that
hangs (a barrier no one arrives at, an interpreter that never returns) is a reported
finding, never a stuck run. ``fuzz`` watches its workers from the parent process
(fuzz/workers.py) with the same default limit, ``CASE_TIMEOUT_S``.

A hung case cannot be interrupted from Python: it waits inside XLA (C++), where no
exception reaches it. So when a case passes its limit the watchdog's thread writes
the report (kernel, dtype, backend, config, shapes, the replay command and the Python
stack of every thread) to stderr and, where asked, to a file, saves the case for
``pallascheck replay`` where a failure directory is given, and ends the process with
``HANG_EXIT_CODE``. verify's parent turns that into a failed "hang" row and runs the
other units on; pytest-xdist reports the test as failed (its worker crashed) and starts
another worker; a run in one process stops there, with the report.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pallascheck.properties.runner import Search, config_to_json
from pallascheck.properties.spec import Case

CASE_TIMEOUT_S = 300.0
# A production case at the largest layouts is minutes of float64 oracle work (a 64k
# attention case took 193 s on an H100, its compiles included; 128k does about four
# times that work): the same limit would call it a hang. verify and fuzz use this one
# at --shapes production.
PRODUCTION_CASE_TIMEOUT_S = 1800.0


def case_timeout(shapes: str) -> float:
    """The default time limit of one case at the ``shapes`` tier."""
    return PRODUCTION_CASE_TIMEOUT_S if shapes == "production" else CASE_TIMEOUT_S


HANG_EXIT_CODE = 124  # what timeout(1) exits with


class CaseWatchdog:
    """Arms a timer per case (``before_case``), disarms it when the case is done
    (``after_case``, or leaving the ``watching`` block). ``before_report`` runs first
    when a case hangs (pytest's plugin stops capturing output there, so that the
    report reaches the terminal)."""

    def __init__(
        self,
        timeout_s: float,
        *,
        kernel: str,
        dtype: str,
        backend: str,
        replay: str = "",
        failure_dir: str | None = None,
        report_path: str | None = None,
        before_report: Callable[[], None] | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"case timeout must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.kernel, self.dtype, self.backend, self.replay = kernel, dtype, backend, replay
        self.failure_dir, self.report_path = failure_dir, report_path
        self.before_report = before_report
        self._timer: threading.Timer | None = None

    def before_case(self, case: Case, config: Any) -> None:
        self.disarm()
        self._timer = threading.Timer(self.timeout_s, self._expired, args=(case, config))
        self._timer.daemon = True
        self._timer.start()

    def after_case(self, case: Case, config: Any, tally: Any) -> None:
        self.disarm()

    def search(self) -> Search:
        """The runner hooks that arm and disarm it."""
        return Search(before_case=self.before_case, after_case=self.after_case)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def report(self, case: Case, config: Any) -> str:
        return (
            f"[hang] kernel={self.kernel} dtype={self.dtype} backend={self.backend} config={config}: "
            f"no result in {self.timeout_s:g} s on the case {case.describe()}"
            + (f"\n  replay: {self.replay}" if self.replay else "")
        )

    def _expired(self, case: Case, config: Any) -> None:
        message = self.report(case, config)
        if self.failure_dir is not None:
            os.makedirs(self.failure_dir, exist_ok=True)
            path = os.path.join(self.failure_dir, f"{self.kernel}-{self.dtype}-hang.npz")
            meta = {
                "kernel": self.kernel,
                "dtype": self.dtype,
                "backend": self.backend,
                "check": "hang",
                "config": config_to_json(config),
                "message": message,
            }
            Case(case.arrays, {**case.params, "__failure__": meta}).save(path)
            message += f"\n  saved: {path} (pallascheck replay {path})"
        if self.before_report is not None:
            self.before_report()
        if self.report_path is not None:
            os.makedirs(os.path.dirname(self.report_path) or ".", exist_ok=True)
            with open(self.report_path, "w") as f:
                f.write(message)
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(HANG_EXIT_CODE)


@contextlib.contextmanager
def watching(dog: CaseWatchdog) -> Iterator[CaseWatchdog]:
    """The block's cases are watched; no timer outlives it."""
    try:
        yield dog
    finally:
        dog.disarm()
