"""The ``sft`` library (conversation ids and loss targets), library chat templates and the abstract text tokenizer.

Ids are checked against ``transformers``' ``apply_chat_template`` on the same ``tokenizer.json``;
the targets against masks written out by hand for a tokenizer where each header word is one id.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_core.tokenizers import MegatronTokenizer
from megatron_core.tokenizers.text.libraries import SFTTokenizer
from megatron_core.tokenizers.text.libraries.abstract_tokenizer import MegatronTokenizerTextAbstract
from megatron_core.tokenizers.text.libraries.chat_template import MegatronTokenizerChatTemplate
from megatron_core.tokenizers.text.libraries.sft_tokenizer import (
    IGNORE_INDEX,
    NEMOTRON_H_ALIGNED_TEMPLATE,
    NEMOTRON_NANO_V2_TEMPLATE,
)
from megatron_core.tokenizers.utils.build_tokenizer import build_tokenizer

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIAL = ["<unk>", "<s>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"]
WORDS = ["System", "User", "Assistant"]  # one id each, so a nano-v2 assistant header is 3 ids as in Nemotron
DEFAULT_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
CHAT = [{"role": "system", "content": "Be brief. /think"}, {"role": "user", "content": " hi /no_think"},
        {"role": "assistant", "content": "ok "}, {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "later"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {token: i for i, token in enumerate(SPECIAL + CHARS)}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = tokenizers.decoders.Fuse()
    core.add_special_tokens(SPECIAL)
    core.add_tokens(WORDS)
    directory = tmp_path_factory.mktemp("sft")
    core.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": DEFAULT_TEMPLATE}))
    return directory


def ids(directory, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_nano_v2_ids_match_transformers_and_mask_all_but_answers(tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    sft = SFTTokenizer(str(tokenizer_dir), "nemotron-nano-v2")
    tokens, target = sft.tokenize_conversation(CHAT, return_target=True, add_generation_prompt=False)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    oracle = hf.apply_chat_template(CHAT, chat_template=NEMOTRON_NANO_V2_TEMPLATE, tokenize=True, return_dict=False)
    assert tokens.tolist() == list(oracle)
    turns = ["<SPECIAL_10>System\nBe brief.\n", "<SPECIAL_11>User\nhi\n", "<SPECIAL_11>Assistant\nok\n<SPECIAL_12>\n",
             "<SPECIAL_11>User\nbye\n", "<SPECIAL_11>Assistant\nlater\n<SPECIAL_12>\n"]
    assert tokens.tolist() == ids(tokenizer_dir, "".join(turns))
    expected = []
    for turn, message in zip(turns, CHAT):
        turn_ids = ids(tokenizer_dir, turn)
        masked = len(turn_ids) if message["role"] != "assistant" else 3  # the assistant header: 3 ids
        expected += [IGNORE_INDEX] * masked + turn_ids[masked:]
    assert target.tolist() == expected
    assert sft.pad_id == 0 and sft.eod == 2 and sft.bos_id == 1 and sft.vocab_size == len(SPECIAL + CHARS + WORDS)
    assert sft.ids_to_text(tokens[:3].tolist()) == "<SPECIAL_10>System\n"


def test_h_aligned_masks_user_turns_with_their_assistant_header(tokenizer_dir):
    sft = SFTTokenizer(str(tokenizer_dir), "nemotron-h-aligned")
    chat = CHAT[1:3]
    tokens, target = sft.tokenize_conversation(chat, return_target=True, add_generation_prompt=False)
    user = ids(tokenizer_dir, "<SPECIAL_11>User\nhi /no_think\n<SPECIAL_11>Assistant\n")
    answer = ids(tokenizer_dir, "ok\n")
    assert tokens.tolist() == user + answer and target.tolist() == [IGNORE_INDEX] * len(user) + answer
    assert sft.pad_id == 0  # <SPECIAL_233> is not in this vocabulary: the unknown id
    assert sft.text_to_ids(chat) == tokens.tolist()
    assert sft.text_to_ids("hi") == ids(tokenizer_dir, "hi")


@pytest.mark.parametrize("prompt_format", ["identity", "default"])
def test_identity_and_default_train_on_every_id(tokenizer_dir, prompt_format):
    sft = SFTTokenizer(str(tokenizer_dir), prompt_format)
    tokens, target = sft.tokenize_conversation(CHAT[1:3], return_target=True, add_generation_prompt=False)
    text = " hi /no_thinkok " if prompt_format == "identity" else "<s>[user] hi /no_think</s>[assistant]ok </s>"
    assert tokens.tolist() == ids(tokenizer_dir, text) and np.array_equal(target, tokens)


def test_megatron_tokenizer_sft_library(tokenizer_dir):
    tokenizer = MegatronTokenizer.from_pretrained(str(tokenizer_dir), metadata_path={"library": "sft"},
                                                  prompt_format="nemotron-nano-v2")
    tokens, target = tokenizer.tokenize_conversation(CHAT[1:3], return_target=True, add_generation_prompt=False)
    assert (target != IGNORE_INDEX).sum() == len(ids(tokenizer_dir, "ok\n<SPECIAL_12>\n"))
    assert tokenizer.pad_id == 0 and tokenizer.eod == 2
    args = SimpleNamespace(tokenizer_type="SFTTokenizer", tokenizer_model=str(tokenizer_dir),
                           sft_tokenizer_prompt_format="nemotron-nano-v2", pad_vocab_size=False)
    built = build_tokenizer(args)
    assert built.tokenize_conversation(CHAT[1:3], True, False)[1].tolist() == target.tolist()
    plain = MegatronTokenizer.from_pretrained(str(tokenizer_dir), metadata_path={"library": "huggingface"})
    with pytest.raises(NotImplementedError, match="only for the 'sft' library"):
        plain.tokenize_conversation(CHAT, return_target=True, add_generation_prompt=False)


@pytest.mark.parametrize("chat,match", [
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}], r"messages\[1\] is an empty"),
    ([{"role": "assistant", "content": "a"}], r"messages\[0\] \(assistant\) must follow a user or tool"),
    ([{"role": "user", "content": "a"}, {"role": "critic", "content": "b"}], r"messages\[1\].role 'critic'"),
])
def test_sft_refuses_conversations_it_cannot_mask(tokenizer_dir, chat, match):
    sft = SFTTokenizer(str(tokenizer_dir), "nemotron-h-aligned")
    with pytest.raises(ValueError, match=match):
        sft.tokenize_conversation(chat, return_target=True, add_generation_prompt=False)
    with pytest.raises(ValueError, match="prompt_format 'chatml' is not one of"):
        SFTTokenizer(str(tokenizer_dir), "chatml")


def test_h_aligned_template_text():
    from megatron_core.tokenizers.text.chat_template import render_chat_template

    text = render_chat_template(NEMOTRON_H_ALIGNED_TEMPLATE, [{"role": "system", "content": " s "},
                                                             {"role": "user", "content": "u"},
                                                             {"role": "assistant", "content": "a\n"}])
    assert text == "<SPECIAL_10>System\ns\n<SPECIAL_11>User\nu\n<SPECIAL_11>Assistant\na\n"


class _Words(MegatronTokenizerTextAbstract, MegatronTokenizerChatTemplate):
    """Whitespace 'tokenizer' over a fixed word list."""

    words = ["<pad>", "<eos>", "a", "b", "[user]", "[assistant]"]
    pad, eos = 0, 1

    def text_to_tokens(self, text):
        return text.split()

    def tokens_to_text(self, tokens):
        return " ".join(tokens)

    def tokens_to_ids(self, tokens):
        return [self.words.index(t) for t in tokens]

    def ids_to_tokens(self, ids):
        return [self.words[i] for i in ids]

    def text_to_ids(self, text):
        return self.tokens_to_ids(self.text_to_tokens(text))

    def ids_to_text(self, ids):
        return self.tokens_to_text(self.ids_to_tokens(ids))

    def add_special_tokens(self, special_tokens):
        raise NotImplementedError


def test_abstract_tokenizer_aliases_and_chat_template_mixin():
    words = _Words()
    assert (words.pad_id, words.eos_id, words.eod) == (0, 1, 1)
    with pytest.raises(AttributeError, match="no attribute 'bos' or 'bos_id'"):
        _ = words.bos_id
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (MegatronTokenizerTextAbstract,), {"text_to_ids": lambda self, t: []})()
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    chat = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "a"}]
    assert words.apply_chat_template(chat, template, tokenize=False) == "[user] a b [assistant] a "
    assert words.apply_chat_template(chat, template) == [4, 2, 3, 5, 2]
    assert words.apply_chat_template(chat, template, truncation=True, max_length=2) == [4, 2]
    with pytest.raises(ValueError, match="truncation=True needs max_length"):
        words.apply_chat_template(chat, template, truncation=True)
    with pytest.raises(ValueError, match="no chat_template given"):
        words.apply_chat_template(chat, "")
