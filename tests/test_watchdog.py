"""verify's per-case time limit (properties/watchdog.py): a case past --case-timeout
is a failed "hang" row with its report and a saved case, and the run goes on to its
table. (spec_tests' limit: tests/test_pytest_plugin.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_verify_reports_a_case_past_its_limit_as_a_hang_row(tmp_path: Path) -> None:
    # 1 ms: no case finishes in it, so the first case of the property is "hung"; the
    # bad-input unit has no cases and passes in the other worker
    command = [
        sys.executable,
        "-c",
        "import sys; from pallascheck.cli import main; sys.exit(main())",
        "verify",
        "--kernel",
        "rms_norm",
        "--dtype",
        "float32",
        "--examples",
        "1",
        "--case-timeout",
        "0.001",
        "--jobs",
        "2",
        "--failures",
        str(tmp_path / "failures"),
        "--full",
    ]
    env = dict(os.environ, PALLASCHECK_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "FAIL   rms_norm  float32  hang" in done.stdout, out[-3000:]
    assert "pass   rms_norm  -        errors" in done.stdout, out[-3000:]
    assert "[hang] kernel=rms_norm dtype=float32 backend=interpret" in out, out[-3000:]
    assert (tmp_path / "failures" / "rms_norm-float32-hang.npz").exists()
