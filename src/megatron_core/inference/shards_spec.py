"""The layout of a multi-shard inference job (Megatron-Core 0.19's ``inference.shards_spec``).

A job may serve one model as several inference *shards*, each a contiguous window of ranks at its own
parallelism, for example a prefill shard at TP=4 next to a decode shard at TP=2 (prefill/decode
disaggregation: the prefill shard hands each request's KV cache and Mamba states to the decode shard,
:mod:`megatron_core.inference.disaggregation`). The layout is written as a string, shards separated by ``;``
or ``+`` (``+`` needs no quoting in a shell) and each shard a comma-separated list of ``key=value``::

    "tp=4,role=prefill+tp=2,dp=2,role=decode"

Keys are :data:`VALID_KEYS` (``expt_tp`` defaults to the shard's ``tp``, every other size to 1; ``role`` is
``prefill`` or ``decode``). Shards take ranks left to right and must use every rank of the job exactly.
Unlike Megatron-Core, which raises ``AssertionError`` for syntax errors and a rank total that does not match,
every refusal here is a ``ValueError`` naming the key, the value and the rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["InferenceShardSpec", "VALID_INT_KEYS", "VALID_KEYS", "VALID_ROLES", "normalize_shard_specs",
           "parse_inference_shards_spec", "spec_declares_disaggregation"]

VALID_INT_KEYS = ("tp", "pp", "ep", "expt_tp", "dp", "cp")
"""The integer keys of a shard: its parallel sizes."""
VALID_ROLES = ("prefill", "decode")
"""The values of a shard's ``role`` key (prefill/decode disaggregation)."""
VALID_KEYS = (*VALID_INT_KEYS, "role")
"""Every key a shard may set."""


@dataclass(frozen=True)
class InferenceShardSpec:
    """One shard's parallel sizes and optional disaggregation role.

    ``expt_tp`` left ``None`` becomes ``tp``. The shard occupies ``tp * pp * dp`` ranks, which the expert layout
    ``expt_tp * ep * pp`` must divide. Context parallelism is not supported (``cp`` must be 1): the KV reshard
    between shards moves layers and heads, not sequence chunks. Violations raise ``ValueError``.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    cp: int = 1
    expt_tp: int | None = None
    role: str | None = None

    def __post_init__(self) -> None:
        for key in VALID_INT_KEYS:
            value = getattr(self, key)
            if key == "expt_tp" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"InferenceShardSpec: {key}={value!r} must be a positive integer")
        if self.role is not None and self.role not in VALID_ROLES:
            raise ValueError(f"InferenceShardSpec: role={self.role!r} must be one of {', '.join(VALID_ROLES)} or None")
        if self.cp != 1:
            raise ValueError(f"InferenceShardSpec: cp={self.cp} must be 1: inference shards do not support context "
                             "parallelism (the KV reshard between shards moves layers and heads, not sequence chunks)")
        if self.expt_tp is None:
            object.__setattr__(self, "expt_tp", self.tp)
        expert_ranks = self.expt_tp * self.ep * self.pp
        if self.world_size % expert_ranks:
            raise ValueError(f"InferenceShardSpec: expt_tp={self.expt_tp} x ep={self.ep} x pp={self.pp} = "
                             f"{expert_ranks} must divide the shard's tp={self.tp} x pp={self.pp} x dp={self.dp} = "
                             f"{self.world_size} ranks")

    @property
    def world_size(self) -> int:
        """Ranks of the shard: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    def to_dict(self) -> dict:
        """The shard as a plain dict (``tp``, ``pp``, ``ep``, ``dp``, ``expt_tp``, and ``role`` when set)."""
        out: dict = {"tp": self.tp, "pp": self.pp, "ep": self.ep, "dp": self.dp, "expt_tp": self.expt_tp}
        if self.role is not None:
            out["role"] = self.role
        return out


def _split_shards(spec_str: str) -> list[str]:
    """The non-empty shard strings of a layout string (``+`` and ``;`` both separate shards)."""
    return [part.strip() for part in spec_str.replace("+", ";").split(";") if part.strip()]


