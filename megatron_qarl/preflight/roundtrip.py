"""The weight-update round trip of ``qarl preflight``: a real process group between this process (the learner's
environment, rank 0) and a process of the servers' environment (rank 1: preflight/probe.py, started through
``rollout.launch_prefix`` / ``rollout.server_python``), formed and used as the real sync forms and uses it.

This side is the learner's rank 0 in sync/transport.py: ``wire.init_custom_process_group`` on ``tcp://addr:port``,
the group's backend ``moe.parallelize.dist_backend()`` (gloo on CPU, NCCL on GPUs), each tensor of one bucket placed
with ``to_group_device`` and sent with ``broadcast`` from rank 0, in order. The other side joins as that backend's
server does (probe.py ``join_group``: SGLang's ``init_custom_process_group``, our vLLM weight-transfer backend's
``join_group``, the embedded server's ``wire.init_custom_process_group``) and receives as it does. It answers the
sha256 of every tensor it received; each must equal the sent tensor's. Under NCCL this is where two NCCL versions
meet (NCCL refuses the communicator) and where a peer on the wrong device fails; the peer takes this node's second
GPU (NCCL refuses two ranks on one GPU), so an NCCL round trip needs two GPUs on the node.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_qarl.moe.parallelize import broadcast, free_port, to_group_device
from megatron_qarl.preflight.probe import digest
from megatron_qarl.preflight.report import Finding
from megatron_qarl.wire import dtype_name, init_custom_process_group

if TYPE_CHECKING:
    from megatron_qarl.preflight.peer import ProbeProcess

GROUP_NAME = "qarl_preflight_weight_update"


def bucket(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """One bucket of the dtypes a sync sends: W4A16's packed int32 codes and bf16 scales, a bf16 dense weight, an
    fp32 norm, INT8 codes (random, seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.layers.0.mlp.experts.0.gate_proj.weight_packed",
         torch.randint(-2**31, 2**31 - 1, (64, 16), dtype=torch.int32, generator=g)),
        ("model.layers.0.mlp.experts.0.gate_proj.weight_scale", torch.randn(64, 1, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.qkv_proj.weight", torch.randn(96, 64, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(64, generator=g)),
        ("model.layers.0.mlp.experts.1.down_proj.weight", torch.randint(-128, 128, (8, 64), dtype=torch.int8,
                                                                          generator=g)),
    ]


class RoundTrip:
    """One bucket from rank 0 (here) to rank 1 (a probe in the servers' environment) over ``backend``."""

    def __init__(self, backend: str, addr: str = "127.0.0.1", timeout_s: float = 120.0):
        self.backend, self.addr, self.timeout_s = backend, addr, timeout_s
        self.port = free_port()
        self.tensors = bucket()
        self.gpus = torch.cuda.device_count() if backend == "nccl" else 0

    @property
    def skipped(self) -> str | None:
        """Why the round trip cannot run on this node, or None."""
        if self.backend == "nccl" and self.gpus < 2:
            return f"an NCCL round trip needs two GPUs on this node (NCCL refuses two ranks on one), it has {self.gpus}"
        return None

    def group(self) -> dict:
        """The probe's ``group`` task: where and how to join, and the bucket's names, dtypes and shapes."""
        return {"backend": self.backend, "init_method": f"tcp://{self.addr}:{self.port}", "world_size": 2, "rank": 1,
                "group_name": GROUP_NAME, "timeout_s": self.timeout_s, "device": 1,
                "tensors": [[name, dtype_name(t.dtype), list(t.shape)] for name, t in self.tensors]}

    def run(self, peer: ProbeProcess, label: str) -> Finding:
        """Host the group, send the bucket, compare the peer's digests; the peer has said it is joining."""
        sent: dict = {}

        def host() -> None:
            try:
                sent["pg"] = init_custom_process_group(self.backend, f"tcp://{self.addr}:{self.port}", 2, 0,
                                                       GROUP_NAME, timeout_s=self.timeout_s)
                for name, tensor in self.tensors:
                    broadcast(to_group_device(tensor, sent["pg"]), 0, sent["pg"], name=name)
            except Exception as err:  # noqa: BLE001 - reported with the peer's side
                sent["error"] = f"{type(err).__name__}: {err}"

        thread = threading.Thread(target=host, daemon=True, name="preflight-round-trip")
        thread.start()
        answer = peer.next() or {}
        thread.join(self.timeout_s if answer.get("digests") else 5.0)  # a peer that failed never joins: no wait
        if "pg" in sent and not thread.is_alive():
            dist.destroy_process_group(sent["pg"])
        what = (f"a {self.backend} group of this process (learner's environment, rank 0) and {label} (rank 1), "
                f"tcp://{self.addr}:{self.port}")
        if not answer.get("digests") or "error" in sent:
            why = "; ".join(x for x in (answer.get("error"), sent.get("error")) if x) or peer.failure()
            return Finding("weight-update round trip", False, f"{what}: failed: {why}", env=label,
                           fix="see the error; the group is the real sync's (sync/transport.py), so the run's "
                               "first sync would fail the same way")
        differ = [name for name, t in self.tensors if answer["digests"].get(name) != digest(t)]
        size = sum(t.numel() * t.element_size() for _, t in self.tensors)
        if differ:
            return Finding("weight-update round trip", False, f"{what}: received bytes differ from those sent in "
                           f"{', '.join(differ)}", env=label, fix="a dtype or transport mismatch between the "
                                                                  "environments' torch builds")
        return Finding("weight-update round trip", True, f"{what}: one bucket of {len(self.tensors)} tensors "
                       f"({', '.join(sorted({dtype_name(t.dtype) for _, t in self.tensors}))}; {size} bytes) "
                       f"received identical (sha256)")
