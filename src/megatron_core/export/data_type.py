"""Weight data types an exporter can write (Megatron-Core's ``export.data_type.DataType``)."""

from __future__ import annotations

from enum import Enum


class DataType(Enum):
    """Target data type of exported weights; values 1..3 as in Megatron-Core."""

    bfloat16 = 1
    float16 = 2
    float32 = 3
