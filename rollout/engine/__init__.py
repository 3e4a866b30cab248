"""One engine in one process, synchronous: `Engine` (builds the components, the public methods), the
scheduler, sequences' stops, detokenisation, results, input checks and the host half of scoring.

May import: the top-level value modules (config, api, sampling, outputs, distributed), state/, runner/
and everything below it. Never process/, fronts/, serve/ or compat/.
"""

from rollout.engine.engine import Engine

__all__ = ["Engine"]
