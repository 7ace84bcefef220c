"""``megatron-convert`` on a DeepSeek-V3 that mixes dense and MoE layers and holds a multi-token-prediction depth.

The oracle is the in-process bridge (``AutoBridge.to_megatron_model``). The converted checkpoint holds exactly
the chunks (keys, global shapes, offsets) and objects of GPTModel's sharded state dict: per-layer keys
``decoder.layers.<i>.`` for the mixed layers and ``mtp.layers.0.`` for the MTP depth. Loaded in one process, every
tensor equals the oracle's; loaded by ``load_checkpoint`` at TP=2, PP=2 and EP=2 on two gloo ranks, the logits and
the MTP depth's hidden states equal the one-process model's. Exports (of the converter's checkpoint and of the
PP=2 run's re-save) give back the original HF files bitwise, MTP layer and its embedding / head copies included;
transformers' own files (``num_nextn_predict_layers`` without MTP tensors) round-trip without MTP; the CLI works.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_on_ranks
from tests.models.hf.hf_models import assert_same_tensors, perturb, safetensors_tensors

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron_core.dist_checkpointing import apply_factories, load_sharded_metadata  # noqa: E402
from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron_core.dist_checkpointing.serialization import COMMON_STATE_KEY  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402
from megatron_core.models.hf.cli import main  # noqa: E402
from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore  # noqa: E402
from megatron_core.training import load_checkpoint, save_checkpoint  # noqa: E402

VOCAB, SEQ, BATCH, LAYERS, HIDDEN = 96, 10, 2, 4, 32


def _hf_config(**overrides) -> transformers.DeepseekV3Config:
    """Tiny DeepSeek-V3: layer 0 dense, layers 1-3 MoE (4 experts, group-limited top-2, shared experts)."""
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
                norm_topk_prob=True, max_position_embeddings=32, tie_word_embeddings=False)
    return transformers.DeepseekV3Config(**{**base, **overrides})


def _save_random(path: str, seed: int, **overrides) -> None:
    """``save_pretrained`` a perturbed random DeepSeek-V3 (score correction biases too)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(**overrides))
    perturb(model, seed + 7)
    model.save_pretrained(path)


def _make_with_mtp(path: str, seed: int = 0, **overrides) -> None:
    """A DeepSeek-V3 directory with one MTP depth as DeepSeek's checkpoints store it (``model.layers.<LAYERS>.*``: a
    MoE decoder layer, ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm``, and the embedding / head copies);
    transformers does not instantiate MTP layers, so the depth is the last layer of a model one layer deeper."""
    from safetensors.torch import save_file

    _save_random(path, seed, num_hidden_layers=LAYERS + 1, num_nextn_predict_layers=1, **overrides)
    tensors = safetensors_tensors(path)
    p = f"model.layers.{LAYERS}."
    gen = torch.Generator().manual_seed(seed + 1)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{p}{norm}.weight"] = 1 + 0.3 * torch.randn(HIDDEN, generator=gen)
    tensors[p + "eh_proj.weight"] = 0.2 * torch.randn(HIDDEN, 2 * HIDDEN, generator=gen)
    tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "num_hidden_layers": LAYERS}, f)


def _convert(tmp_path_factory, name: str, make, **kwargs) -> tuple[str, str]:
    """``(HF directory written by make(dir, **kwargs), its megatron-convert checkpoint)``."""
    root = tmp_path_factory.mktemp(name)
    src, ckpt = str(root / "hf"), str(root / "ckpt")
    make(src, **kwargs)
    import_hf_to_mcore(src, ckpt, progress=False)
    return src, ckpt


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[str, str]:
    """``(HF directory with an MTP depth, its megatron-convert checkpoint)``."""
    return _convert(tmp_path_factory, "deepseek_v3_mtp_convert", _make_with_mtp)


@pytest.fixture(scope="module")
def without_mtp(tmp_path_factory) -> tuple[str, str]:
    """``(transformers' own save: num_nextn_predict_layers=1 but no MTP tensors, its checkpoint)``."""
    return _convert(tmp_path_factory, "deepseek_v3_mixed_convert", _save_random, seed=3, first_k_dense_replace=2)


