"""Run inside the optimum tier's venv: transformers' ``apply_chat_template`` token ids, as JSON on stdout.

Usage: ``python chat_reference.py TOKENIZER_JSON REQUEST_JSON`` where REQUEST_JSON holds
``{"template", "messages", "bos_token", "eos_token"}``; prints ``{"ids": [...], "text": "..."}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import PreTrainedTokenizerFast


def main() -> None:
    tokenizer_file, request_file = sys.argv[1], sys.argv[2]
    request = json.loads(Path(request_file).read_text(encoding="utf-8"))
    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, bos_token=request["bos_token"],
                                  eos_token=request["eos_token"], unk_token="<unk>")
    kwargs = {"chat_template": request["template"], "add_generation_prompt": True}
    ids = tok.apply_chat_template(request["messages"], tokenize=True, **kwargs)
    text = tok.apply_chat_template(request["messages"], tokenize=False, **kwargs)
    print(json.dumps({"ids": [int(i) for i in ids], "text": text}))


if __name__ == "__main__":
    main()
