"""The vision tokenizers: the ``multimodal`` and ``null-multimodal`` libraries and their wiring.

Ids are checked against ``transformers``' ``apply_chat_template`` on the same ``tokenizer.json``
(with ``<image>`` added as a special token the way Megatron adds it); loss targets against masks
written out by hand for a character-level tokenizer in which each header word is one id. The
expected renderings are written out by hand from Megatron-Core 0.19's templates.
"""

from __future__ import annotations

import json
from argparse import Namespace

import numpy as np
import pytest
import torch

from megatron_core.models.multimodal._token_splice import splice_labels, splice_layout
from megatron_core.models.multimodal.llava_model import DEFAULT_IMAGE_TOKEN_INDEX, IGNORE_INDEX, IMAGE_TOKEN
from megatron_core.tokenizers import MegatronTokenizer
from megatron_core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron_core.tokenizers.vision import MegatronTokenizerVision
from megatron_core.tokenizers.vision.libraries import (
    MegatronMultimodalTokenizer,
    MegatronNullMultimodalTokenizer,
)
from megatron_core.tokenizers.vision.libraries.multimodal_tokenizer import PROMPT_FORMATS, QWEN_SYSTEM_DEFAULT
from megatron_core.tokenizers.vision.models import DefaultTokenizerVision

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<SPECIAL_14>", "<SPECIAL_15>",
           "<SPECIAL_233>"]
WORDS = ["system", "user", "assistant", "System", "User", "Assistant", "\n\n"]  # one id each, as in real vocabularies
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
          "{{ m.content | trim }}<|eot_id|>{% endfor %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>\nWhat is it?"},
        {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "And <image>?"},
        {"role": "assistant", "content": "A dog."}]
SPECIAL_TOKENS = ["<image>"]


def _write(directory, template: str) -> str:
    import tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL + CHARS)}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = tokenizers.decoders.Fuse()
    core.add_special_tokens(SPECIAL)
    core.add_tokens(WORDS)
    core.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "chat_template": template}))
    return str(directory)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> str:
    pytest.importorskip("tokenizers")
    return _write(tmp_path_factory.mktemp("chatml"), CHATML)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> str:
    pytest.importorskip("tokenizers")
    return _write(tmp_path_factory.mktemp("llama3"), LLAMA3)


def _encode(directory: str, text: str) -> list[int]:
    """Ids of ``text`` with ``<image>`` added as a special token (what the library does)."""
    import tokenizers

    core = tokenizers.Tokenizer.from_file(f"{directory}/tokenizer.json")
    core.add_special_tokens(SPECIAL_TOKENS)
    return core.encode(text, add_special_tokens=False).ids


def _expected_target(directory: str, turns: list[tuple[str, str]], prefix_len: int) -> list[int]:
    """Hand-written rule: system/user turns masked, the first ``prefix_len`` ids of assistant turns masked."""
    target = []
    for role, text in turns:
        ids = _encode(directory, text)
        masked = len(ids) if role in ("system", "user", "bos") else prefix_len if role == "assistant" else 0
        target += [IGNORE_INDEX] * masked + ids[masked:]
    return target


def _tokenizer(directory: str, prompt_format: str, image_tag_type: str = "", **kwargs) -> MegatronMultimodalTokenizer:
    return MegatronMultimodalTokenizer(directory, prompt_format, SPECIAL_TOKENS, image_tag_type, **kwargs)


@pytest.mark.parametrize("prompt_format", [f for f in PROMPT_FORMATS if f not in ("llama3", "llama3p2", "qwen2p5")])
def test_ids_match_transformers(chatml_dir, llama3_dir, prompt_format):
    transformers = pytest.importorskip("transformers")
    directory = llama3_dir if prompt_format == "llama3" else chatml_dir
    mm = _tokenizer(directory, prompt_format, image_tag_type="internvl")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{directory}/tokenizer.json", bos_token="<s>",
                                              eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    assert hf.add_tokens(SPECIAL_TOKENS, special_tokens=True) == 1
    chat = CHAT[1:] if prompt_format == "mistral" else CHAT  # mistral has no system role: Megatron drops it
    tagged = [{**m, "content": m["content"].replace("<image>", "<img><image></img>")} for m in chat]
    if prompt_format == "nemotron5-aligned":
        tagged = [{**m, "role": m["role"].capitalize()} for m in tagged]  # Megatron capitalises the roles
    template = mm._prompt_config.custom_chat_template
    for generation in (False, True):
        oracle = hf.apply_chat_template(tagged, chat_template=template, tokenize=True, return_dict=False,
                                        add_generation_prompt=generation)
        assert mm.tokenize_conversation(CHAT, False, generation).tolist() == list(oracle)
    assert mm.tokenize(CHAT) == list(hf.apply_chat_template(tagged, chat_template=template, return_dict=False,
                                                           add_generation_prompt=True))


