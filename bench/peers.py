"""The optional peers (PyTorch, JAX, HIPS autograd): whether each is installed, and why not.

A missing peer is skipped with a note, never a failure: ``pip install -e .[bench]`` installs
them all.
"""

from __future__ import annotations

import importlib.util

PEERS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "jax": ("jax", "jaxlib"),
    "autograd": ("autograd",),
}


class PeerMissing(ImportError):
    """A benchmark column needs a peer that is not installed."""


def missing(peer: str | None) -> str | None:
    """Why the columns of `peer` cannot run here, or None if they can (or need no peer)."""
    if peer is None:
        return None
    absent = [m for m in PEERS[peer] if importlib.util.find_spec(m) is None]
    if absent:
        return f"skipped: {', '.join(absent)} not installed (pip install -e .[bench])"
    return None


def require(peer: str) -> None:
    """Raise PeerMissing with the skip note if `peer` is not installed."""
    reason = missing(peer)
    if reason is not None:
        raise PeerMissing(reason)
