"""Page ids of the pool: which are free, which hold a published block, and which go first."""

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from itertools import chain, islice


class PagePool:
    """The free pages, the published index (block hash -> page), pins and the eviction order.

    Every page is in exactly one place: ``free`` (taken first, in order), a value of
    ``published`` (shared by block hash), or owned by one request (the cache's block maps; the
    pool does not track those). Pins are counted per hash, published yet or not. A published
    page whose hash has no pin is in ``evictable``, and ``evictable``'s order (oldest first)
    is the eviction order: ``allocate`` takes a free page, else the first evictable one.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.published: dict[bytes, int] = {}
        self.pins: Counter[bytes] = Counter()
        self.evictable: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0
        self.published_blocks = 0

    def allocate(self) -> int:
        if self.free:
            return self.free.popleft()
        block_hash, _ = self.evictable.popitem(last=False)
        self.evictions += 1
        return self.published.pop(block_hash)

    def next_pages(self, count: int, releasing: list[bytes]) -> tuple[list[int], list[bytes]]:
        """The pages the next ``count`` allocations will take, changing nothing, and the
        published hashes they evict; ``releasing`` are hashes that become evictable (in that
        order) before those allocations. The caller checks ``count`` is available."""
        from_free = list(islice(self.free, count))
        victims = list(islice(chain(self.evictable, releasing), count - len(from_free)))
        return from_free + [self.published[block_hash] for block_hash in victims], victims

    def released_by(self, unpins: Iterable[bytes]) -> list[bytes]:
        """Published hashes that ``unpin(unpins)`` would make evictable, in that order."""
        drops: Counter[bytes] = Counter()
        released = []
        for block_hash in unpins:
            drops[block_hash] += 1
            if drops[block_hash] == self.pins[block_hash] and block_hash in self.published:
                released.append(block_hash)
        return released

    def discard(self, hashes: list[bytes]) -> None:
        """Unpublish unpinned hashes whose pages' rows can no longer be trusted; free the pages."""
        for block_hash in hashes:
            self.evictable.pop(block_hash, None)
            self.free.append(self.published.pop(block_hash))

    def publish(self, block_hash: bytes, page: int) -> bool:
        """Publish ``page`` under ``block_hash`` and pin it once, unless the hash is published
        and pinned already (then the page stays a private duplicate: False). An unpinned
        published copy is replaced and its page freed, so a recomputed block holds one page."""
        stale_page = self.published.get(block_hash)
        if stale_page is not None:
            if block_hash not in self.evictable:
                return False
            self.free.append(stale_page)
        self.published[block_hash] = page
        self.published_blocks += 1
        self.pins[block_hash] += 1
        self.evictable.pop(block_hash, None)
        return True

    def unpublish(self, block_hash: bytes) -> None:
        """Take a published hash out of the index with the pin its publisher held; its page
        goes back to its owner (who frees it)."""
        del self.published[block_hash]
        self.unpin([block_hash])

    def pin(self, hashes: list[bytes]) -> None:
        self.pins.update(hashes)
        if self.evictable and not self.evictable.keys().isdisjoint(hashes):
            for block_hash in hashes:
                self.evictable.pop(block_hash, None)

    def unpin(self, hashes: Iterable[bytes]) -> None:
        """Drop one pin per hash; published hashes left unpinned become evictable in this order."""
        for block_hash in hashes:
            self.pins[block_hash] -= 1
            if self.pins[block_hash] == 0:
                del self.pins[block_hash]
                if block_hash in self.published:
                    self.evictable[block_hash] = None

    def problems(self, in_use: set[int], expected_pins: Counter) -> list[str]:
        """What breaks the invariant, given the pages requests own and the pins they hold."""
        free, problems = list(self.free), []
        in_use = in_use | set(self.published.values())
        if len(set(free)) != len(free) or set(free) & in_use:
            problems.append("a free page is also in use")
        if len(free) + len(in_use) != self.num_pages:
            problems.append(f"{self.num_pages - len(free) - len(in_use)} pages are in no state")
        if +self.pins != expected_pins:
            problems.append("pin counts differ from the requests' hashes plus retained hashes")
        if set(self.evictable) != {h for h in self.published if self.pins[h] == 0}:
            problems.append("the evictable set differs from the unpinned published keys")
        return problems
