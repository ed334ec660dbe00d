"""scripts/gpu_wheels.py: which wheels a GPU machine gets (pure decisions, no network), and that they are the
versions the project pins."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_wheels", REPO / "scripts" / "gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_wheels)


def _versions(**overrides):
    return {name: overrides.get(name.replace("-", "_"), version) for name, version, _ in gpu_wheels.WHEELS}


def test_a_machine_with_every_version_installs_nothing():
    assert gpu_wheels.to_install(_versions()) == []


def test_missing_packages_are_installed_and_torch_never():
    got = gpu_wheels.to_install({name: None for name, _, _ in gpu_wheels.WHEELS})
    assert got == [f"{n}=={v}" for n, v, _ in gpu_wheels.WHEELS]
    assert not any(r.startswith("torch") for r in got)


def test_pins_are_replaced_helpers_only_upgraded():
    # an exact pin at another version is replaced, whichever way
    assert gpu_wheels.to_install(_versions(megatron_core="0.15.0")) == ["megatron-core==0.16.1"]
    assert gpu_wheels.to_install(_versions(pydantic_core="2.60.0")) == ["pydantic-core==2.50.5"]
    # a helper the machine has newer stays; an older one is upgraded
    assert gpu_wheels.to_install(_versions(typing_extensions="4.20.0")) == []
    assert gpu_wheels.to_install(_versions(typing_extensions="4.12.2")) == ["typing-extensions==4.16.0"]


def test_wheel_versions_are_the_projects_pins():
    setup = (REPO / "setup.py").read_text()
    pins = dict(re.findall(r'"([a-z0-9-]+)==([0-9.]+)"', setup))
    listed = {n: v for n, v, _ in gpu_wheels.WHEELS}
    for name in ("megatron-core", "nvidia-modelopt"):
        assert listed[name] == pins[name], name


def test_the_wheels_folder_stays_out_of_git():
    proc = subprocess.run(["git", "check-ignore", "-q", "gpu_wheels/x.whl"], cwd=REPO)
    assert proc.returncode == 0


def test_install_without_a_folder_says_so(tmp_path, capsys):
    assert gpu_wheels.install(tmp_path) == 0
    assert "no wheels in" in capsys.readouterr().out
