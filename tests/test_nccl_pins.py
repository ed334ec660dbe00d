"""Every NCCL pin of the repository follows one record (issue 38 item 2).

``TORCH_NCCL`` (megatron_qarl/preflight/versions.py) records, for each torch our environments pin, the
nvidia-nccl-cu13 its Linux CUDA wheel's METADATA requires: the nccl.h it is built against. ``ONE_NCCL`` is the NCCL
every environment of a GPU run loads, the newest of them, since a newer NCCL serves programs built against older
headers and not the reverse (docs/cluster.md "One NCCL"). Checked here, against installed METADATA where this machine
has it: the torch pins of setup.py (the installed megatron-qarl's METADATA) and of SGLang (its METADATA) are the
table's; the installed torch's METADATA agrees with it (a CUDA wheel pins its NCCL; a wheel without that requirement
must be a CPU build, as this machine's 2.13.0+cpu is); requirements/nccl.txt and every install command of the
repository pin ONE_NCCL, in every environment docs/cluster.md installs; every other ``nvidia-nccl-cu13==X`` quotes
a torch of the table in its paragraph; docs/cluster.md's table of environments says what the record says; no file
names a requirements file that is not there.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from megatron_qarl.preflight.versions import NCCL_PACKAGE, NCCL_REQUIREMENTS, ONE_NCCL, TORCH_NCCL

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"nvidia-nccl-cu(\d+)\s*==\s*(\d+(?:\.\d+)*)")
TORCH_VERSION = re.compile(r"\btorch(?:==| )(\d+\.\d+\.\d+)")
REQUIREMENTS_FILE = re.compile(r"requirements/[\w.-]+\.txt")


def repository_files() -> list[Path]:
    """The files of the repository that may pin or install NCCL: requirements, docs, README, scripts, the Slurm job,
    setup.py, CI, the package's code (tests hold fixtures, not pins)."""
    found = [*REPO.glob("requirements/*.txt"), *REPO.glob("docs/**/*.md"), *REPO.glob("scripts/*"),
             *REPO.glob("slurm/*"), *REPO.glob("megatron_qarl/**/*.py"), REPO / "README.md", REPO / "setup.py",
             REPO / ".ci" / "run"]
    return sorted(f for f in found if f.is_file())


def torch_pin(requirements: list[str]) -> str:
    """The exact torch version a distribution's requirements pin (``torch==2.14.1``)."""
    (pin,) = [Requirement(r) for r in requirements if canonicalize_name(Requirement(r).name) == "torch"]
    (spec,) = pin.specifier
    assert spec.operator == "==", pin
    return spec.version


def test_the_record_holds_the_torch_every_environment_pins():
    """setup.py's torch (the learner's, vLLM 0.32's too) and SGLang's are the record's, nothing else; the one NCCL
    is the newest any of them is built against, so no torch loads an NCCL older than its headers."""
    learner, sglang = torch_pin(md.requires("megatron-qarl")), torch_pin(md.requires("sglang"))
    assert (learner, sglang) == ("2.13.0", "2.14.1")
    assert set(TORCH_NCCL) == {learner, sglang}
    assert ONE_NCCL == "2.30.7" and all(Version(ONE_NCCL) >= Version(v) for v in TORCH_NCCL.values())


def test_the_installed_torch_metadata_agrees_with_the_record():
    """A CUDA wheel of torch names its NCCL in its METADATA (``nvidia-nccl-cu13==X; platform_system == "Linux"``):
    it must be the record's for that torch. A wheel without it must be a CPU build (this machine's 2.13.0+cpu)."""
    installed = Version(md.version("torch"))
    assert installed.base_version in TORCH_NCCL, installed
    pins = [Requirement(r) for r in md.requires("torch") or [] if canonicalize_name(Requirement(r).name)
            .startswith("nvidia-nccl-cu")]
    if pins:
        (pin,) = pins
        assert (canonicalize_name(pin.name), str(pin.specifier)) == \
            (NCCL_PACKAGE, f"=={TORCH_NCCL[installed.base_version]}"), pin
    else:
        assert installed.local == "cpu", f"torch {installed} requires no nvidia-nccl package but is not a CPU build"


