"""PagePool on its own: the eviction order, publication of duplicates and the allocation
look-ahead the cache relies on to copy rows before it changes any state."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from routed_experts_cache.connector.page_pool import PagePool


def published_pool(num_pages: int, hashes: list[bytes]) -> PagePool:
    """A pool whose first pages are published under ``hashes``, unpinned (evictable) in order."""
    pool = PagePool(num_pages)
    for block_hash in hashes:
        pool.publish(block_hash, pool.allocate())
        pool.unpin([block_hash])
    return pool


def test_free_pages_go_first_then_the_oldest_unpinned_published_page():
    pool = published_pool(3, [b"a", b"b"])
    assert list(pool.evictable) == [b"a", b"b"]
    assert pool.allocate() == 2  # the free page
    pool.pin([b"a"])  # a reader keeps b"a"
    assert pool.allocate() == 1 and pool.evictions == 1  # b"b", the only unpinned one
    assert pool.published == {b"a": 0} and not pool.evictable


def test_unpins_make_pages_evictable_in_unpin_order():
    pool = PagePool(3)
    for block_hash in (b"a", b"b", b"c"):
        pool.publish(block_hash, pool.allocate())
    pool.unpin([b"c", b"a", b"b"])  # a request's last block first: it is evicted first
    assert [pool.allocate() for _ in range(3)] == [2, 0, 1]


def test_a_pinned_published_hash_keeps_its_page_and_a_second_copy_stays_private():
    pool = PagePool(3)
    assert pool.publish(b"a", 0)
    assert not pool.publish(b"a", 1)  # pinned by its publisher: page 1 is a duplicate
    assert pool.published == {b"a": 0} and pool.pins[b"a"] == 1


def test_an_unpinned_published_hash_is_replaced_and_its_old_page_freed():
    pool = published_pool(2, [b"a"])
    pool.free.clear()  # page 1 is owned elsewhere, say by the request that recomputed b"a"
    assert pool.publish(b"a", 1)
    assert pool.published == {b"a": 1} and list(pool.free) == [0] and not pool.evictable


def test_unpublish_takes_the_publishers_pin_and_the_page_out_of_the_index():
    pool = PagePool(2)
    pool.publish(b"a", pool.allocate())
    pool.pin([b"a"])  # a reader
    pool.unpublish(b"a")
    assert pool.published == {} and pool.pins == Counter({b"a": 1}) and not pool.evictable


def test_discard_frees_pages_whose_rows_cannot_be_trusted():
    pool = published_pool(2, [b"a", b"b"])
    pool.discard([b"a"])
    assert pool.published == {b"b": 1} and list(pool.evictable) == [b"b"] and list(pool.free) == [0]


@settings(max_examples=200, deadline=None)
@given(
    num_pages=st.integers(1, 8),
    published=st.lists(st.sampled_from([b"a", b"b", b"c", b"d", b"e"]), unique=True, max_size=5),
    pinned=st.lists(st.sampled_from([b"a", b"b", b"c", b"d", b"e"]), max_size=8),
    unpins=st.lists(st.sampled_from([b"a", b"b", b"c", b"d", b"e"]), max_size=8),
)
def test_next_pages_names_exactly_what_the_allocations_after_the_unpins_take(num_pages, published, pinned, unpins):
    """The cache writes rows to ``next_pages`` before it unpins and allocates: both must agree."""
    published = published[:num_pages]
    pool = published_pool(num_pages, published)
    pool.pin(pinned)
    unpins = list((Counter(unpins) & pool.pins).elements())  # only pins that are held
    releasing = pool.released_by(unpins)
    count = len(pool.free) + len(pool.evictable) + len(releasing)
    pages, victims = pool.next_pages(count, releasing)
    pool.unpin(unpins)
    assert list(pool.evictable)[len(pool.evictable) - len(releasing) :] == releasing
    assert victims == list(pool.evictable)[: len(victims)]
    assert [pool.allocate() for _ in range(count)] == pages
    assert not pool.evictable and not pool.free
    assert len(set(pages)) == len(pages)
