"""Chat templates of the ``multimodal`` library's prompt formats (Megatron-Core 0.19's renderings).

Each template renders a conversation as the concatenation of its messages rendered alone (plus,
for formats with a BOS, one leading BOS), which is what turn-by-turn loss masking needs. ``llama3``
and ``chatml`` use the tokenizer's own template (``tokenizer_config.json``) instead.
"""

from __future__ import annotations

MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)
"""``mistral``: ``[INST] user[/INST] answer</s>``; other roles render nothing."""

LLAMA3P1_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if 'tool_calls' in m %}"
    "{% if m.tool_calls | length != 1 %}{{ raise_exception('llama3p1 renders exactly one tool call per message') }}"
    "{% endif %}"
    "{% set call = m.tool_calls[0].function %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}<|eot_id|>'
    "{% elif m.role in ('tool', 'ipython') %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content | tojson }}<|eot_id|>"
    "{% else %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""``llama3p1`` / ``llama3p2``: Llama 3.1's chat format without its forced system message or tool prompts."""


def _im_template(start: str, end: str, with_bos: bool) -> str:
    """A ChatML-like format: ``{start}role\\ncontent{end}\\n`` per message."""
    return (
        ("{{ bos_token }}" if with_bos else "")
        + "{% for m in messages %}" + start + "{{ m.role }}\n{{ m.content }}" + end + "\n{% endfor %}"
        + "{% if add_generation_prompt %}" + start + "assistant\n{% endif %}"
    )


NVLM_YI_34B_TEMPLATE = _im_template("<|im_start|>", "<|im_end|>", with_bos=True)
"""``nvlm-yi-34b``: ChatML after a BOS."""

QWEN2P0_TEMPLATE = _im_template("<|im_start|>", "<|im_end|>", with_bos=False)
"""``qwen2p0`` / ``qwen2p5``: ChatML."""

NEMOTRON5_TEMPLATE = _im_template("<SPECIAL_14>", "<SPECIAL_15>", with_bos=True)
"""``nemotron5``: ChatML with Nemotron's special tokens, after a BOS."""

NEMOTRON5_ALIGNED_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ m.role[:1] | upper }}{{ m.role[1:] }}\n{{ m.content }}\n[PREFIX]{% endfor %}"
    "{% if add_generation_prompt %}Assistant\n{% endif %}"
)
"""``nemotron5-aligned``: ``Role\\ncontent\\n[PREFIX]`` per message, the role's first letter upper-cased."""