@pytest.fixture(scope="module")
def all_moe_mtp(tmp_path_factory) -> tuple[str, str]:
    """``(every layer MoE (stacked keys) and an MTP depth (per-depth keys), its checkpoint)``."""
    return _convert(tmp_path_factory, "deepseek_v3_moe_mtp_convert", _make_with_mtp, seed=5,
                    first_k_dense_replace=0)


MODELS = ["converted", "without_mtp", "all_moe_mtp"]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(SEQ).expand(BATCH, SEQ)


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(logits, MTP depths' hidden states)`` of this pipeline stage's model on :func:`_batch` (``None`` off the last
    stage); every stage gets the token ids (the MTP depth embeds them again)."""
    ids, pos = _batch()
    captured: list[torch.Tensor] = []
    if hasattr(model, "mtp"):
        model.mtp.register_forward_hook(lambda _m, _i, out: captured.append(out[SEQ:].detach().clone()))
    model.eval()
    initialized = parallel_state.model_parallel_is_initialized()
    pp = parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1
    first = pp == 1 or parallel_state.is_pipeline_first_stage()
    last = pp == 1 or parallel_state.is_pipeline_last_stage()
    with torch.no_grad():
        if not first:
            hidden = torch.empty(SEQ, BATCH, HIDDEN)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, pos, None, runtime_gather_output=True)
        if not last:
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
    return out, (captured[0] if captured else None)


def _oracle(src: str) -> torch.nn.Module:
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    (model,) = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    return model


def _loaded(src: str, ckpt: str) -> torch.nn.Module:
    """A bridge-built model (no HF weights read) filled by ``dist_checkpointing.load`` from the checkpoint."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    bridge = AutoBridge.from_hf_pretrained(src)  # as the import: MTP only where the files hold it
    (model,) = bridge.to_megatron_model(load_weights=False)
    state = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(ckpt, "iter_0000000"))
    result = model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=True)
    assert not result.missing_keys
    return model


def _model_chunks(sharded: dict) -> tuple[dict[str, tuple], set[str]]:
    """``({key: (global shape, [(offsets, sizes)])} of the tensors, {unique keys} of the objects)`` of a sharded
    state dict (TP=1, factories applied: a SwiGLU fc1 is two chunks, gate and up)."""
    apply_factories(sharded)
    tensors: dict[str, tuple] = {}
    objects = set()
    for value in sharded.values():
        for leaf in value if isinstance(value, list) else [value]:
            if isinstance(leaf, ShardedTensor):
                shape, chunks = tensors.setdefault(leaf.key, (tuple(leaf.global_shape), []))
                assert shape == tuple(leaf.global_shape), leaf.key
                chunks.append((tuple(leaf.global_offset), tuple(leaf.chunk_sizes())))
            elif isinstance(leaf, ShardedObject):
                objects.add(leaf.unique_key)
    return tensors, objects


def _inside(inner: tuple, outer: tuple) -> bool:
    """Whether chunk ``inner`` (offsets, sizes) lies within chunk ``outer``."""
    return all(o <= i and i + n <= o + m for i, n, o, m in zip(*inner, *outer))


@pytest.mark.parametrize("which", MODELS)
def test_checkpoint_holds_exactly_the_models_sharded_state(which: str, request) -> None:
    """Same keys, global shapes and objects; the stored chunks tile each tensor and hold each of the model's chunks
    (an expert's at its expert offset): the converter writes a SwiGLU fc1 as one chunk, the model's two halves."""
    from torch.distributed.checkpoint import FileSystemReader

    src, ckpt = request.getfixturevalue(which)
    path = os.path.join(ckpt, "iter_0000000")
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    stored = {key: (tuple(m.size), [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks])
              for key, m in metadata.items() if hasattr(m, "chunks")}
    objects = {k for k, v in load_sharded_metadata(path).items()
               if isinstance(v, ShardedObject) and not k.startswith(f"{COMMON_STATE_KEY}/")}
    tensors, model_objects = _model_chunks(_oracle(src).sharded_state_dict())
    assert model_objects == objects
    assert {k: v[0] for k, v in tensors.items()} == {k: v[0] for k, v in stored.items()}
    for key, (shape, chunks) in stored.items():
        assert sum(math.prod(sizes) for _, sizes in chunks) == math.prod(shape), key
        for chunk in tensors[key][1]:
            assert sum(_inside(chunk, outer) for outer in chunks) == 1, (key, chunk, chunks)
    mixed = which != "all_moe_mtp"  # per-layer keys; all-MoE layers are stacked
    assert mixed == any(key.startswith("decoder.layers.3.mlp.experts.") for key in stored)
    assert mixed != ("decoder.layers.mlp.experts.experts.linear_fc2.weight" in stored)
    assert (which != "without_mtp") == any(key.startswith("mtp.layers.0.transformer_layer.") for key in stored)


