"""The prompts of bench/peers.py: one long prefix, and multi-turn conversations.

Contract
========

Every prompt is a ``Prompt``: an id that names it in the results
(``single/r3``, ``multi/c2/t1``, ``pair/c5/t3``, ``restart/c1``), its token ids
(random, drawn from ``[3, vocab)`` by one seeded generator: the same arguments
give the same prompts in every run and every round) and the tokens to generate.
Nothing here runs an engine.

- ``single_prefix(...)``: a shared prefix, the request that computes it first
  (``single/first``, a suffix of its own), and ``reps`` requests of the prefix
  with a unique suffix each (``single/r<i>``), one output token each; beside
  each, another (``single/h<i>``) for the same engine's own prefix-cache hit.
- ``conversations(...)``: ``n`` conversations of ``turns`` turns, in the order they
  are sent (turn-major: turn 1 of every conversation, then turn 2, ...). Turn
  ``t``'s prompt is the conversation's document, then for every earlier turn
  its user message and a fixed reply, then turn ``t``'s user message: each prompt
  extends the previous turn's, so a cache that kept it serves all but the new
  tokens. The replies are fixed tokens, not the engine's answers, so every system
  gets the same prompts whatever it answered. ``turn_prompt(conv, t)`` gives any
  turn (``restart`` uses turn ``turns + 1``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass


@dataclass(slots=True)
class Prompt:
    pid: str
    tokens: list[int]
    max_tokens: int

    def key(self) -> str:
        """A digest of the tokens: the same prompt under two ids (a salted probe) shares its reference answer."""
        return hashlib.sha1(",".join(map(str, self.tokens)).encode()).hexdigest()[:16]


@dataclass(slots=True)
class Conversation:
    index: int
    document: list[int]
    users: list[list[int]]  # one per turn, the extra turn included
    replies: list[list[int]]


class Tokens:
    """Random token ids from one seeded generator."""

    def __init__(self, seed: int, vocab: int) -> None:
        self._rng = random.Random(seed)
        self._vocab = vocab

    def draw(self, n: int) -> list[int]:
        return [self._rng.randrange(3, self._vocab) for _ in range(n)]


@dataclass(slots=True)
class SinglePrefix:
    prefix: list[int]
    first: Prompt
    reps: list[Prompt]
    hits: list[Prompt]  # one per repetition, with a suffix of its own: the same engine's own prefix-cache hit


def single_prefix(tokens: Tokens, prefix_tokens: int, suffix_tokens: int, reps: int) -> SinglePrefix:
    prefix = tokens.draw(prefix_tokens)
    return SinglePrefix(prefix=prefix, first=Prompt("single/first", prefix + tokens.draw(suffix_tokens), 1),
                        reps=[Prompt(f"single/r{i}", prefix + tokens.draw(suffix_tokens), 1) for i in range(reps)],
                        hits=[Prompt(f"single/h{i}", prefix + tokens.draw(suffix_tokens), 1) for i in range(reps)])


def conversations(tokens: Tokens, n: int, turns: int, doc_tokens: int, user_tokens: int,
                  reply_tokens: int) -> list[Conversation]:
    """``n`` conversations with ``turns + 1`` user messages each (the last for a turn after a restart)."""
    return [Conversation(c, tokens.draw(doc_tokens), [tokens.draw(user_tokens) for _ in range(turns + 1)],
                         [tokens.draw(reply_tokens) for _ in range(turns + 1)]) for c in range(n)]


def turn_prompt(conv: Conversation, turn: int, tag: str, answer_tokens: int) -> Prompt:
    """Turn ``turn`` (1-based) of ``conv``: document, earlier (user, reply) pairs, this user message."""
    toks = list(conv.document)
    for k in range(turn - 1):
        toks += conv.users[k] + conv.replies[k]
    toks += conv.users[turn - 1]
    return Prompt(f"{tag}/c{conv.index}/t{turn}", toks, answer_tokens)


def turn_major(convs: list[Conversation], turns: int, tag: str, answer_tokens: int) -> list[tuple[int, int, Prompt]]:
    """Every turn of every conversation in the order sent: ``(conversation index, turn, prompt)``."""
    return [(c.index, t, turn_prompt(c, t, tag, answer_tokens)) for t in range(1, turns + 1) for c in convs]