def spec_declares_disaggregation(spec_str: str | None) -> bool:
    """Whether any shard of the layout string sets a ``role`` (a prefill/decode hand-off, not plain
    multi-shard serving). Reads the keys only: no validation and no world size needed."""
    if not spec_str:
        return False
    return any(item.split("=", 1)[0].strip() == "role"
               for shard in _split_shards(spec_str) for item in shard.split(","))


def _parse_value(key: str, value: str, shard: str) -> int | str:
    """One ``key=value`` of ``shard``: an integer size or a lower-cased role."""
    if key == "role":
        role = value.lower()
        if role not in VALID_ROLES:
            raise ValueError(f"inference shards spec: role={value!r} in shard {shard!r} must be one of "
                             f"{', '.join(VALID_ROLES)}")
        return role
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"inference shards spec: {key}={value!r} in shard {shard!r} must be an integer") from None


def _parse_shard(shard: str) -> InferenceShardSpec:
    """One shard string, ``"tp=2,dp=1,role=decode"``."""
    kwargs: dict[str, int | str] = {}
    for item in (part.strip() for part in shard.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"inference shards spec: entry {item!r} in shard {shard!r} must be key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in VALID_KEYS:
            raise ValueError(f"inference shards spec: key {key!r} in shard {shard!r} is not one of "
                             f"{', '.join(VALID_KEYS)}")
        if key in kwargs:
            raise ValueError(f"inference shards spec: key {key!r} is set twice in shard {shard!r}")
        kwargs[key] = _parse_value(key, value, shard)
    return InferenceShardSpec(**kwargs)


def _check_partition(specs: list[InferenceShardSpec], world_size: int) -> list[InferenceShardSpec]:
    """``specs`` when their ranks add up to ``world_size`` (no idle ranks), else ``ValueError``."""
    if not specs:
        raise ValueError("inference shards spec: no shard given; at least one is needed")
    total = sum(spec.world_size for spec in specs)
    if total != world_size:
        sizes = " + ".join(str(spec.world_size) for spec in specs) + (f" = {total}" if len(specs) > 1 else "")
        raise ValueError(f"inference shards spec: the shards use {sizes} ranks but world_size is "
                         f"{world_size}; the shards must use every rank exactly once")
    return specs


def parse_inference_shards_spec(spec_str: str, world_size: int) -> list[InferenceShardSpec]:
    """The shards of a layout string (``"tp=2,role=prefill+tp=1,dp=2,role=decode"``), in rank order.

    ``ValueError`` for an entry without ``=``, an unknown or repeated key, a size that is not a positive
    integer, an unknown role, a shard that violates :class:`InferenceShardSpec`'s rules, or shards whose
    ranks do not add up to ``world_size``.
    """
    return _check_partition([_parse_shard(shard) for shard in _split_shards(spec_str)], world_size)


def normalize_shard_specs(shards: str | Sequence[InferenceShardSpec | Mapping], world_size: int
                          ) -> list[InferenceShardSpec]:
    """A layout given as a string, a list of :class:`InferenceShardSpec` or a list of dicts of their fields, as
    validated :class:`InferenceShardSpec` s that use every one of ``world_size`` ranks (``ValueError`` otherwise)."""
    if isinstance(shards, str):
        return parse_inference_shards_spec(shards, world_size)
    specs = []
    for index, shard in enumerate(shards):
        if isinstance(shard, InferenceShardSpec):
            specs.append(shard)
            continue
        if not isinstance(shard, Mapping):
            raise ValueError(f"normalize_shard_specs: shard {index} is a {type(shard).__name__}; expected an "
                             "InferenceShardSpec or a dict of its fields")
        unknown = sorted(set(shard) - set(VALID_KEYS))
        if unknown:
            raise ValueError(f"normalize_shard_specs: shard {index} has unknown keys {unknown}; allowed: "
                             f"{', '.join(VALID_KEYS)}")
        specs.append(InferenceShardSpec(**dict(shard)))
    return _check_partition(specs, world_size)
