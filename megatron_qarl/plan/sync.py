"""Seconds of a weight sync at cluster size, per learner layout and link: from the payload's byte counts (the
simulation's, ``plan.simulate``: what rank 0 sent, at the model's layers) and stated link bandwidths.

A sync (sync/payload.py, sync/transport.py) is two transfers one after the other, per tensor:
  gather     rank 0 receives every other EP rank's expert codes (an all-gather over the EP group): the low-bit
             bytes x (ep - 1) / ep, over NVLink while the EP group stays in a node, else over the inter-node link
             for the share of ranks on other nodes (the high-precision tensors' TP gathers stay in a node: TP <= 8);
  broadcast  rank 0 broadcasts every byte of the payload to the rollout servers over the weight-update group:
             bytes / the link's bandwidth (NCCL pipelines a broadcast, so the receivers' count barely matters).
seconds = gather + broadcast (+ the servers' repack and the HTTP calls, not counted).
A delta sync (sync/delta.py) still gathers every code to rank 0 (it diffs against its baseline) and broadcasts only
the changed share: ``DELTA_SHARES``, the wire bytes over the full sync's measured in BENCHMARKS.md (W4A16,
Qwen3-30B-A3B-shaped slice, 20 Adam steps): median 1.3% at lr 1e-6, 10.1% at lr 1e-5, 21.1% at worst (the first
step after loading).
"""

from __future__ import annotations

from megatron_qarl.plan.memory import LearnerLayout

GB = 1e9
# bytes/s per direction; nominal figures of the hardware's public specifications
LINKS = {
    "nvlink_h100": 450 * GB,  # H100 SXM: 900 GB/s of NVLink 4 bandwidth, both directions (NVIDIA H100 datasheet)
    "ib_ndr_400": 50 * GB,  # one 400 Gb/s NDR InfiniBand port
    "ib_hdr_200": 25 * GB,  # one 200 Gb/s HDR InfiniBand port
    "eth_100": 12.5 * GB,  # 100 Gb/s Ethernet
}
DELTA_SHARES = {"lr 1e-6 median": 0.013, "lr 1e-5 median": 0.101, "first step (worst)": 0.211}


def gather_seconds(low_bit_bytes: int, lay: LearnerLayout, gpus_per_node: int, link: str) -> float:
    """Rank 0's share of the EP all-gather of the expert codes (module docstring)."""
    if lay.ep <= 1:
        return 0.0
    received = low_bit_bytes * (lay.ep - 1) / lay.ep
    if lay.ep <= gpus_per_node:
        return received / LINKS["nvlink_h100"]
    remote = (lay.ep - gpus_per_node) / (lay.ep - 1)  # of the peers, those on other nodes
    return received * remote / LINKS[link] + received * (1 - remote) / LINKS["nvlink_h100"]


def sync_seconds(payload_bytes: int, low_bit_bytes: int, lay: LearnerLayout, *, gpus_per_node: int,
                 link: str) -> dict[str, float]:
    """Seconds of a full sync and of a delta sync at each of ``DELTA_SHARES`` over ``link`` (one of LINKS)."""
    if link not in LINKS:
        raise ValueError(f"link {link!r} is not one of {', '.join(LINKS)}")
    gather = gather_seconds(low_bit_bytes, lay, gpus_per_node, link)
    out = {"gather_s": gather, "full_s": gather + payload_bytes / LINKS[link]}
    for name, share in DELTA_SHARES.items():
        out[f"delta {name}_s"] = gather + share * payload_bytes / LINKS[link]
    return out


def sync_table(payload_bytes: int, low_bit_bytes: int, layouts: list[LearnerLayout], *, gpus_per_node: int = 8,
               links: tuple[str, ...] = ("ib_ndr_400", "eth_100")) -> list[dict]:
    """One row per (layout, link): the seconds of ``sync_seconds``, rounded to 0.01 s."""
    rows = []
    for lay in layouts:
        for link in links:
            secs = sync_seconds(payload_bytes, low_bit_bytes, lay, gpus_per_node=gpus_per_node, link=link)
            rows.append({"layout": f"tp{lay.tp}/ep{lay.ep} on {lay.gpus}", "link": link,
                         **{k: round(v, 2) for k, v in secs.items()}})
    return rows
