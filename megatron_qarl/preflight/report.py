"""What ``qarl preflight`` found: one ``Finding`` per check, a problem naming the config key, the environment and
the fix, and the report that lists them all at once."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's result. ``detail`` says what was compared (also when it passed); a problem (``ok`` False) names
    the config key at fault where one is (``key``), the environment (``env``: an interpreter, or ``learner`` /
    ``servers``) and the ``fix``. ``ok`` None: not checked, because another problem stands before it."""

    check: str
    ok: bool | None
    detail: str
    key: str | None = None
    env: str | None = None
    fix: str | None = None

    def line(self) -> str:
        if self.ok:
            return f"  ok    {self.check}: {self.detail}"
        if self.ok is None:
            return f"  skip  {self.check}: {self.detail}"
        where = "; ".join(x for x in (self.key, self.env) if x)
        return (f"  FAIL  {self.check}" + (f" [{where}]" if where else "") + f": {self.detail}"
                + (f"\n        fix: {self.fix}" if self.fix else ""))


def problems(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.ok is False]


def format_report(title: str, findings: list[Finding]) -> str:
    """The title, every finding (problems marked FAIL with key, environment and fix) and the verdict line."""
    bad = problems(findings)
    verdict = (f"preflight: {len(bad)} problem{'s' * (len(bad) != 1)} of {len(findings)} checks: the run would fail"
               if bad else f"preflight: all {len(findings)} checks passed")
    return "\n".join([title, *(f.line() for f in findings), verdict])
