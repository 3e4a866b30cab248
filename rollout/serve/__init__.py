"""An HTTP server over AsyncEngine speaking OpenAI's and SGLang's APIs: `python -m rollout.serve`.

FastAPI and uvicorn are imported here only (install the `serve` extra from the checkout:
`pip install -e ".[serve]"`), and only once `build_app` is asked for: a trainer that imports
`rollout.serve.tensor_wire` to send weights needs neither. See docs/serving.md.

May import: fronts/, process/, engine/ and below; never compat/.
"""

from typing import Any

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from rollout.serve.app import build_app

        return build_app
    raise AttributeError(f"module 'rollout.serve' has no attribute {name!r}")
