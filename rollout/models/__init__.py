"""Model families (one file each), their config resolution, the registry, and the toy checkpoints used
by tests and demos.

May import: layers/, attention/ (the backend interface), lora/, device/ and the top-level value
modules. Never runner/ or anything above it.
"""