def test_every_nccl_pin_in_the_repository_is_the_one_nccl_or_quotes_a_torch_pin():
    """``nvidia-nccl-cuN==X`` anywhere in the repository's files: N is torch's CUDA 13; an install (a requirement
    line, a pip command) pins ONE_NCCL; any other X quotes the NCCL of a torch its paragraph names. Every
    requirements file a file names exists (requirements/sglang-server-nccl.txt is gone)."""
    wrong, quotes, installs = [], 0, 0
    for path in repository_files():
        text = path.read_text(errors="replace")
        name = path.relative_to(REPO)
        wrong += [f"{name}: names {ref}, which is missing" for ref in REQUIREMENTS_FILE.findall(text)
                  if not (REPO / ref).is_file()]
        for paragraph in re.split(r"\n[ \t]*#?[ \t]*\n", text):
            torches = set(TORCH_VERSION.findall(paragraph))
            for line in paragraph.splitlines():
                for cuda, version in PIN.findall(line):
                    requirement_line = path.suffix == ".txt" and not line.lstrip().startswith("#")
                    install = "pip install" in line or requirement_line
                    if f"nvidia-nccl-cu{cuda}" != NCCL_PACKAGE:
                        wrong.append(f"{name}: nvidia-nccl-cu{cuda} is not torch's {NCCL_PACKAGE}: {line.strip()}")
                    elif install:
                        installs += 1
                        if version != ONE_NCCL:
                            wrong.append(f"{name}: installs NCCL {version}, not ONE_NCCL {ONE_NCCL}: {line.strip()}")
                    elif version != ONE_NCCL:
                        quotes += 1
                        if not any(TORCH_NCCL.get(t) == version for t in torches):
                            wrong.append(f"{name}: NCCL {version} quotes no torch of TORCH_NCCL in its paragraph "
                                         f"(torches named: {sorted(torches)}): {line.strip()}")
    assert not wrong, "\n".join(wrong)
    assert installs >= 1 and quotes >= 1  # requirements/nccl.txt's pin; the torch 2.13.0 pin quoted in the docs


def test_requirements_and_every_documented_environment_install_the_one_nccl():
    """requirements/nccl.txt holds exactly ONE_NCCL; every environment docs/cluster.md installs into (an
    /opt/...-env/bin/pip) installs it, with --no-deps; and no file names another NCCL requirements file."""
    lines = [ln.strip() for ln in (REPO / NCCL_REQUIREMENTS).read_text().splitlines()]
    assert [ln for ln in lines if ln and not ln.startswith("#")] == [f"{NCCL_PACKAGE}=={ONE_NCCL}"]
    doc = (REPO / "docs" / "cluster.md").read_text()
    envs = set(re.findall(r"(/opt/[\w-]+)/bin/pip install", doc))
    with_nccl = set(re.findall(rf"(/opt/[\w-]+)/bin/pip install --no-deps -r {re.escape(NCCL_REQUIREMENTS)}", doc))
    assert envs == with_nccl == {"/opt/qarl-env", "/opt/sglang-env"}, (envs, with_nccl)
    for path in repository_files():
        for ref in REQUIREMENTS_FILE.findall(path.read_text(errors="replace")):
            assert "nccl" not in ref or ref == NCCL_REQUIREMENTS, f"{path.relative_to(REPO)} names {ref}"


def test_the_documented_table_is_the_record():
    """docs/cluster.md "One NCCL": one row per environment, its torch, the NCCL that torch is built against (the
    record's) and the one it loads (ONE_NCCL); every torch of the record has a row."""
    doc = (REPO / "docs" / "cluster.md").read_text()
    section = doc[doc.index("### One NCCL\n"):doc.index("\n### ", doc.index("### One NCCL\n") + 1)]
    rows = re.findall(r"^\| ([^|]+) \| (\d+\.\d+\.\d+) \| (\d+\.\d+\.\d+) \| (\d+\.\d+\.\d+) \|$", section, re.M)
    assert len(rows) == 3, rows  # the learner, SGLang's servers, vLLM's servers on GPUs
    for environment, torch, built, loads in rows:
        assert (TORCH_NCCL.get(torch), loads) == (built, ONE_NCCL), environment
    assert {torch for _, torch, _, _ in rows} == set(TORCH_NCCL)
