"""Synthetic tasks with verifiable answers, for RL examples and tests on small models.

A task draws problems (a prompt and its one right answer) from a seeded `random.Random` and scores a
completion against the answer. The score is graded, so a model made from scratch gets a signal before
it is ever fully right: `answer_score` counts the answer's characters in place, over the longer of the
answer and the completion, so a right answer followed by a stop scores 1 and rambling costs.
"""

from __future__ import annotations

import random
import string
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def answer_score(completion: str, answer: str) -> float:
    """Share of characters in place: matches / max(len(answer), len(completion)); 1.0 only when equal."""
    if not answer:
        raise ValueError("answer must not be empty")
    hits = sum(a == c for a, c in zip(answer, completion))
    return hits / max(len(answer), len(completion))


REPEAT_LEN = 8


def _repeat(rng: random.Random) -> Problem:
    """'7:' -> '77777777': repeat the digit 8 times; every character scores, so a model made from
    scratch learns it in a few dozen steps."""
    d = rng.choice(string.digits)
    return Problem(f"{d}:", d * REPEAT_LEN)


def _add(rng: random.Random) -> Problem:
    """'3+4=' -> '7': the sum of two digits."""
    a, b = rng.randrange(10), rng.randrange(10)
    return Problem(f"{a}+{b}=", str(a + b))


def _copy(rng: random.Random) -> Problem:
    """'abc>' -> 'abc': copy three letters."""
    word = "".join(rng.choice("abcde") for _ in range(3))
    return Problem(f"{word}>", word)


def _reverse(rng: random.Random) -> Problem:
    """'abc<' -> 'cba': reverse three letters."""
    word = "".join(rng.choice("abcde") for _ in range(3))
    return Problem(f"{word}<", word[::-1])


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "repeat": _repeat,
    "add": _add,
    "copy": _copy,
    "reverse": _reverse,
}


def char_tokenizer() -> Any:
    """The built-in character tokenizer (rollout.toy): for checkpoints that ship no tokenizer, such as
    random ones with real shapes. Ids it does not know decode to nothing."""
    from rollout.models.toy import build_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        return build_tokenizer(folder)


@dataclass
class Task:
    """Problems of one kind from a seeded stream, and their rewards."""

    name: str
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)}, got {self.name!r}")
        self._rng = random.Random(self.seed)

    def sample(self, count: int) -> list[Problem]:
        return [TASKS[self.name](self._rng) for _ in range(count)]

    @staticmethod
    def reward(problem: Problem, completion: str) -> float:
        return answer_score(completion, problem.answer)
