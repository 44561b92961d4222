"""Capture steps whose page planning waits: each step's rows in a device ring, its spans as given."""

import torch

from .page_pool import PagePool

CAPTURE, HASHES = "capture", "hashes"


class StepJournal:
    """The connector's continuing capture steps and the block-hash steps between them, in call
    order, not applied to the pool yet; the cache applies all of them at once when anything
    else touches it (``RoutedExpertsCache._flush``).

    Invariant: every journaled span continues its request at its cursor as the steps before it
    leave it and ends within ``max_position``; the journaled hash steps pin nothing; and the
    blocks the spans can begin (``new_pages``, a bound) fit in the room the pool had when they
    were journaled, which nothing journaled changes. So the flush, replaying the steps in
    order, takes the very pages the same calls made one by one would have, and cannot fail
    but in the device copy. A span's rows are ``ring[ring_start + source_start ...]``.
    """

    def __init__(self, ring: torch.Tensor, ring_words: torch.Tensor) -> None:
        self.ring, self.ring_words = ring, ring_words  # rows as the pool holds them; the copy backend's view
        self.entries: list[tuple] = []
        self.rows = 0  # ring rows in use
        self.new_pages = 0

    def fits(self, rows: int, new_pages: int, pool: PagePool) -> bool:
        """Whether a step of ``rows`` source rows whose spans begin at most ``new_pages`` blocks
        fits: in the ring, at most a quarter of it (a larger step gains little from waiting),
        and in the pool's room."""
        if 4 * rows > len(self.ring) or self.rows + rows > len(self.ring):
            return False
        new_pages += self.new_pages
        return new_pages <= len(pool.free) or new_pages <= pool.room()

    def add_capture(self, spans: tuple, order, rows: int, num_rows: int, new_pages: int) -> None:
        """Keep a step's spans ``(slots, starts, source_starts, counts, ends)`` (lists, or arrays
        with slots always), ``num_rows`` rows in all, whose ``rows`` source rows the caller
        copied to the ring from ``self.rows`` on."""
        self.entries.append((CAPTURE, spans, self.rows, order, num_rows))
        self.rows += rows
        self.new_pages += new_pages

    def add_hashes(self, request_ids: list, hash_lists: list) -> None:
        self.entries.append((HASHES, request_ids, hash_lists))

    def take(self) -> list[tuple]:
        """The entries, oldest first; the journal is empty after."""
        entries, self.entries, self.rows, self.new_pages = self.entries, [], 0, 0
        return entries
