"""Where a stored value lives: `Offload` to host memory or disk, the disk level's files and I/O
threads, pinned host memory for GPU arrays.
"""
