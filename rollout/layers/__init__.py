"""The building blocks of models: linear layers (tensor-parallel), norms, rotary embeddings, embeddings
and fused kernels.

May import: the top-level value modules (distributed) and torch/triton only.
"""