def test_chatml_image_is_one_special_id_with_internvl_tags_and_user_turns_masked(chatml_dir):
    mm = _tokenizer(chatml_dir, "chatml", image_tag_type="internvl")
    image_id = mm.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_id == len(SPECIAL + CHARS + WORDS) and mm.vocab_size == image_id  # added after vocab_size is taken
    assert mm.get_special_tokens()[IMAGE_TOKEN] == image_id and mm.vocab[IMAGE_TOKEN] == image_id
    tokens, target = mm.tokenize_conversation(CHAT, return_target=True, add_generation_prompt=False)
    turns = [("system", "<|im_start|>system\nBe brief.<|im_end|>\n"),
             ("user", "<|im_start|>user\n<img><image></img>\nWhat is it?<|im_end|>\n"),
             ("assistant", "<|im_start|>assistant\nA cat.<|im_end|>\n"),
             ("user", "<|im_start|>user\nAnd <img><image></img>?<|im_end|>\n"),
             ("assistant", "<|im_start|>assistant\nA dog.<|im_end|>\n")]
    assert tokens.tolist() == _encode(chatml_dir, "".join(text for _, text in turns))
    assert target.tolist() == _expected_target(chatml_dir, turns, prefix_len=3)
    assert int((tokens == image_id).sum()) == 2 and not (target == image_id).any()
    assert mm.tokenize("<image> hi")[:4] == _encode(chatml_dir, "<img><image></img>")[:4]
    assert mm.detokenize(tokens[:3]) == "<|im_start|>system\n"
    assert mm.pad == SPECIAL.index("<pad>") and mm.eod == SPECIAL.index("</s>")
    assert CHAT[1]["content"] == "<image>\nWhat is it?"  # the caller's conversation is not modified


def test_llama3p1_and_mistral_targets(chatml_dir):
    mm = _tokenizer(chatml_dir, "llama3p1", image_tag_type="nvlm")
    tokens, target = mm.tokenize_conversation(CHAT[:3], return_target=True, add_generation_prompt=False)
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    turns = [("bos", "<s>"), ("system", header.format("system") + "Be brief.<|eot_id|>"),
             ("user", header.format("user") + "<Image><image></Image>\nWhat is it?<|eot_id|>"),
             ("assistant", header.format("assistant") + "A cat.<|eot_id|>")]
    assert tokens.tolist() == _encode(chatml_dir, "".join(text for _, text in turns))
    assert target.tolist() == _expected_target(chatml_dir, turns, prefix_len=4)
    assert mm.pad == SPECIAL.index("<|finetune_right_pad_id|>")

    mistral = _tokenizer(chatml_dir, "mistral")
    tokens, target = mistral.tokenize_conversation(CHAT[:3], return_target=True, add_generation_prompt=False)
    turns = [("bos", "<s>"), ("user", "[INST] <image>\nWhat is it?[/INST]"), ("assistant", " A cat.</s>")]
    assert tokens.tolist() == _encode(chatml_dir, "".join(text for _, text in turns))
    assert target.tolist() == _expected_target(chatml_dir, turns, prefix_len=0)
    assert mistral.pad == SPECIAL.index("<unk>")


