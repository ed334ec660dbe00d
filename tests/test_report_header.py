"""The session header names the machine (issue 46 item 5): a failure report says which CPU and which optional
environments it came from."""

from __future__ import annotations

from conftest import machine_report


def test_the_header_names_the_cpu_its_gating_flags_the_cores_and_the_optional_environments():
    text = "\n".join(machine_report())
    for word in ("machine:", "cores", "avx2=", "avx512f=", "avx512_fp16=", "amx_tile=", ".vllm-venv", "Slurm",
                 "cc "):
        assert word in text, (word, text)
    assert "unknown" not in text.split(";")[0], text  # /proc/cpuinfo gave the model name
