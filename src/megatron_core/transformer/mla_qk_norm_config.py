"""Which Q / KV latent norms and up projections an MLA or DSA layer builds (Megatron-Core 0.19's
``megatron.core.transformer.mla_qk_norm_config``).

A latent norm is either a module of its own (``q_layernorm`` / ``kv_layernorm``) or fused into the up projection
that follows it (a backend's norm + column-parallel linear, Transformer Engine's
``TELayerNormColumnParallelLinear``). :class:`QKNormConfigResolver` checks a spec against Megatron-Core's rules and
returns the classes to build:

* ``qk_l2_norm`` is refused for MLA and DSA;
* a Q norm is only used with a query latent (``q_lora_rank``); a non-trivial one without it is refused;
* a norm set explicitly cannot sit in front of a fused norm + linear projection (it would normalise twice);
* with ``qk_layernorm`` off, neither explicit norms nor fused projections are allowed;
* with ``qk_layernorm`` on, MLA fuses each norm left unset into its up projection (the backend's fused class;
  ``RuntimeError`` where the backend has none, as the local one), and keeps an explicit norm with a plain linear;
  DSA needs a query latent, plain linears and standalone norms (the backend's Q/K norm where unset), because its
  indexer reads the normed latents.

This library's :class:`~megatron_core.transformer.multi_latent_attention.MLASelfAttention` and
``AbsorbedMLASelfAttention`` do not build through the resolver: they accept the local specs' standalone norms
with ``q_lora_rank=None`` (the Q norm is then unused and not built), which the resolver refuses, and which the
DeepSeek-V2-Lite bridge and existing checkpoints rely on (docs/compat.md).
"""

from __future__ import annotations

from typing import Any, NoReturn

from megatron_core.transformer.backends import BackendSpecProvider, LocalSpecProvider, te_spec_provider
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.spec_utils import ModuleSpec

__all__ = ["QKNormConfigResolver"]

_NORM_DISABLED = "qk_layernorm/qk_l2_norm are supposed to be disabled"


def _default_backend(transformer_impl: str) -> BackendSpecProvider:
    """The spec provider of ``transformer_impl`` (``inference_optimized`` has the local layers' norms and linears)."""
    if transformer_impl == "transformer_engine":
        return te_spec_provider()
    return LocalSpecProvider()


