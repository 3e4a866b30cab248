"""Attention backends behind one interface (`AttentionBackend`, `AttnBatch`, `ForwardContext`): torch,
Triton and FlashInfer, and the registry that names them.

May import: cache/, device/, layers/ and the top-level value modules. Never runner/ or above.
"""
