"""Version and package metadata for megatron_core (semantic versioning)."""

MAJOR = 0
MINOR = 1
PATCH = 0
PRE_RELEASE = ""

VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
"""``(major, minor, patch, pre_release)``, as Megatron-Core's ``package_info.VERSION``."""

__version__ = f"{MAJOR}.{MINOR}.{PATCH}.{PRE_RELEASE}" if PRE_RELEASE else f"{MAJOR}.{MINOR}.{PATCH}"
__package_name__ = "megatron-core-lite"
"""The distribution name on the package index (the import name is ``megatron_core``)."""
__description__ = "Megatron-Core's building blocks, installable with pip and runnable on CPU."
__license__ = "Apache-2.0"
