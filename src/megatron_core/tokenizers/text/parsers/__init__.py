"""Response parsers of Megatron-Core 0.19: reasoning and tool calls out of generated text.

``PARSER_MAPPING`` names each parser as the server's ``parsers`` option (``ServeConfig.parsers``,
``megatron-serve --parsers``) takes it. Every parser has a static ``parse(text, **kwargs) ->
(content, info)``; the chat endpoint runs them in the order given, each on the previous one's
content, and merges their ``info`` (``reasoning``, ``tool_calls``).
"""

from megatron_core.tokenizers.text.parsers.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from megatron_core.tokenizers.text.parsers.nemotron_v3_reasoning_parser import NemotronV3ReasoningParser
from megatron_core.tokenizers.text.parsers.qwen3_coder_tool_parser import Qwen3CoderToolParser

PARSER_MAPPING = {
    "deepseek-r1-reasoning": DeepSeekR1ReasoningParser,
    "qwen3-coder-tool": Qwen3CoderToolParser,
    "nemotron-v3-reasoning": NemotronV3ReasoningParser,
}
"""Parser name (as configured) to parser class."""

__all__ = ["PARSER_MAPPING"]