class QKNormConfigResolver:
    """Check MLA's / DSA's Q and KV norm placement in ``submodules`` (``MLASelfAttentionSubmodules``) for ``config``
    and resolve the classes to build (:meth:`resolve`).

    ``backend`` (an addition to Megatron-Core's signature) supplies the default linear, the fused norm + linear and
    the Q/K norm; by default the provider of ``config.transformer_impl``.
    """

    def __init__(self, config: Any, submodules: Any, backend: BackendSpecProvider | None = None) -> None:
        self.config = config
        self.submodules = submodules
        self.has_q_lora = config.q_lora_rank is not None
        self.is_dsa = getattr(config, "experimental_attention_variant", None) == "dsa"
        self.variant_str = "DSA" if self.is_dsa else "MLA"
        backend = backend if backend is not None else _default_backend(getattr(config, "transformer_impl", "local"))
        self.qk_norm_impl = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=True)
        self.linear_impl = backend.column_parallel_linear()
        self.fused_norm_linear_impl = backend.column_parallel_layer_norm_linear()

    def resolve(self) -> dict[str, Any]:
        """``{linear_q_proj, linear_q_up_proj, linear_kv_up_proj, q_layernorm, kv_layernorm}`` to build
        (``IdentityOp`` where nothing is built); ``ValueError`` naming the slots for a conflicting spec,
        ``RuntimeError`` when a fused projection is needed and the backend has none."""
        if getattr(self.config, "qk_l2_norm", False):
            raise ValueError(f"qk_l2_norm is not supported with {self.variant_str}.")
        self._reject_common_conflicts()
        if not self.config.qk_layernorm:
            return self._without_norms()
        return self._dsa_norms() if self.is_dsa else self._mla_norms()

    def _without_norms(self) -> dict[str, Any]:
        subs = self.submodules
        q_proj = q_up_proj = IdentityOp
        if self.has_q_lora:
            self._reject_norm_when_disabled(subs.linear_q_up_proj, subs.q_layernorm, "linear_q_up_proj",
                                            "q_layernorm")
            q_up_proj = subs.linear_q_up_proj or self.linear_impl
        else:
            if self._is_fused(subs.linear_q_proj):
                raise ValueError(f"spec sets linear_q_proj={subs.linear_q_proj}, but {_NORM_DISABLED}")
            q_proj = subs.linear_q_proj or self.linear_impl
        self._reject_norm_when_disabled(subs.linear_kv_up_proj, subs.kv_layernorm, "linear_kv_up_proj",
                                        "kv_layernorm")
        return self._result(q_proj, q_up_proj, subs.linear_kv_up_proj or self.linear_impl, IdentityOp, IdentityOp)

    def _dsa_norms(self) -> dict[str, Any]:
        subs = self.submodules
        if not self.has_q_lora:
            raise ValueError("`qk_layernorm=True` with `q_lora_rank is None` is not supported for DSA because DSA "
                             "cannot fuse Q norm into `linear_q_proj`.")
        return self._result(
            IdentityOp,
            self._plain_linear(subs.linear_q_up_proj, "linear_q_up_proj", "which is not supported for DSA"),
            self._plain_linear(subs.linear_kv_up_proj, "linear_kv_up_proj", "which is not supported for DSA"),
            self.qk_norm_impl if self._is_trivial(subs.q_layernorm) else subs.q_layernorm,
            self.qk_norm_impl if self._is_trivial(subs.kv_layernorm) else subs.kv_layernorm,
        )

    def _mla_norms(self) -> dict[str, Any]:
        subs = self.submodules
        q_norm = subs.q_layernorm or IdentityOp
        kv_norm = subs.kv_layernorm or IdentityOp
        q_proj = q_up_proj = IdentityOp
        if not self.has_q_lora:
            q_proj = self._fused_linear(subs.linear_q_proj, "linear_q_proj")
        elif self._is_trivial(q_norm):
            q_up_proj = self._fused_linear(subs.linear_q_up_proj, "linear_q_up_proj")
        else:
            q_up_proj = self._plain_linear(subs.linear_q_up_proj, "linear_q_up_proj", "but a non-fused linear is "
                                           "required")
        if self._is_trivial(kv_norm):
            kv_up_proj = self._fused_linear(subs.linear_kv_up_proj, "linear_kv_up_proj")
        else:
            kv_up_proj = self._plain_linear(subs.linear_kv_up_proj, "linear_kv_up_proj", "but a non-fused linear "
                                            "is required")
        return self._result(q_proj, q_up_proj, kv_up_proj, q_norm, kv_norm)

    def _reject_common_conflicts(self) -> None:
        subs = self.submodules
        if not self.has_q_lora and not self._is_trivial(subs.q_layernorm):
            self._raise_unused_q_norm()
        if self.has_q_lora:
            self._reject_norm_before_fused(subs.linear_q_up_proj, subs.q_layernorm, "linear_q_up_proj",
                                           "q_layernorm")
        self._reject_norm_before_fused(subs.linear_kv_up_proj, subs.kv_layernorm, "linear_kv_up_proj",
                                       "kv_layernorm")

    def _reject_norm_when_disabled(self, proj: Any, norm: Any, proj_name: str, norm_name: str) -> None:
        if self._is_fused(proj) or not self._is_trivial(norm):
            raise ValueError(f"spec sets {proj_name}={proj} and {norm_name}={norm}, but {_NORM_DISABLED}")

    def _reject_norm_before_fused(self, proj: Any, norm: Any, proj_name: str, norm_name: str) -> None:
        if not self._is_trivial(norm) and self._is_fused(proj):
            raise ValueError(f"`{norm_name}={norm}` is non-trivial and `{proj_name}={proj}` is a fused norm+linear; "
                             f"either unset `{norm_name}` or use a linear layer without norm fusion for "
                             f"`{proj_name}`")

    def _plain_linear(self, proj: Any, proj_name: str, why: str) -> Any:
        """The spec's projection (or the backend's linear), which must not fuse a norm."""
        linear = self._require(proj or self.linear_impl, proj_name)
        if self._is_fused(linear):
            raise ValueError(f"`{proj_name}={proj}` is fused norm+linear, {why}")
        return linear

    def _fused_linear(self, proj: Any, proj_name: str) -> Any:
        """The spec's fused projection, else the backend's fused class."""
        if self._is_fused(proj):
            return proj
        return self._require(self.fused_norm_linear_impl, proj_name)

    @staticmethod
    def _require(proj: Any, proj_name: str) -> Any:
        if proj is None:
            raise RuntimeError(f"qk_layernorm requires TransformerEngine or q_layernorm/kv_layernorm to be set in "
                               f"the spec to build `{proj_name}`.")
        return proj

    def _raise_unused_q_norm(self) -> NoReturn:
        subs = self.submodules
        hint = ("" if self._is_fused(subs.linear_q_proj) else
                f" Please use a fused norm+linear for `linear_q_proj={subs.linear_q_proj}` if you intend to have a "
                "Q-norm.")
        raise ValueError(f"`q_layernorm={subs.q_layernorm}` is non-trivial, but `q_lora_rank is None`, meaning it "
                         f"will not be used.{hint}")

    def _is_fused(self, spec: Any) -> bool:
        """Whether ``spec`` builds the backend's fused norm + linear class."""
        module = spec.module if isinstance(spec, ModuleSpec) else spec
        return self.fused_norm_linear_impl is not None and module is self.fused_norm_linear_impl

    @staticmethod
    def _is_trivial(spec: Any) -> bool:
        """Whether a norm slot is unset or ``IdentityOp``."""
        return spec is None or spec is IdentityOp

    @staticmethod
    def _result(linear_q_proj: Any, linear_q_up_proj: Any, linear_kv_up_proj: Any, q_layernorm: Any,
                kv_layernorm: Any) -> dict[str, Any]:
        return {"linear_q_proj": linear_q_proj, "linear_q_up_proj": linear_q_up_proj,
                "linear_kv_up_proj": linear_kv_up_proj, "q_layernorm": q_layernorm, "kv_layernorm": kv_layernorm}
