"""Benchmarks of checkpoint-ad against the hand-written numpy floor and its peers.

Run every benchmark with ``python -m bench`` (``--quick`` for small sizes, ``--only NAME`` for
one); see bench/README.md for what each column measures.
"""
