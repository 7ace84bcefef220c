"""Where a bf16 training step stops being reproducible: initialisation, forward or backward.

Builds the same bf16 GPT (4 layers of the 1.1B reference shape, DDP with fp32 gradient buffers and
the distributed optimizer's layout) twice from the same seeds, runs forward and backward twice on
each build with the same batch, and reports which parameters or gradients differ from the first
pass (relative difference of each gradient's norm). On a GPU, two identical
``examples/pretrain_gpt.py --bf16`` runs gave different step-1 gradient norms (25.42 against 26.18,
session 7); this probe narrows that down without the training loop::

    PYTHONPATH=src python tools/bf16_determinism_probe.py            # the GPU (NCCL, one rank)
    PYTHONPATH=src python tools/bf16_determinism_probe.py --tiny     # a CPU run of the same path
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig


def build(args: argparse.Namespace, device: torch.device) -> DistributedDataParallel:
    """The model from fixed seeds, wrapped in DDP as ``pretrain_gpt.py --bf16 --use-distributed-optimizer`` does."""
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, num_query_groups=4,
        ffn_hidden_size=args.ffn, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        init_method_std=0.02, use_cpu_initialization=device.type == "cpu")
    model = GPTModel(config, get_gpt_layer_local_spec(), args.vocab, args.seq, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).to(device)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    return DistributedDataParallel(config, ddp_config, model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (gloo)")
    args = parser.parse_args()
    shape = dict(layers=2, hidden=64, heads=8, ffn=128, vocab=256, seq=32) if args.tiny else dict(
        layers=4, hidden=2048, heads=32, ffn=5632, vocab=32000, seq=2048)
    vars(args).update(shape)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=gen).to(device)
    labels = torch.randint(0, args.vocab, (2, args.seq), generator=gen).to(device)
    positions = torch.arange(args.seq, device=device).expand(2, -1)
    passes = []
    for build_index in range(2):
        model = build(args, device)
        checksums = {n: p.double().sum().item() for n, p in model.named_parameters()}
        for repeat in range(2):
            model.zero_grad_buffer()
            loss = model(ids, positions, None, labels=labels).float().mean()
            loss.backward()
            model.finish_grad_sync()
            norms = {n: p.main_grad.double().norm().item() for n, p in model.named_parameters()}
            passes.append((build_index, repeat, loss.item(), checksums, norms))
        del model
    _, _, loss0, checksums0, norms0 = passes[0]
    for build_index, repeat, loss, checksums, norms in passes[1:]:
        params = [n for n in checksums if checksums[n] != checksums0[n]]
        grads = sorted(((n, norms[n] / norms0[n] - 1) for n in norms if norms[n] != norms0[n]), key=lambda x: -abs(x[1]))
        print(f"build {build_index} pass {repeat}: loss {loss!r} (first {loss0!r}); {len(params)} parameters differ "
              f"{params[:3]}; {len(grads)} gradients differ")
        for name, rel in grads[:6]:
            print(f"    {name}: gradient norm {rel:+.3e} relative")
    print("total gradient norms:", [round(sum(v * v for v in p[4].values()) ** 0.5, 6) for p in passes])
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
