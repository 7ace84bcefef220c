"""Rank-side checks of the gated delta net under tensor, sequence and context parallelism (module level so the rank
pool can import them).

:func:`check_hybrid_parallel` loads a single-process ``G*G-`` hybrid model (gated delta net, attention, gated delta
net, MLP) into a TP x CP (x SP) model and compares logits, per-token losses and every gradient (the sharding and
gradient-reduction helpers are the Mamba checks'). :func:`check_packed_cp` does the same for one layer on packed
documents split over CP; :func:`save_checkpoint` / :func:`load_checkpoint` move a model across TP sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.packed_sequences import thd_layout, thd_partitioned_indices
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from tests.ssm.mamba_cp_checks import compare_with_reference

PATTERN = "G*G-"
VOCAB, S, B = 64, 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def gdn_config(**overrides) -> TransformerConfig:
    """Hidden 32, 4 attention heads; gated delta nets of 4 key heads and 8 value heads of 8, fp32, no dropout."""
    cfg = dict(num_layers=len(PATTERN), hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
               normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
               use_cpu_initialization=True, layernorm_epsilon=1e-5, linear_conv_kernel_dim=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def build(**overrides) -> HybridModel:
    """The test's hybrid model (rotary positions, so the attention layer sees CP-sliced rotations)."""
    return HybridModel(gdn_config(**overrides), hybrid_stack_spec, VOCAB, S, hybrid_layer_pattern=PATTERN,
                       position_embedding_type="rope")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (B, S), generator=gen), torch.randint(0, VOCAB, (B, S), generator=gen)


def _reference() -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
    torch.manual_seed(1234)
    model = build()
    with torch.no_grad():  # non-trivial norms and biases, so their gradients and shards are checked too
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")):
                param.uniform_(0.5, 1.5)
    ids, labels = _data()
    positions = torch.arange(S).expand(B, S)
    logits = model(ids, positions, None).detach()
    loss = model(ids, positions, None, labels=labels)
    loss.sum().backward()
    return ({k: v.detach().clone() for k, v in model.named_parameters()}, logits, loss.detach(),
            {k: v.grad.detach().clone() for k, v in model.named_parameters()})


def check_hybrid_parallel(tp: int, cp: int, sp: bool) -> dict:
    """TP x CP (x SP) ``G*G-`` model == the single-process one: logits, per-token loss, every gradient."""
    reference = _reference()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        model, grads = compare_with_reference(build, _data(), reference, tp, cp, sp)
        gdn = [layer.self_attention for layer in model.decoder.layers
               if isinstance(getattr(layer, "self_attention", None), GatedDeltaNet)]
        return {"grads": len(grads), "gdn_layers": len(gdn), "value_heads_here": gdn[0].feat_dim_split[2]}
    finally:
        parallel_state.destroy_model_parallel()


def _layer(**overrides) -> GatedDeltaNet:
    submodules = GatedDeltaNetSubmodules(in_proj=tensor_parallel.ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=tensor_parallel.RowParallelLinear)
    return GatedDeltaNet(gdn_config(**overrides), submodules, layer_number=1)


def check_packed_cp(cp: int) -> int:
    """One layer on packed documents (``thd``) split per document over CP == the single-process layer: outputs,
    input gradient and parameter gradients (summed over CP)."""
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(5)
    x, upstream = torch.randn(total, 1, 32, generator=gen), torch.randn(total, 1, 32, generator=gen)
    torch.manual_seed(7)
    ref = _layer()
    x_ref = x.clone().requires_grad_(True)
    ref_out, _ = ref(x_ref, None, packed_seq_params=packed)
    (ref_out * upstream).sum().backward()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    try:
        layer = _layer(context_parallel_size=cp)
        layer.load_state_dict(ref.state_dict())
        index = thd_partitioned_indices(thd_layout(packed, total), cp, parallel_state.get_context_parallel_rank())
        x_here = x[index].clone().requires_grad_(True)
        out, _ = layer(x_here, None, packed_seq_params=packed)
        torch.testing.assert_close(out, ref_out.detach()[index], **TOL)
        (out * upstream[index]).sum().backward()
        torch.testing.assert_close(x_here.grad, x_ref.grad[index], **TOL)
        for (name, param), ref_param in zip(layer.named_parameters(), ref.parameters()):
            grad = param.grad.clone()
            dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
            torch.testing.assert_close(grad, ref_param.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        return parallel_state.get_context_parallel_rank()
    finally:
        parallel_state.destroy_model_parallel()


def _logits(model: HybridModel) -> torch.Tensor:
    ids, _ = _data()
    with torch.no_grad():
        return model(ids, torch.arange(S).expand(B, S), None, runtime_gather_output=True).detach().clone()


def save_checkpoint(ckpt: str, tp: int) -> torch.Tensor:
    """Save a TP-sharded ``G*G-`` model (distributed checkpoint); returns its logits."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(11)
        torch.manual_seed(11)
        model = build(tensor_model_parallel_size=tp)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("norm.weight", "dt_bias")):
                    param.add_(0.1 * torch.arange(param.numel(), dtype=param.dtype).reshape(param.shape))
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        return _logits(model)
    finally:
        parallel_state.destroy_model_parallel()


def load_checkpoint(ckpt: str, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the checkpoint into a freshly seeded model at this TP size: its logits before and after."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(99)
        torch.manual_seed(99)
        model = build(tensor_model_parallel_size=tp)
        before = _logits(model)
        sharded = model.sharded_state_dict()
        model.load_state_dict(dist_checkpointing.load(sharded, ckpt, strict="raise_all"))
        return before, _logits(model)
    finally:
        parallel_state.destroy_model_parallel()


def check_bad_parallel_config(tp: int, cp: int) -> str:
    """The message of the ``ValueError`` for 4 key heads over TP x CP = 8 ranks."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        try:
            _layer(linear_num_value_heads=8, tensor_model_parallel_size=tp, context_parallel_size=cp)
        except ValueError as error:
            return str(error)
        return ""
    finally:
        parallel_state.destroy_model_parallel()
