"""Weight sync from the learner to the rollout servers (one class per transport)."""
