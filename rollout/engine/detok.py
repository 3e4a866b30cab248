"""Incremental detokenization: the text a sample's tokens add, one token at a time.

Decoding a whole output on every token costs O(length) per token. `tokenizers`' DecodeStream keeps a
small window instead and holds back partial UTF-8 characters until they complete. Slow tokenizers
(no `tokenizers` backend) fall back to decoding the whole output and taking the new suffix.
"""

from __future__ import annotations

from typing import Any


class IncrementalText:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.text = ""
        self.count = 0  # tokens pushed
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = None
        self._ids: list[int] = []  # the fallback decodes these whole
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def update(self, output_ids: list[int]) -> str:
        """Push the tokens of `output_ids` not pushed yet; returns the whole text so far."""
        for token in output_ids[self.count :]:
            self.push(token)
        return self.text

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes (may be empty)."""
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
        else:
            self._ids.append(token_id)
            full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip)
            delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        self.count += 1
        return delta
