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
__shortversion__ = f"{MAJOR}.{MINOR}.{PATCH}"
"""The version without its pre-release tag."""
__contact_names__ = "megatron-core-lite maintainers"
__contact_emails__ = ""
__homepage__ = ""
__repository_url__ = ""
"""No contact address, home page or public repository is published yet: these stay empty until one is."""
__download_url__ = f"https://pypi.org/project/{__package_name__}/"
"""The package index page of the distribution name."""
__keywords__ = "deep learning, machine learning, gpu, cpu, NLP, transformer, pytorch, torch, language modeling"
