"""Page ids of the pool and its host tier: which are free, which hold a published block, which go
first when a page is needed."""

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from itertools import chain, islice


def count_into(counts: dict, items: Iterable) -> None:
    """Add one to ``counts[item]`` per item. Pins are plain dicts, not ``Counter``s: CPython
    (3.11 on) specializes subscripts of exact dicts only, which makes ``unpin``'s loop over a
    finishing request's hashes 2.7x faster than on a ``Counter``."""
    get = counts.get
    for item in items:
        counts[item] = get(item, 0) + 1


class PagePool:
    """The free pages, the published index (block hash -> page), pins, the eviction order and the
    demotion order, for the device pool and its host tier.

    Device pages are ``0 .. num_pages - 1``, host pages ``num_pages .. num_pages + host_pages -
    1``. Every page is in exactly one place: a free list (``free``, ``host_free``), a value of
    ``published`` (shared by block hash; a host page holds a block demoted from the device), or
    owned by one request (device pages only; the cache's block maps do not live here). Pins are
    counted per hash, published yet or not; ``retained`` counts the pins ``retain`` took.

    Orders, oldest first: a published hash without pins is in ``evictable`` (device) or
    ``host_evictable`` (host); a device-published hash whose every pin is a retain is in
    ``demotable``. ``allocate`` takes a free page, else evicts the first evictable one, else
    demotes the first demotable block to a host page (a free one, else the first host-evictable
    one) and takes its device page: a block the scheduler retains leaves the device only when
    the device is full, and no live request reads it there.
    """

    def __init__(self, num_pages: int, host_pages: int = 0) -> None:
        self.num_pages = num_pages
        self.host_pages = host_pages
        self.free: deque[int] = deque(range(num_pages))
        self.host_free: deque[int] = deque(range(num_pages, num_pages + host_pages))
        self.published: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}  # plain dicts, no zero counts: see ``count_into``
        self.retained: dict[bytes, int] = {}
        self.evictable: OrderedDict[bytes, None] = OrderedDict()
        self.host_evictable: OrderedDict[bytes, None] = OrderedDict()
        self.demotable: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0  # device and host
        self.host_evictions = 0
        self.demotions = 0
        self.published_blocks = 0

    def on_host(self, page: int) -> bool:
        return page >= self.num_pages

    def allocate(self) -> int:
        """A device page: free, else evicted, else freed by demoting its block to the host."""
        if self.free:
            return self.free.popleft()
        if self.evictable:
            block_hash, _ = self.evictable.popitem(last=False)
            self.evictions += 1
            return self.published.pop(block_hash)
        block_hash, _ = self.demotable.popitem(last=False)
        page = self.published[block_hash]
        self.published[block_hash] = self._host_page()
        self.demotions += 1
        return page

    def allocate_many(self, count: int) -> list[int]:
        """``allocate()`` ``count`` times: the free pages, then the oldest evictable ones (a
        plain pop per page for either), then ``allocate`` for demotions."""
        free = self.free
        if count <= len(free):
            return [free.popleft() for _ in range(count)]
        pages = list(free)
        free.clear()
        evicted = min(count - len(pages), len(self.evictable))
        if evicted:
            evictable, published = self.evictable, self.published
            pages += [published.pop(evictable.popitem(last=False)[0]) for _ in range(evicted)]
            self.evictions += evicted
        pages += [self.allocate() for _ in range(count - len(pages))]
        return pages

    def _host_page(self) -> int:
        if self.host_free:
            return self.host_free.popleft()
        block_hash, _ = self.host_evictable.popitem(last=False)
        self.evictions += 1
        self.host_evictions += 1
        return self.published.pop(block_hash)

    def room(self, releasing: int = 0) -> int:
        """Device pages the next allocations can take (``releasing``: hashes about to become evictable)."""
        return len(self.free) + len(self.evictable) + releasing + min(
            len(self.demotable), len(self.host_free) + len(self.host_evictable)
        )

    def next_pages(self, count: int, releasing: list[bytes]) -> tuple[list[int], list[bytes], list[tuple[int, int]]]:
        """What the next ``count`` allocations will do, changing nothing: the device pages they
        take, the published hashes they evict (device and host), and the demotions ``(device
        page, host page)`` whose rows must reach the host first. ``releasing``: hashes that
        become evictable (in that order) before those allocations. The caller checks ``room``."""
        from_free = list(islice(self.free, count))
        if len(from_free) == count:  # the common case: enough free pages
            return from_free, [], []
        victims = list(islice(chain(self.evictable, releasing), count - len(from_free)))
        pages = from_free + [self.published[block_hash] for block_hash in victims]
        demoted = list(islice(self.demotable, count - len(pages)))
        host_pages = list(islice(self.host_free, len(demoted)))
        host_victims = list(islice(self.host_evictable, len(demoted) - len(host_pages)))
        host_pages += [self.published[block_hash] for block_hash in host_victims]
        demotions = [(self.published[block_hash], host_page) for block_hash, host_page in zip(demoted, host_pages)]
        return pages + [device_page for device_page, _ in demotions], victims + host_victims, demotions

    def released_by(self, unpins: Iterable[bytes]) -> list[bytes]:
        """Device-published hashes that ``unpin(unpins)`` would make evictable, in that order."""
        drops: Counter[bytes] = Counter()
        released = []
        for block_hash in unpins:
            drops[block_hash] += 1
            page = self.published.get(block_hash)
            if drops[block_hash] == self.pins.get(block_hash, 0) and page is not None and not self.on_host(page):
                released.append(block_hash)
        return released

    def discard(self, hashes: list[bytes]) -> None:
        """Unpublish unpinned hashes whose pages' rows can no longer be trusted; free the pages."""
        for block_hash in hashes:
            page = self.published.pop(block_hash)
            if self.on_host(page):
                self.host_evictable.pop(block_hash, None)
                self.host_free.append(page)
            else:
                self.evictable.pop(block_hash, None)
                self.free.append(page)

    def publish(self, block_hash: bytes, page: int) -> bool:
        """Publish ``page`` under ``block_hash`` and pin it once, unless the hash is published
        and pinned already (then the page stays a private duplicate: False). An unpinned
        published copy (device or host) is replaced and its page freed, so a recomputed block
        holds one page."""
        stale_page = self.published.get(block_hash)
        if stale_page is not None:
            if self.pins.get(block_hash):
                return False
            if self.on_host(stale_page):
                del self.host_evictable[block_hash]
                self.host_free.append(stale_page)
            else:
                del self.evictable[block_hash]
                self.free.append(stale_page)
        self.published[block_hash] = page
        self.published_blocks += 1
        self.pins[block_hash] = self.pins.get(block_hash, 0) + 1
        return True

    def publish_many(self, hashes: list[bytes], pages: list[int]) -> None:
        """``publish`` each pair in order: dict updates when none of the hashes is published
        yet (a step's newly full blocks, the common case; where two requests complete the same
        block, the first pair publishes and pins it and the later ones change nothing, as
        ``publish`` would), else ``publish`` inlined for new hashes and for pinned ones
        (duplicates: nothing changes), and called for the rest."""
        published, pins = self.published, self.pins
        if published.keys().isdisjoint(hashes):
            if len(set(hashes)) < len(hashes):  # each hash's first page (reversed: the first pair is written last)
                first_page = dict(zip(reversed(hashes), reversed(pages)))
                hashes = list(dict.fromkeys(hashes))
                pages = list(map(first_page.__getitem__, hashes))
            published.update(zip(hashes, pages))
            count_into(pins, hashes)
            self.published_blocks += len(hashes)
            return
        for block_hash, page in zip(hashes, pages):  # hashes published before: duplicates, recomputed blocks
            if block_hash not in published:
                published[block_hash] = page
                pins[block_hash] = pins.get(block_hash, 0) + 1
                self.published_blocks += 1
            elif not pins.get(block_hash):
                self.publish(block_hash, page)

    def unpublish(self, block_hash: bytes) -> None:
        """Take a published hash out of the index with the pin its publisher held; its page
        goes back to its owner (who frees it)."""
        del self.published[block_hash]
        self.unpin([block_hash])

    def pin(self, hashes: list[bytes]) -> None:
        """A request's pins: its hashes are neither evictable nor demotable while it holds them."""
        count_into(self.pins, hashes)
        for order in (self.evictable, self.host_evictable, self.demotable):
            if order and not order.keys().isdisjoint(hashes):
                for block_hash in hashes:
                    order.pop(block_hash, None)

    def unpin(self, hashes: Iterable[bytes]) -> None:
        """Drop one pin per hash; published hashes left unpinned become evictable in this order,
        device-published ones left with retains only become demotable."""
        pins, published, evictable, retained = self.pins, self.published, self.evictable, self.retained
        num_pages, demotable = self.num_pages, self.demotable
        for block_hash in hashes:
            left = pins[block_hash] - 1
            if left:
                pins[block_hash] = left
                # Still pinned, so in no order, unless every pin left is a retain (a pin held
                # before this one was, so no order held it unless a release is dropping it).
                if retained and left == retained.get(block_hash):
                    page = published.get(block_hash)
                    if page is not None and page < num_pages:
                        demotable.setdefault(block_hash, None)
                continue
            del pins[block_hash]
            page = published.get(block_hash)
            if page is None:
                continue
            if page < num_pages:  # ``_place`` of an unpinned device page, inlined
                if demotable:  # a hash whose retains were just released may be there
                    demotable.pop(block_hash, None)
                evictable[block_hash] = None
            else:
                self._place(block_hash)

    def retain(self, hashes: list[bytes]) -> None:
        """The scheduler's pins. A published hash held by retains alone goes to the demotion
        order on the device and leaves the host's eviction order. One pass, each hash's entries
        looked up once (the pool's dicts are large: a lookup is mostly a cache miss); ``held -
        retains`` stays the same while a hash is counted, so each occurrence compares as the
        last would, and the places are those of counting first and placing after."""
        retained, pins, published = self.retained, self.pins, self.published
        retained_get, pins_get = retained.get, pins.get
        for block_hash in hashes:
            retains = retained_get(block_hash, 0) + 1
            retained[block_hash] = retains
            held = pins_get(block_hash, 0) + 1
            pins[block_hash] = held
            if held == retains and block_hash in published:  # else pinned by a request too: in no order
                self._place(block_hash)

    def release(self, hashes: list[bytes]) -> None:
        """Drop retains (the caller checked they exist), in this order."""
        for block_hash in hashes:
            self.retained[block_hash] -= 1
            if not self.retained[block_hash]:
                del self.retained[block_hash]
        self.unpin(hashes)

    def _place(self, block_hash: bytes) -> None:
        """Put a published hash in the order its pins call for (appended: the newest)."""
        page = self.published.get(block_hash)
        if page is None:
            return
        pins = self.pins.get(block_hash, 0)
        on_host = self.on_host(page)
        if not pins:
            self.demotable.pop(block_hash, None)
            (self.host_evictable if on_host else self.evictable)[block_hash] = None
        elif not on_host and pins == self.retained.get(block_hash):
            self.evictable.pop(block_hash, None)
            self.demotable.setdefault(block_hash, None)
        else:
            self.demotable.pop(block_hash, None)
            (self.host_evictable if on_host else self.evictable).pop(block_hash, None)

    def problems(self, in_use: set[int], expected_pins: Counter) -> list[str]:
        """What breaks the invariant, given the device pages requests own and the pins they hold."""
        problems = []
        num_pages = self.num_pages
        published = set(self.published.values())
        host_used = {page for page in published if page >= num_pages}
        if len(published) != len(self.published):
            problems.append("two hashes share a page")
        if in_use & host_used or max(in_use, default=-1) >= num_pages:
            problems.append("a request owns a host page")
        for free, used, first, count in (
            (list(self.free), in_use | (published - host_used), 0, num_pages),
            (list(self.host_free), host_used, num_pages, self.host_pages),
        ):
            if len(set(free)) != len(free) or set(free) & used:
                problems.append("a free page is also in use")
            pages = (*free, *used)
            if len(pages) != count or pages and (min(pages) < first or max(pages) >= first + count):
                problems.append(f"{count - len(free) - len(used)} pages are in no state")
        pinned = Counter(self.pins)
        if pinned != expected_pins:
            problems.append("pin counts differ from the requests' hashes plus retained hashes")
        unpinned = self.published.keys() - pinned.keys()
        if self.evictable.keys() | self.host_evictable.keys() != unpinned or self.host_evictable.keys() != {
            h for h in unpinned if self.published[h] >= num_pages
        }:
            problems.append("the evictable sets differ from the unpinned published keys")
        if self.demotable.keys() != {  # pinned only by retains: a retained hash, as many pins as retains
            h for h, retains in self.retained.items()
            if retains > 0 and self.published.get(h, num_pages) < num_pages and pinned[h] == retains
        }:
            problems.append("the demotable set differs from the device-published keys pinned only by retains")
        return problems
