"""No dead code in the package, the launchers, the scripts and the benchmarks: vulture (a test dependency) reports
nothing at 60% confidence or more (unused functions, methods, classes, attributes and fields are rated 60%) that
tests/dead_code_whitelist.py does not explain, and the whitelist holds no name vulture no longer reports.
The tests do not count as users: a function only tests call is dead (a test should test what the product runs).

    .venv/bin/python -m vulture megatron_qarl launch scripts benchmarks tests/dead_code_whitelist.py \
        --min-confidence 60 --ignore-decorators "@app.*,@field_validator,@model_validator"

The decorators: FastAPI calls its routes (``@app.get`` / ``@app.post`` / ``@app.exception_handler``), pydantic its
validators.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHITELIST = REPO / "tests" / "dead_code_whitelist.py"
SOURCES = ["megatron_qarl", "launch", "scripts", "benchmarks"]
CALLED_BY_FRAMEWORKS = "@app.*,@field_validator,@model_validator"


def _vulture(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vulture", *SOURCES, *extra, "--min-confidence", "60",
                           "--ignore-decorators", CALLED_BY_FRAMEWORKS], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_vulture_reports_nothing_unexplained():
    proc = _vulture(str(WHITELIST.relative_to(REPO)))
    assert proc.returncode == 0, f"vulture found unused code (delete it, or explain it in {WHITELIST.name}):\n" \
                                 f"{proc.stdout}{proc.stderr}"


def test_every_whitelisted_name_is_still_reported():
    proc = _vulture()
    assert proc.returncode in (0, 3), proc.stderr  # 3: vulture found something
    reported = set(re.findall(r"unused \w+ '(\w+)'", proc.stdout))
    whitelisted = {line.split()[0] for line in WHITELIST.read_text().splitlines() if re.match(r"^\w+\s+#", line)}
    assert whitelisted <= reported, f"stale entries in {WHITELIST.name}: {sorted(whitelisted - reported)}"
