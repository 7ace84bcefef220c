"""Write small ``torch_dist`` reference checkpoints with NVIDIA's megatron-core, or load ours into it.

Test-data generation for the checkpoint-interoperability tests (tests/dist_checkpointing/
test_mcore_interop.py); it needs megatron-core (``pip install -e ".[test-oracle]"``), never our
library's runtime. For each variant (``gpt2``: LayerNorm, GELU, biases, learned positions, tied
embeddings; ``llama``: RMSNorm, SwiGLU, RoPE, GQA, no biases, untied) and each TP size it builds a
2-layer fp32 GPT with the local layer spec and ``use_cpu_initialization``, saves
``<out>/<variant>_tp<N>/`` with ``dist_checkpointing.save`` and writes the full-vocabulary logits of
a fixed input to ``<out>/<variant>_tp<N>_logits.pt``; ``<out>/manifest.json`` describes everything
so a test can rebuild the same model.

Reverse direction (``--verify DIR``): build megatron-core's model for the manifest entry of a
checkpoint written by megatron_core (``DIR/manifest.json`` in the same format), load it and compare
its logits with the ones saved beside it; exits non-zero on a mismatch.

On a machine without a GPU, the few CUDA-only calls megatron-core 0.16.1 makes on this path
(``torch.cuda.synchronize`` in the save's tensor preloading, ``torch.cuda.current_device`` in the
attention's memory buffer, the CUDA RNG tracker around dropout)
are neutralised inside this tool's processes only.

Usage::

    python tools/make_mcore_reference_checkpoints.py --out tests/data/mcore_reference
    python tools/make_mcore_reference_checkpoints.py --verify /tmp/ours   # ours -> megatron-core
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.multiprocessing as mp

SEED = 1234
VOCAB, SEQ, BATCH, MAX_SEQ = 64, 8, 2, 16
TP_SIZES = (1, 2)

VARIANTS = {
    "gpt2": {
        "config": dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                       hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                       activation="gelu"),
        "model": dict(share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute"),
    },
    "llama": {
        "config": dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
                       normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                       hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                       activation="silu"),
        "model": dict(share_embeddings_and_output_weights=False, position_embedding_type="rope"),
    },
}
"""Model descriptions; ``activation`` names ``torch.nn.functional.<name>``."""


def config_kwargs(description: dict) -> dict:
    """TransformerConfig keyword arguments for a variant's ``config`` entry."""
    kwargs = dict(description)
    kwargs["activation_func"] = getattr(torch.nn.functional, kwargs.pop("activation"))
    return kwargs


def fixed_input() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, position_ids, attention_mask)`` of the reference forward (mask True = masked out)."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return tokens, positions, mask


def _neutralise_cuda_only_calls() -> None:
    """Without a GPU, make megatron-core's CUDA-only calls on this path no-ops (this process only)."""
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's GlobalMemoryBuffer allocates there
    from megatron.core.tensor_parallel import random as mcore_random

    class _NoCudaTracker(mcore_random.CudaRNGStatesTracker):
        @contextlib.contextmanager
        def fork(self, name=None):  # dropout is 0 in every variant; there is no CUDA state to fork
            yield

    mcore_random._CUDA_RNG_STATE_TRACKER = _NoCudaTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _build_mcore_model(variant: dict, tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(SEED)
    config = TransformerConfig(**config_kwargs(variant["config"]), tensor_model_parallel_size=tp)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, **variant["model"])
    return model.eval()


def _full_logits(model) -> torch.Tensor:
    """Logits of the fixed input, gathered over the TP group to the full vocabulary ``[b, s, v]``."""
    from megatron.core import parallel_state

    tokens, positions, mask = fixed_input()
    with torch.no_grad():
        local = model(tokens, positions, mask)
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def _worker(rank: int, world: int, init_file: str, task: str, out: str, names: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    _neutralise_cuda_only_calls()
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(world, 1)
    failures = []
    try:
        for name in names:
            variant = VARIANTS[name.split("_tp")[0]]
            model = _build_mcore_model(variant, world)
            directory = os.path.join(out, name)
            if task == "make":
                logits = _full_logits(model)
                os.makedirs(directory, exist_ok=True)
                dist_checkpointing.save(model.sharded_state_dict(), directory)
                if rank == 0:
                    torch.save(logits, os.path.join(out, f"{name}_logits.pt"))
            else:
                state = dist_checkpointing.load(model.sharded_state_dict(), directory)
                model.load_state_dict(state)
                expected = torch.load(os.path.join(out, f"{name}_logits.pt"))
                error = (_full_logits(model) - expected).abs().max().item()
                if rank == 0:
                    print(f"{name}: megatron-core loaded megatron_core's checkpoint; max |logit diff| = {error:.2e}")
                if not error < 1e-5:
                    failures.append(name)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    if failures:
        raise SystemExit(f"logits differ for {failures}")


def _run(task: str, out: str, entries: dict[str, dict]) -> None:
    for tp in sorted({entry["tp"] for entry in entries.values()}):
        names = [name for name, entry in entries.items() if entry["tp"] == tp]
        with tempfile.TemporaryDirectory() as scratch:
            args = (tp, os.path.join(scratch, "rendezvous"), task, out, names)
            if tp == 1:  # one rank runs here: a spawned process would import torch and megatron-core once more
                _worker(0, *args)
            else:
                mp.start_processes(_worker, args=args, nprocs=tp, join=True, start_method="spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/data/mcore_reference", help="output folder (make mode)")
    parser.add_argument("--verify", metavar="DIR", help="load the checkpoints in DIR (written by ours) into megatron-core")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.verify:
        with open(os.path.join(args.verify, "manifest.json"), encoding="utf-8") as stream:
            manifest = json.load(stream)
        _run("verify", args.verify, manifest["checkpoints"])
        return
    entries = {
        f"{variant}_tp{tp}": {"variant": variant, "tp": tp, "logits": f"{variant}_tp{tp}_logits.pt"}
        for variant in VARIANTS for tp in TP_SIZES
    }
    os.makedirs(args.out, exist_ok=True)
    _run("make", args.out, entries)
    import megatron.core

    manifest = {
        "writer": f"megatron-core {megatron.core.__version__}",
        "torch": torch.__version__,
        "seed": SEED, "vocab_size": VOCAB, "max_sequence_length": MAX_SEQ,
        "input": {"batch": BATCH, "sequence_length": SEQ, "token_seed": 7},
        "variants": VARIANTS,
        "checkpoints": entries,
    }
    with open(os.path.join(args.out, "manifest.json"), "w", encoding="utf-8") as stream:
        json.dump(manifest, stream, indent=2)
    print(f"wrote {len(entries)} checkpoints to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
