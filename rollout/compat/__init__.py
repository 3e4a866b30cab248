"""Fronts shaped like SGLang's and vLLM's Python APIs over the one engine (see docs/compat.md).

Each front translates names and shapes, then calls `rollout.Engine`; none has logic of its own.
"""
