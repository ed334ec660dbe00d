"""Code that runs INSIDE vLLM 0.32's workers (its own environment: torch + vllm only, never megatron_qarl):
the weight-transfer backend ``qarl`` that receives our learner's weight sync over a torch.distributed group
(gloo on CPU, NCCL on GPUs), registered with vLLM's own ``WeightTransferEngineFactory``.

Why our own backend: vLLM's built-in backends (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n, modelexpress;
vllm/distributed/weight_transfer/factory.py) are CUDA-only, and their trainer side is vLLM's own
(``NCCLTrainerWeightTransferEngine``: PyNccl over a StatelessProcessGroup), not the torch.distributed group the
learner forms for SGLang (sync/transport.py). This backend joins that very group, so one trainer-side transport
serves SGLang, our embedded server and vLLM.

Started by ``--worker-extension-cls qarl_vllm_ext.QarlWorkerExtension --weight-transfer-config
'{"backend": "qarl"}'`` with this directory on PYTHONPATH (rollout/vllm_launcher.py): vLLM resolves the
extension class when it builds each worker (vllm/v1/worker/worker_base.py), which imports this module and so
registers the backend before the worker loads the model and creates its engine (vllm/v1/worker/gpu_worker.py
``load_model``).

The protocol (vllm/entrypoints/rl/online/api_router.py, with VLLM_SERVER_DEV_MODE=1):
    POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size,
         group_name, backend}}: join the group as ranks rank_offset + worker rank (blocks until the trainer joins)
    POST /start_weight_update -> per bucket POST /update_weights {"update_info": {names, dtype_names, shapes}}
         (one broadcast from rank 0 per tensor, in that order) -> POST /finish_weight_update {"weight_version"}
Loading uses vLLM's layerwise reload, as its NCCL backend does (``initialize_layerwise_reload`` before,
``model.load_weights`` per tensor, ``finalize_layerwise_reload`` after: quantized layers are re-processed there).

vLLM 0.32 CPU defect handled here: on a reload, ``UnquantizedFusedMoEMethod._setup_kernel``
(vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py) copies the reloaded BF16 expert weights
into the kernel's storage but skips ``fused_experts.process_weights_after_loading`` (the CPU experts' prepack into
their grouped-GEMM layout), so every reloaded expert runs on unpacked data: garbage, even for unchanged values.
``finish_weight_update`` runs that prepack once for each unquantized MoE layer this session loaded (never for
the others: their storage is still packed). On GPUs the experts' hook is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.logger import init_logger

BACKEND = "qarl"
logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured "vllm" logger


@dataclass
class QarlInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = 300.0


@dataclass
class QarlUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names, shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


def join_group(info: QarlInitInfo, rank: int) -> dist.ProcessGroup:
    """The trainer's weight-update group (megatron_qarl/wire.py ``init_custom_process_group``, the same
    rendezvous: tcp store, then a store prefixed with the group name)."""
    timeout = timedelta(seconds=info.timeout_s)
    store, rank, world = next(c10d.rendezvous(f"tcp://{info.master_address}:{info.master_port}", rank,
                                              info.world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(info.group_name, store)
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(info.backend), store,
                                           group_name=info.group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def reprepack_reloaded_experts(model: torch.nn.Module, loaded_names: set[str]) -> list[str]:
    """The prepack vLLM 0.32 skips on a reload (module docstring), for each unquantized MoE layer of ``model``
    that received a tensor; returns those layers' names. ``loaded_names`` are checkpoint names
    (``model.layers.0.mlp.experts.3.gate_proj.weight``); vLLM's fused experts module of that layer is named
    ``model.layers.0.mlp.experts`` or, nested, ``model.layers.0.mlp.experts.routed_experts``: a layer was touched
    when a loaded name starts with the module's name up to and including its ``experts`` segment."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    done = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or getattr(method, "moe_kernel", None) is None:
            continue
        parts = name.split(".")
        prefix = ".".join(parts[:parts.index("experts") + 1]) if "experts" in parts else name
        if any(n.startswith(prefix + ".") for n in loaded_names):
            method.moe_kernel.fused_experts.process_weights_after_loading(module)
            done.append(name)
    return done


class QarlWeightTransferEngine(WeightTransferEngine[QarlInitInfo, QarlUpdateInfo]):
    """Receives broadcasts from the trainer's rank 0 on a torch.distributed group and loads them."""

    init_info_cls = QarlInitInfo
    update_info_cls = QarlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self.loaded: set[str] = set()

    def init_transfer_engine(self, init_info: QarlInitInfo) -> None:
        self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = join_group(init_info, rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.loaded = set()
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: QarlUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("qarl weight transfer: no group; call /init_weight_transfer_engine first")
        group_device = torch.device("cuda", torch.cuda.current_device()) if self.group_is_nccl() else "cpu"
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                           strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name), device=group_device)
            dist.broadcast(tensor, src=0, group=self.group)
            self.model.load_weights([(name, tensor)])
            self.loaded.add(name)

    def group_is_nccl(self) -> bool:
        return self.group is not None and dist.get_backend(self.group) == "nccl"

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        done = reprepack_reloaded_experts(self.model, self.loaded)
        logger.info("qarl weight transfer: %d tensors loaded; experts prepacked again: %s", len(self.loaded), done)
        self.loaded = set()

    def shutdown(self) -> None:
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - a group broken by a dead trainer may refuse a clean shutdown
                pass
            self.group = None


if BACKEND not in WeightTransferEngineFactory._registry:  # the module may be imported twice in one process
    WeightTransferEngineFactory.register_engine(BACKEND, QarlWeightTransferEngine)


class QarlWorkerExtension:
    """The ``--worker-extension-cls``: importing it registers the backend; it adds no worker methods."""
