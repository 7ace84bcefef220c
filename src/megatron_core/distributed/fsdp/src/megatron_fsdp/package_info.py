"""Package metadata of the standalone Megatron-FSDP API (0.19's ``megatron_fsdp.package_info``).

The version numbers are this library's own for the ``fully_shard`` API over PyTorch FSDP2, not those of
NVIDIA's ``megatron_fsdp`` package (0.6.0rc1 in Megatron-Core 0.19).
"""

MAJOR = 0
MINOR = 1
PATCH = 0
PRE_RELEASE = ""

VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)

__shortversion__ = ".".join(map(str, VERSION[:3]))
__version__ = ".".join(map(str, VERSION[:3])) + "".join(VERSION[3:])

__package_name__ = "megatron_fsdp"
__contact_names__ = "megatron-core-lite maintainers"
__contact_emails__ = ""
__homepage__ = "https://github.com/NVIDIA/Megatron-LM/tree/main/megatron/core/distributed/fsdp"
__repository_url__ = "https://github.com/NVIDIA/Megatron-LM/tree/main/megatron/core"
__download_url__ = "https://pypi.org/project/megatron-core-lite/"
__description__ = "Megatron-FSDP's fully_shard API for any torch.nn.Module, on PyTorch FSDP2"
__license__ = "Apache-2.0"
__keywords__ = "deep learning, fsdp, data parallel, sharding, pytorch, torch"
