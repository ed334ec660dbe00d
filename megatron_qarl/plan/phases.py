"""The phases of one training step, as the learner's GPUs live through them: the one table the planner
(plan/step.py) and the simulation (plan/simulate.py) share.

Every phase holds the persistent state (weights, gradients, optimizer, QAT cache) and what it allocates itself; the
step's peak is the largest phase. ``applies`` says whether a run config runs the phase at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_qarl.config import QarlConfig


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    code: str  # what runs (the project's function)
    what: str  # what it allocates beyond the persistent state
    applies: Callable[[QarlConfig], bool]


def _always(cfg: QarlConfig) -> bool:
    return True


def _routes(cfg: QarlConfig) -> bool:
    return cfg.algo.wants_routes


def _unscaled(cfg: QarlConfig) -> bool:
    """The trainer's mismatch split (train.async on, train.mismatch_split) at a temperature other than 1: only
    then does it run one more forward at temperature 1 (Trainer._mismatch_split)."""
    return (cfg.train.async_mode != "off" and cfg.train.mismatch_split
            and cfg.rollout.sampling.temperature != 1.0)


def _peers(cfg: QarlConfig) -> bool:
    return cfg.world_size > 1


PHASES = (
    Phase("logprob_forward", "Learner.forward_logprobs (train/trainer.py: logp_old)",
          "no-grad forward of the rank's rows, one micro-batch at a time: one layer's working set and the logits",
          _always),
    Phase("r3_forward", "Learner.forward_routes (train/trainer.py: routing_logprobs; algo.routing_replay or "
          "routing_agreement)", "no-grad forward recording or replaying routes: as logprob_forward, plus the routes",
          _routes),
    Phase("train_step", "Learner.train_step", "forward + backward of one micro-batch (saved activations, logits, "
          "gradients in flight), then the optimizer step", _always),
    Phase("sync_sender", "sync.payload.iter_sync_tensors into sync.transport.BroadcastTransport.session (rank 0)",
          "rank 0: the bucket being filled (up to rollout.sync.bucket_mb past its last tensor) and the EP gather of "
          "each expert tensor's codes", _always),
    Phase("sync_peer", "sync.payload.iter_sync_tensors (learner ranks > 0)",
          "the other ranks: their part of each all-gather, one tensor at a time", _peers),
    Phase("checkpoint_save", "learner.checkpoint.save_learner", "the sharded state dicts of model and optimizer "
          "(dist-checkpointing writes them through host memory)", _always),
    Phase("eval_forward", "Learner.forward_logprobs(temperature=1.0) (train/trainer.py: the mismatch split's "
          "unscaled log-probs; held-out evaluation itself generates on the rollout servers)",
          "as logprob_forward", _unscaled),
)
PHASE_NAMES = tuple(p.name for p in PHASES)


def phases_of(cfg: QarlConfig) -> tuple[Phase, ...]:
    """The phases ``cfg``'s training step runs."""
    return tuple(p for p in PHASES if p.applies(cfg))