@pytest.mark.parametrize("which", MODELS)
def test_one_process_load_equals_the_in_process_import(which: str, request) -> None:
    src, ckpt = request.getfixturevalue(which)
    oracle, loaded = _oracle(src).state_dict(), _loaded(src, ckpt).state_dict()
    names = [n for n, v in oracle.items() if isinstance(v, torch.Tensor) and not n.endswith("_extra_state")]
    assert (which != "without_mtp") == any(n.startswith("mtp.layers.0.") for n in names)
    assert any(n.endswith("router.expert_bias") for n in names)
    for name in names:
        assert oracle[name].dtype == loaded[name].dtype and torch.equal(oracle[name], loaded[name]), name


def _load_at(ckpt: str, src: str, tp: int, pp: int, ep: int, resave: str | None
             ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """On each rank: load the converted checkpoint at (tp, pp, ep) as a training run does; run it; maybe re-save."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        chunks = AutoBridge.from_hf_pretrained(src, load_weights=False).to_megatron_model(load_weights=False)
        state = load_checkpoint(ckpt, chunks, None, None, load_optimizer=False, load_rng=False, strict=True)
        assert state is not None and state["iteration"] == 0
        result = _run(chunks[0])
        if resave is not None:
            save_checkpoint(resave, 5, chunks, None, None)
        return result
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "ep2"])
def test_resharded_load_matches_the_one_process_model(converted, tmp_path, tp: int, pp: int, ep: int) -> None:
    src, ckpt = converted
    logits, mtp_hidden = _run(_oracle(src))
    assert mtp_hidden is not None and mtp_hidden.shape == (SEQ, BATCH, HIDDEN)
    resave = str(tmp_path / "resaved") if pp > 1 else None
    results = [r for r in run_on_ranks(2, _load_at, ckpt, src, tp, pp, ep, resave) if r is not None]
    assert len(results) == (1 if pp > 1 else 2)
    for got_logits, got_mtp in results:
        torch.testing.assert_close(got_logits, logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_mtp, mtp_hidden, rtol=1e-4, atol=1e-4)
    if resave is not None:  # a training run's checkpoint (its own layout and iteration) exports back too
        export_mcore_to_hf(resave, str(tmp_path / "back"), hf_template=src, progress=False)
        assert_same_tensors(src, tmp_path / "back")


@pytest.mark.parametrize("which", MODELS)
def test_export_gives_back_the_original_files(which: str, request, tmp_path) -> None:
    src, ckpt = request.getfixturevalue(which)
    export_mcore_to_hf(ckpt, str(tmp_path / "back"), progress=False)
    assert_same_tensors(src, tmp_path / "back")
    names = safetensors_tensors(tmp_path / "back")
    assert (which != "without_mtp") == (f"model.layers.{LAYERS}.shared_head.head.weight" in names)
    with open(tmp_path / "back" / "config.json", encoding="utf-8") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1  # kept, as transformers' save_pretrained does


def test_cli_round_trip(converted, tmp_path, capsys) -> None:
    src, _ = converted
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    assert main(["hf-to-mcore", "--hf", src, "--out", ckpt, "--tp", "2", "--pp", "2", "--no-progress"]) == 0
    assert "multi-latent attention" in capsys.readouterr().out
    stored = load_sharded_metadata(os.path.join(ckpt, "iter_0000000"))
    assert tuple(stored["embedding.word_embeddings.weight"].global_shape) == (256, HIDDEN)  # padded to 128 x TP
    assert main(["mcore-to-hf", "--mcore", ckpt, "--out", back, "--max-shard-size", "200KB", "--no-progress"]) == 0
    assert_same_tensors(src, back)
    assert os.path.isfile(os.path.join(back, "model.safetensors.index.json"))
