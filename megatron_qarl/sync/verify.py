"""Whether the servers hold what the learner meant them to: every server's /weights_checker checksums (SGLang's
definition, sync/checksum.py) against the learner's. A real SGLang server hashes its own fused parameters, so
these checks are for the embedded server (docs/rollout.md)."""

from __future__ import annotations

from collections.abc import Iterable

from megatron_qarl.sync.weight_update import SyncError, WeightUpdateAPI


def disagreements(apis: Iterable[WeightUpdateAPI], expected: dict[str, str]) -> str:
    """'' when every server holds exactly ``expected`` (name -> checksum); else which servers and tensors differ."""
    problems = []
    for api in apis:
        held = api.checksums()
        wrong = sorted(n for n in set(expected) | set(held) if held.get(n) != expected.get(n))
        if wrong:
            problems.append(f"{api.url}: {len(wrong)} tensors differ, e.g. {wrong[:3]}")
    return "; ".join(problems)


def check_sent(apis: Iterable[WeightUpdateAPI], sent: dict[str, str]) -> None:
    """Every tensor sent (name -> checksum) is held by each server with that checksum; SyncError otherwise."""
    for api in apis:
        held = api.checksums()
        missing = [n for n in sent if n not in held]
        if missing:
            raise SyncError(f"{api.url}/weights_checker: {len(missing)} sent tensors are not among the "
                            f"server's, e.g. {missing[:3]} (a real SGLang server hashes its own fused "
                            "parameters: verification is for the embedded server)")
        wrong = [n for n, h in sent.items() if held[n] != h]
        if wrong:
            raise SyncError(f"{api.url}: {len(wrong)} tensors differ after sync, e.g. {wrong[:3]}")
