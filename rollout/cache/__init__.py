"""The paged KV cache: the pool of pages on the device and the host-side page manager (prefix cache).

May import: the top-level value modules only.
"""
