"""Each rank's fingerprint of the state DDP does not sync (the objective's queues and all else it
declares in ``unsynced_state()``, and the key encoder): every checkpoint records one per rank
(``checkpoint["rank_fingerprints"]``, preemption.py), so that ranks that drifted apart show it."""
from __future__ import annotations

import lightning as L

from moco_retrieval.tensor_digest import tensors_sha256


def rank_fingerprints(pl_module: L.LightningModule) -> dict[str, str]:
    """sha256 of this rank's objective state (``objective.unsynced_state()``: queues, guide queues,
    refresh buffers, logQ estimates, ...) and key-encoder weights: the state DDP does not sync."""
    out = {}
    objective = getattr(pl_module, "objective", None)
    state = objective.unsynced_state() if objective is not None else {}
    if state:
        out["objective"] = tensors_sha256(sorted(state.items()))
    key_encoder = getattr(pl_module, "key_encoder", None)
    if key_encoder is not None:
        out["key_encoder"] = tensors_sha256(sorted(key_encoder.state_dict().items()))
    return out


__all__ = ["rank_fingerprints"]