def test_nemotron5_aligned_and_qwen_forced_system(chatml_dir):
    mm = _tokenizer(chatml_dir, "nemotron5-aligned")
    tokens, target = mm.tokenize_conversation(CHAT[1:3], return_target=True, add_generation_prompt=False)
    turns = [("bos", "<s>"), ("user", "User\n<image>\nWhat is it?\n[PREFIX]"), ("assistant", "Assistant\nA cat.\n[PREFIX]")]
    assert tokens.tolist() == _encode(chatml_dir, "".join(text for _, text in turns))
    assert target.tolist() == _expected_target(chatml_dir, turns, prefix_len=2)
    assert mm.pad == SPECIAL.index("<SPECIAL_233>")

    qwen = _tokenizer(chatml_dir, "qwen2p5", force_system_message=True)
    for chat in (CHAT[:3], CHAT[1:3]):  # a given system message is replaced, a missing one inserted
        tokens, target = qwen.tokenize_conversation(chat, return_target=True, add_generation_prompt=False)
        turns = [("system", f"<|im_start|>system\n{QWEN_SYSTEM_DEFAULT['content']}<|im_end|>\n"),
                 ("user", "<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n"),
                 ("assistant", "<|im_start|>assistant\nA cat.<|im_end|>\n")]
        assert tokens.tolist() == _encode(chatml_dir, "".join(text for _, text in turns))
        assert target.tolist() == _expected_target(chatml_dir, turns, prefix_len=3)


def test_other_roles_are_trained_as_in_megatron(chatml_dir):
    mm = _tokenizer(chatml_dir, "qwen2p0")
    chat = [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]
    _, target = mm.tokenize_conversation(chat, return_target=True, add_generation_prompt=False)
    turns = [("user", "<|im_start|>user\nq<|im_end|>\n"), ("tool", "<|im_start|>tool\nr<|im_end|>\n"),
             ("assistant", "<|im_start|>assistant\na<|im_end|>\n")]
    assert target.tolist() == _expected_target(chatml_dir, turns, prefix_len=3)


def test_image_token_expands_in_llava_splice(chatml_dir):
    """One id per image from the tokenizer; LLaVA's splice gives it ``tiles * img_seq_len`` positions."""
    mm = _tokenizer(chatml_dir, "chatml")
    tokens, target = mm.tokenize_conversation(CHAT, return_target=True, add_generation_prompt=False)
    image_id = mm.convert_tokens_to_ids(IMAGE_TOKEN)
    input_ids = torch.as_tensor(tokens)[None]
    labels, loss_mask = torch.as_tensor(target)[None], torch.as_tensor(target != IGNORE_INDEX, dtype=torch.float)[None]
    tiles, img_seq_len = torch.tensor([2, 3]), 4
    layout = splice_layout(input_ids, image_id, tiles, img_seq_len)
    assert int(layout.seq_lens[0]) == len(tokens) - 2 + int(tiles.sum()) * img_seq_len
    assert int(layout.image_mask.sum()) == int(tiles.sum()) * img_seq_len
    new_labels, new_mask = splice_labels(layout, labels, loss_mask)
    assert new_labels.shape[1] == int(layout.seq_lens[0])
    assert int(new_mask.sum()) == int(loss_mask.sum())  # images add no trained positions; answers keep theirs


def test_bad_input_raises_value_error_naming_it(chatml_dir):
    with pytest.raises(ValueError, match="prompt_format 'vicuna' is not one of"):
        _tokenizer(chatml_dir, "vicuna")
    with pytest.raises(ValueError, match="image_tag_type 'html' is not one of"):
        _tokenizer(chatml_dir, "chatml", image_tag_type="html")
    with pytest.raises(ValueError, match=r"already in the vocabulary: \['<s>'\]"):
        MegatronMultimodalTokenizer(chatml_dir, "chatml", ["<s>"], "")
    with pytest.raises(ValueError, match="force_system_message=True needs .*not 'chatml'"):
        _tokenizer(chatml_dir, "chatml", force_system_message=True)
    mm = _tokenizer(chatml_dir, "chatml")
    with pytest.raises(ValueError, match="non-empty list"):
        mm.tokenize_conversation([], True, False)
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with string 'role' and 'content'"):
        mm.tokenize_conversation([{"role": "user"}], True, False)
    with pytest.raises(ValueError, match=r"messages\[1\] \(assistant\) is empty"):
        mm.tokenize_conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}], True, False)
    with pytest.raises(ValueError, match=r"messages\[1\] \(assistant\) contains '<image>'"):
        mm.tokenize_conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<image>"}],
                                 True, False)
    with pytest.raises(ValueError, match="cover .*add_generation_prompt=True"):
        mm.tokenize_conversation(CHAT, True, True)
    with pytest.raises(ValueError, match="'x' in '1 x' is not an integer id"):
        MegatronNullMultimodalTokenizer(8).tokenize("1 x")
    with pytest.raises(NotImplementedError):
        MegatronTokenizer.from_pretrained(chatml_dir, metadata_path={"library": "multimodal"}, prompt_format="chatml",
                                          special_tokens=SPECIAL_TOKENS, image_tag_type="").apply_chat_template(CHAT)


