"""A checkpoint whose tokenizer adds a BOS and has a chat template, for the chat tests."""

from __future__ import annotations

import shutil
from pathlib import Path

# renders "<bos>" itself, as real templates (Llama's) do: encoding the result must not add a second one
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def chat_checkpoint(source: str, folder: Path) -> str:
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    shutil.copytree(source, folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    bos = tok.convert_tokens_to_ids("<bos>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return str(folder)
