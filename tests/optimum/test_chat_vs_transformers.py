"""A chat prompt's token ids equal transformers' ``apply_chat_template(..., tokenize=True)``, computed by
transformers itself in the tier's venv (``chat_reference.py``), on the Llama-style tokenizer whose
post-processor prepends ``<s>`` and a template that writes ``{{ bos_token }}``: one BOS, not two.
The same ids are pinned in ``tests/unit/test_chat_tokens.py`` for the main venv.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gateway.chat import ChatTemplate, render_chat
from protocol.tokenization import HFTokenizer
from tests.unit.test_chat_tokens import MESSAGES, TEMPLATE, TRANSFORMERS_IDS
from tests.unit.tiny_tokenizers import sentencepiece_bpe

pytestmark = [pytest.mark.optimum, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("chat_reference.py")


def test_chat_prompt_ids_equal_transformers(optimum_python: str, tmp_path: Path) -> None:
    tokenizer_file = sentencepiece_bpe(tmp_path / "tokenizer.json", add_bos=True)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"template": TEMPLATE, "messages": MESSAGES, "bos_token": "<s>",
                                   "eos_token": "</s>"}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([optimum_python, str(SCRIPT), str(tokenizer_file), str(request)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = json.loads(proc.stdout.strip().splitlines()[-1])
    text = render_chat(ChatTemplate(TEMPLATE, bos_token="<s>", eos_token="</s>"), MESSAGES)
    assert text == reference["text"]
    ids = HFTokenizer(tokenizer_file).encode(text, add_special_tokens=False)
    assert ids == reference["ids"] == TRANSFORMERS_IDS
    assert ids.count(1) == 1
