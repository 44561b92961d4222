"""The routing oracle: rows and tokens as pure functions of the token prefix (no vLLM, no model).

The row of position ``p`` comes from a chained hash of ``tokens[0..p]``, so rows computed for
a rejected draft differ from the true row, and equal prefixes (prefix-cache hits) have equal rows.
Rows also depend on the weights version (an RL weight update changes every row) while tokens
do not: after an update the same prompt yields the same tokens and hashes but other rows, so a
row kept across the update is caught.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from math import prod

import numpy as np


BLOCK_SIZE = 4
ROW_SHAPE = (3, 2)  # (layers, top_k)
NUM_EXPERTS = 64
VOCAB = 500
ROOT_STATE = b"\x00" * 16
PLACEHOLDER = -1  # a draft slot without a proposal; never accepted


class HarnessError(AssertionError):
    """The simulation saw something vLLM's real components would not produce, or a row check failed."""


# ------------------------------------------------------------------ routing oracle


def advance(state: bytes, token: int) -> bytes:
    """Chain state after one more token: a function of the whole prefix."""
    return hashlib.blake2b(state + int(token).to_bytes(4, "little", signed=True), digest_size=16).digest()


@lru_cache(maxsize=1 << 16)  # the row checks ask for the same positions again (the limits tier's time)
def row_of(state: bytes, weights_version: int = 0) -> np.ndarray:
    """Expert ids (layers, top_k) of the position whose prefix ends in ``state``, under the
    weights of ``weights_version`` (read-only: shared between calls)."""
    if weights_version:
        state = hashlib.blake2b(state + weights_version.to_bytes(4, "little"), digest_size=16).digest()
    row = (np.frombuffer(state, dtype=np.uint8)[: prod(ROW_SHAPE)] % NUM_EXPERTS).reshape(ROW_SHAPE)
    row.flags.writeable = False
    return row


def true_next_token(state: bytes) -> int:
    """The token the (simulated) target model samples after the prefix ``state``."""
    return int.from_bytes(state[12:16], "little") % VOCAB


def prefix_states(tokens) -> list[bytes]:
    states, state = [], ROOT_STATE
    for token in tokens:
        state = advance(state, token)
        states.append(state)
    return states


def expected_rows(tokens, start: int, end: int, weights_versions=None) -> np.ndarray:
    """Rows of positions ``[start, end)``: position p is a function of ``tokens[0..p]`` and of
    ``weights_versions[p]`` (the weights its row was computed with; all 0 when not given)."""
    if not 0 <= start <= end <= len(tokens):
        raise HarnessError(f"expected rows [{start}, {end}) of a {len(tokens)}-token sequence")
    states = prefix_states(tokens[:end])
    versions = weights_versions if weights_versions is not None else [0] * end
    if len(versions) < end:
        raise HarnessError(f"weights versions of {len(versions)} positions, rows up to {end} expected")
    rows = [row_of(s, v) for s, v in zip(states[start:end], versions[start:end])]
    return np.stack(rows) if rows else np.empty((0, *ROW_SHAPE), dtype=np.uint8)


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, VOCAB, size=n)]
