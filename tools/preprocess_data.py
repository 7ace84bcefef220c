"""Tokenise a JSONL corpus into Megatron ``.bin``/``.idx`` files (Megatron-LM's ``tools/preprocess_data.py`` flags).

Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

The logic lives in ``megatron_core.datasets.preprocess_data``.
"""

import sys

from megatron_core.datasets.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
