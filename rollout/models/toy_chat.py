"""Tiny tool-calling chat checkpoints made on the spot (no download), for tests and examples: a
character tokenizer with Qwen's chat tokens (<|im_start|>, <|im_end|>, <tool_call>, <think>), a
Qwen2.5/Qwen3-style chat template (tools in the system turn, <tool_call> blocks, <tool_response> turns,
<think>, enable_thinking), and a short supervised warm start on (prompt, answer) texts, so that the model
writes tool calls the server's parsers can read."""

from __future__ import annotations

import string
import time
from pathlib import Path
from typing import Any

SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}<tools>
{% for t in tools %}{{ t.function.name }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}
<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
{{- '\\n<tool_response>\\n' }}{{ m.content }}{{ '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


def build_tokenizer(folder: str | Path) -> Any:
    """Printable characters one token each, plus the chat tokens; the template set; saved to `folder`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\r\x0b\x0c\t"))
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>", clean_up_tokenization_spaces=False
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(folder))
    return tok


def warm_start(
    folder: str | Path,
    rows: list[tuple[str, str]],
    *,
    steps: int = 800,
    seconds: float = 300.0,
    exact: bool = True,
    lr: float = 1e-2,
    seed: int = 0,
) -> float:
    """Train a small random Qwen3 (saved into `folder`, which holds the tokenizer) on (prompt, answer)
    texts, the loss on the answers only, until greedy decoding reproduces every answer (`exact`) or for
    `steps`. Returns the share of answer tokens the model gets right (teacher-forced argmax)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tok = AutoTokenizer.from_pretrained(str(folder))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    enc = [
        (tok.encode(p, add_special_tokens=False), tok.encode(a, add_special_tokens=False)) for p, a in rows
    ]

    T = max(len(p) + len(a) for p, a in enc)
    ids = torch.zeros(len(enc), T, dtype=torch.long)
    labels = torch.full((len(enc), T), -100, dtype=torch.long)
    for i, (p, a) in enumerate(enc):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t0, threads, acc = time.time(), torch.get_num_threads(), 0.0
    torch.set_num_threads(1)  # small matrices on a shared machine: one thread is several times faster
    try:
        for step in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 25 == 24 or step == steps - 1:
                with torch.no_grad():
                    pred = model(input_ids=ids).logits.argmax(-1)
                mask = labels[:, 1:] != -100
                acc = (pred[:, :-1][mask] == labels[:, 1:][mask]).float().mean().item()
                if (exact and acc == 1.0) or time.time() - t0 > seconds:
                    break
    finally:
        torch.set_num_threads(threads)
    if exact and acc < 1.0:
        raise RuntimeError(f"the warm start did not learn its answers ({acc:.3f} of tokens right)")
    model.save_pretrained(str(folder), safe_serialization=True)
    return acc


def cached(name: str, key: str, build: Any) -> str:
    """`build(folder)` once into $ROLLOUT_CACHE/name-key (atomic: a concurrent builder's copy wins)."""
    import os
    import shutil
    import tempfile

    root = Path(os.environ.get("ROLLOUT_CACHE", Path.home() / ".cache" / "rollout"))
    folder = root / f"{name}-{key}"
    if not (folder / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
        build(tmp / "m")
        try:
            (tmp / "m").rename(folder)
        except OSError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)
