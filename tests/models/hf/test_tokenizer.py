"""The HF directory's tokenizer becomes the run's tokenizer: special tokens and chat template as transformers has them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from megatron_core.models.hf import AutoBridge  # noqa: E402
from tests.models.hf.hf_models import make_hf_model  # noqa: E402

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _save_tokenizer(path) -> None:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, how are you today?", "the assistant answers the user"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": TEMPLATE},
              open(path / "tokenizer_config.json", "w"))


def test_directory_tokenizer_matches_transformers(tmp_path) -> None:
    import transformers

    make_hf_model("llama", tmp_path, vocab_size=96)
    _save_tokenizer(tmp_path)
    ours = AutoBridge.from_hf_pretrained(tmp_path).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ours.eod, ours.bos, ours.pad) == (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id)
    text = "hello world, the user"
    assert ours.tokenize(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.detokenize(ours.tokenize(text)) == text
    messages = [{"role": "system", "content": "be brief "}, {"role": "user", "content": "hello"}]
    for prompt in (False, True):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == expected
        assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == ours.tokenize(expected)
    with pytest.raises(ValueError, match="chat template: bad role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
