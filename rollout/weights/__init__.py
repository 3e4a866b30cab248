"""The model's weights: loading checkpoints, all-or-nothing updates (targets, plans), buckets,
broadcast groups and checksums.

May import: models/, layers/, and the top-level value modules (distributed). Never runner/ or above.
"""
