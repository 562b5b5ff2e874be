"""The profiler: what the tape saved, how many bytes were alive when, and what it cost."""

from .memory import rss_bytes
from .recorder import profile
from .records import Profile, ProfileFormatError, SavedRecord

__all__ = ["Profile", "ProfileFormatError", "SavedRecord", "profile", "rss_bytes"]
