"""An HTTP server over AsyncEngine speaking OpenAI's and SGLang's APIs: `python -m rollout.serve`.

FastAPI and uvicorn are imported here only (pip install rollout-engine[serve]). See docs/serving.md.

May import: fronts/, process/, engine/ and below; never compat/.
"""

from rollout.serve.app import build_app

__all__ = ["build_app"]