def test_from_pretrained_and_build_tokenizer(chatml_dir, tmp_path):
    tokenizer = MegatronTokenizer.from_pretrained(chatml_dir, metadata_path={"library": "multimodal"},
                                                  prompt_format="chatml", special_tokens=SPECIAL_TOKENS,
                                                  image_tag_type="")
    assert type(tokenizer) is DefaultTokenizerVision and isinstance(tokenizer, MegatronTokenizerVision)
    direct = _tokenizer(chatml_dir, "chatml")
    assert np.array_equal(tokenizer.tokenize_conversation(CHAT, True, False)[1], direct.tokenize_conversation(
        CHAT, True, False)[1])
    assert tokenizer.tokenize("<image>") == direct.tokenize("<image>")
    assert tokenizer.vocab_size == direct.vocab_size and tokenizer.pad == direct.pad and tokenizer.eod == direct.eod

    MegatronTokenizer.write_metadata(chatml_dir, "multimodal", metadata_path=str(tmp_path / "meta.json"))
    assert json.loads((tmp_path / "meta.json").read_text())["model_type"] == "default-vision"
    again = MegatronTokenizer.from_pretrained(chatml_dir, metadata_path=str(tmp_path / "meta.json"),
                                              prompt_format="chatml", special_tokens=SPECIAL_TOKENS, image_tag_type="")
    assert type(again) is DefaultTokenizerVision and again.tokenize("<image>") == direct.tokenize("<image>")
    with pytest.raises(ValueError, match="model_type 'gpt' is not supported for library 'multimodal'"):
        MegatronTokenizer.from_pretrained(chatml_dir, metadata_path={"library": "multimodal", "model_type": "gpt"},
                                          prompt_format="chatml", special_tokens=SPECIAL_TOKENS, image_tag_type="")

    args = Namespace(tokenizer_type="MultimodalTokenizer", tokenizer_model=chatml_dir, tokenizer_prompt_format="chatml",
                     special_tokens=SPECIAL_TOKENS, image_tag_type="internvl", force_system_message=False,
                     make_vocab_size_divisible_by=64)
    built = build_tokenizer(args)
    assert built.library == "multimodal" and args.padded_vocab_size == 128
    assert built.tokenize("<image>") == _tokenizer(chatml_dir, "chatml", "internvl").tokenize("<image>")

    null_args = Namespace(tokenizer_type="NullMultimodalTokenizer", vocab_size=100)
    null = build_tokenizer(null_args)
    assert type(null) is DefaultTokenizerVision and null.library == "null-multimodal"
    assert null.vocab_size == 101 and null.eod == 100 and null_args.padded_vocab_size == 128
    assert null.tokenize("5 7") == [5, 7] and null.detokenize([5, 7]) == "5 7" and null.offsets([5, 17], "") == [0, 2]
    assert null.convert_tokens_to_ids(IMAGE_TOKEN) == DEFAULT_IMAGE_TOKEN_INDEX
    assert null.convert_tokens_to_ids("3  <image>") == [3, DEFAULT_IMAGE_TOKEN_INDEX]
    assert MegatronNullMultimodalTokenizer(4, image_token="<img>", image_token_id=3).convert_tokens_to_ids("<img>") == 3
    with pytest.raises(ValueError, match="NullMultimodalTokenizer needs args.vocab_size"):
        build_tokenizer(Namespace(tokenizer_type="NullMultimodalTokenizer"))
