"""What an operator decides about the server's exposure (flags of `python -m rollout.serve`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.serve.bounds import Bounds

MiB = 1 << 20
WEIGHT_PATHS = ("/update_weights_from_tensor",)  # the routes whose bodies carry weights


@dataclass(frozen=True)
class Policy:
    """allowed_hosts: the Host names answered (None: any; rollout.serve.guard.allowed_hosts builds it
    from the bind address). max_body_bytes: the cap on a request body (None: none), and
    max_weight_body_bytes the cap on the weight-update route's. allow_pickle: unpickle SGLang's
    tensor payloads (runs the sender's code; needs an API key)."""

    allowed_hosts: frozenset[str] | None = None
    max_body_bytes: int | None = 32 * MiB
    max_weight_body_bytes: int | None = 4096 * MiB
    allow_pickle: bool = False
    bounds: Bounds = field(default_factory=Bounds)

    def body_limits(self) -> dict[str, int | None]:
        """Per path ("" for every other path)."""
        return {"": self.max_body_bytes} | {p: self.max_weight_body_bytes for p in WEIGHT_PATHS}
