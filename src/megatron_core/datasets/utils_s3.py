"""Megatron-Core's older path for the S3 names of :mod:`megatron_core.datasets.object_storage_utils`
(``S3_PREFIX``, ``S3Client``), kept as there."""

from megatron_core.datasets.object_storage_utils import S3_PREFIX, S3Client

__all__ = ["S3_PREFIX", "S3Client"]
