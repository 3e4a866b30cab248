"""Host-to-device plumbing shared by the runner and the attention backends: the pinned staging ring
and packed uploads.

May import: torch and numpy only.
"""
