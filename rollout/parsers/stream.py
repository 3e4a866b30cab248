"""A parser fed chunk by chunk: each feed returns the pieces now sure, `finish` the rest. The pieces
equal the whole-text parse's, however the text was split."""

from __future__ import annotations

from typing import Protocol

from rollout.parsers.types import Parsed, Piece, gather


class Scanner(Protocol):
    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]: ...


class Stream:
    def __init__(self, scanner: Scanner):
        self.scanner, self.pending = scanner, ""

    def feed(self, chunk: str) -> list[Piece]:
        self.pending += chunk
        pieces, used = self.scanner.scan(self.pending, final=False)
        self.pending = self.pending[used:]
        return pieces

    def finish(self) -> list[Piece]:
        pieces, _ = self.scanner.scan(self.pending, final=True)
        self.pending = ""
        return pieces


def parse_chunks(scanner: Scanner, chunks: list[str]) -> Parsed:
    """What a stream of `chunks` gives, gathered (for tests and offline use)."""
    s = Stream(scanner)
    pieces = [p for c in chunks for p in s.feed(c)] + s.finish()
    return gather(pieces)
