"""PagePool on its own: the eviction order, publication of duplicates and the allocation
look-ahead the cache relies on to copy rows before it changes any state, and the invariant
check (`problems`) the property tests rely on: each invariant it states is reported when broken."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routed_experts_cache.connector.page_pool import PagePool


def published_pool(num_pages: int, hashes: list[bytes], host_pages: int = 0) -> PagePool:
    """A pool whose first pages are published under ``hashes``, unpinned (evictable) in order."""
    pool = PagePool(num_pages, host_pages)
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


HASHES = [b"a", b"b", b"c", b"d", b"e", b"f"]


@settings(max_examples=300, deadline=None)
@given(
    num_pages=st.integers(1, 8),
    host_pages=st.integers(0, 4),
    published=st.lists(st.sampled_from(HASHES), unique=True, max_size=6),
    retained=st.lists(st.sampled_from(HASHES), max_size=6),
    pinned=st.lists(st.sampled_from(HASHES), max_size=8),
    unpins=st.lists(st.sampled_from(HASHES), max_size=8),
    on_host=st.lists(st.sampled_from(HASHES), unique=True, max_size=4),
)
def test_next_pages_names_exactly_what_the_allocations_after_the_unpins_take(
    num_pages, host_pages, published, retained, pinned, unpins, on_host
):
    """The cache writes rows to ``next_pages`` (device pages, and the host pages of demoted
    blocks) before it unpins and allocates: both must agree, evictions and demotions included,
    also of blocks already on the host (``on_host``: demoted first, then evictable there)."""
    published = published[:num_pages]
    pool = published_pool(num_pages, published, host_pages)
    on_host = [h for h in on_host if h in pool.published]
    pool.retain(on_host)
    while pool.demotable and pool.room():  # the device fills (pages owned elsewhere) until they are demoted
        pool.allocate()
    pool.release(on_host)
    demotions_before, host_evictions_before = pool.demotions, pool.host_evictions
    pool.retain(retained)
    pool.pin(pinned)
    unpins = list((Counter(unpins) & (Counter(pool.pins) - Counter(pool.retained))).elements())  # only request pins that are held
    releasing = pool.released_by(unpins)
    count = pool.room(len(releasing))
    pages, victims, demotions = pool.next_pages(count, releasing)
    demoted = list(pool.demotable)[: len(demotions)]
    host_victims = list(pool.host_evictable)[: max(0, len(demotions) - len(pool.host_free))]
    pool.unpin(unpins)
    assert list(pool.evictable)[len(pool.evictable) - len(releasing) :] == releasing
    assert victims[: len(pages) - len(demotions)] == list(pool.evictable)[: len(pages) - len(demotions)]
    assert victims[len(pages) - len(demotions) :] == host_victims  # the demotions' host pages, once free ones ran out
    assert [pool.allocate() for _ in range(count)] == pages
    assert pool.published.keys().isdisjoint(victims) and pool.host_evictions - host_evictions_before == len(host_victims)
    assert [(pages[len(pages) - len(demotions) + i], pool.published[h]) for i, h in enumerate(demoted)] == demotions
    assert not pool.evictable and not pool.free
    assert len(set(pages)) == len(pages) and all(page < num_pages for page in pages)
    assert pool.demotions - demotions_before == len(demotions) and all(pool.on_host(pool.published[h]) for h in demoted)


def test_a_demotion_takes_a_free_host_page_before_it_evicts_a_block_on_the_host():
    pool = PagePool(2, host_pages=2)
    pool.publish(b"h", pool.allocate())
    pool.retain([b"h"])
    pool.unpin([b"h"])
    assert [pool.allocate(), pool.allocate()] == [1, 0]  # the second demotes b"h" to host page 2
    pool.release([b"h"])  # evictable on the host; host page 3 is free
    pool.publish(b"r", 0)
    pool.retain([b"r"])
    pool.unpin([b"r"])
    assert pool.next_pages(1, []) == ([0], [], [(0, 3)])  # b"h" stays: no victim
    assert pool.allocate() == 0 and pool.published == {b"h": 2, b"r": 3} and pool.host_evictions == 0


def test_a_retained_block_is_demoted_only_when_the_device_is_full_and_comes_back_evictable_on_the_host():
    pool = published_pool(2, [b"a", b"b"], host_pages=1)
    pool.retain([b"a"])
    assert list(pool.demotable) == [b"a"] and list(pool.evictable) == [b"b"]
    assert pool.allocate() == 1  # b"b" is evicted first: it is not retained
    assert pool.allocate() == 0 and pool.published == {b"a": 2} and pool.demotions == 1  # b"a" to the host page
    pool.pin([b"a"])  # a request reads it there: pinned, not evictable
    pool.release([b"a"])
    assert not pool.host_evictable and not pool.demotable
    pool.unpin([b"a"])
    assert list(pool.host_evictable) == [b"a"]
    assert pool.publish(b"a", 1) and pool.published == {b"a": 1} and list(pool.host_free) == [2]  # recomputed


def test_a_block_on_the_host_retained_again_leaves_the_host_eviction_order():
    pool = published_pool(1, [b"a"], host_pages=1)
    pool.retain([b"a"])
    assert pool.allocate() == 0 and pool.published == {b"a": 1}  # demoted to the host page
    pool.release([b"a"])
    assert list(pool.host_evictable) == [b"a"]
    pool.retain([b"a", b"a"])  # the scheduler keeps it again: not evictable, and no device page to demote
    assert not pool.host_evictable and not pool.demotable and pool.room() == 0
    assert not pool.problems({0}, Counter({b"a": 2}))


def test_a_block_on_the_first_host_page_left_with_retains_only_is_not_demotable():
    """A retained block demoted to the host (to page ``num_pages``, the first host page), read
    there by a request: once the request unpins it, only the retain holds it, and a block on
    the host has no device page to free: it joins no order."""
    pool = published_pool(1, [b"a"], host_pages=1)
    pool.retain([b"a"])
    assert pool.allocate() == 0 and pool.published == {b"a": 1}  # demoted to host page 1
    pool.pin([b"a"])
    pool.unpin([b"a"])
    assert not pool.demotable and not pool.evictable and not pool.host_evictable
    assert not pool.problems({0}, Counter({b"a": 1}))


def test_a_request_pin_makes_a_retained_block_stay_on_the_device():
    pool = published_pool(1, [b"a"], host_pages=1)
    pool.retain([b"a"])
    pool.pin([b"a"])
    assert not pool.demotable and pool.room() == 0
    pool.unpin([b"a"])
    assert list(pool.demotable) == [b"a"] and pool.room() == 1


def pool_state(pool: PagePool) -> tuple:
    return (list(pool.free), list(pool.host_free), pool.published, pool.pins, pool.retained, list(pool.evictable),
            list(pool.host_evictable), list(pool.demotable))


OPS = st.lists(st.tuples(
    st.sampled_from(["publish", "pin", "unpin", "retain", "release", "allocate"]),
    st.lists(st.sampled_from(HASHES), max_size=5),
), max_size=30)


@settings(max_examples=400, deadline=None)
@given(num_pages=st.integers(1, 6), host_pages=st.integers(0, 3), ops=OPS)
def test_lists_of_hashes_change_the_pool_as_their_hashes_one_by_one(num_pages, host_pages, ops):
    """Publishes, pins, unpins, retains and releases of a list leave the pool as the same calls
    hash by hash do, orders included: the contract a bulk implementation of them must keep."""
    bulk, single = PagePool(num_pages, host_pages), PagePool(num_pages, host_pages)
    request_pins: Counter = Counter()  # what a request holds: unpins take only those
    for op, hashes in ops:
        if op == "publish":  # a list as a step settles it: repeated and published hashes too
            hashes = hashes[: bulk.room()]
            pages = [bulk.allocate() for _ in hashes]
            assert [single.allocate() for _ in hashes] == pages
            bulk.publish_many(hashes, pages)
            request_pins.update(h for h, page in zip(hashes, pages) if single.publish(h, page))  # publishers' pins
            assert pool_state(bulk) == pool_state(single)
            continue
        if op == "allocate":
            if bulk.room():
                assert bulk.allocate() == single.allocate()
            continue
        if op == "unpin":
            hashes = list((Counter(hashes) & request_pins).elements())
            request_pins.subtract(hashes)
        elif op == "release":
            hashes = list((Counter(hashes) & Counter(bulk.retained)).elements())
        elif op == "pin":
            request_pins.update(hashes)
        getattr(bulk, op)(hashes)
        for block_hash in hashes:
            getattr(single, op)([block_hash])
        assert pool_state(bulk) == pool_state(single)
        assert not bulk.problems(set(range(num_pages)) - set(bulk.free) - set(bulk.published.values()),
                                 +request_pins + Counter(bulk.retained))


def test_a_hash_pinned_and_published_in_one_step_goes_in_the_order_of_the_calls():
    """A hash pinned by one request and published by another in one ``add_block_hashes_batch``:
    the order of the calls decides whether the recomputed page is published or stays a
    duplicate, as with the calls one by one (a batched implementation must keep it)."""
    import torch

    from routed_experts_cache import RoutedExpertsCache

    hashes_of = {"reader": [b"x"], "recomputer": [b"x"], "late_reader": [b"y"]}  # a pin after both
    for order, duplicates in (
        (["reader", "recomputer"], 1), (["recomputer", "reader"], 0), (["reader", "recomputer", "late_reader"], 1),
    ):
        cache = RoutedExpertsCache(4, 4, (2,))
        cache.add_block_hashes("first", [b"x"])
        cache.capture("first", 0, torch.zeros(4, 2, dtype=torch.uint8))
        cache.finish("first")  # b"x" published, unpinned
        cache.capture("recomputer", 0, torch.ones(4, 2, dtype=torch.uint8))  # its block 0, no hash yet
        cache.add_block_hashes_batch(order, [hashes_of[name] for name in order])
        assert cache.stats()["duplicate"] == duplicates, order
        cache.check_consistency()


def test_a_host_eviction_counts_in_evictions_and_in_host_evictions():
    pool = published_pool(1, [b"a"], host_pages=1)
    pool.retain([b"a"])
    assert pool.allocate() == 0 and pool.published == {b"a": 1}  # b"a" demoted to the host page
    pool.release([b"a"])  # evictable on the host now
    pool.publish(b"b", 0)
    pool.retain([b"b"])
    pool.unpin([b"b"])  # the publisher's pin: b"b" is retained only, so demotable
    assert pool.allocate() == 0  # demotes b"b" onto the host page b"a" held: a host eviction
    assert pool.published == {b"b": 1}
    assert (pool.evictions, pool.host_evictions, pool.demotions) == (1, 1, 2)


def test_discarding_a_block_on_the_host_frees_its_host_page_and_leaves_the_host_eviction_order():
    """A failed copy discards the host victims ``next_pages`` named: their pages go back to the
    host free list, and the next demotion takes one there (a stale entry left in the host
    order would be taken again, as a hash no longer published)."""
    pool = published_pool(1, [b"a"], host_pages=1)
    pool.retain([b"a"])
    pool.allocate()  # b"a" demoted to host page 1
    pool.release([b"a"])
    assert list(pool.host_evictable) == [b"a"]
    pool.discard([b"a"])
    assert pool.published == {} and not pool.host_evictable and list(pool.host_free) == [1]
    pool.publish(b"b", 0)
    pool.retain([b"b"])
    pool.unpin([b"b"])
    assert pool.allocate() == 0 and pool.published == {b"b": 1} and pool.host_evictions == 0
    assert not pool.problems({0}, Counter({b"b": 1}))


def healthy_pool() -> PagePool:
    """Device pages 0-3, host pages 4-5: b"a" on page 0 pinned by a request, b"b" on 1
    evictable, b"r" on 2 retained only (demotable), page 3 owned by a request; b"h" demoted to
    host page 4, evictable there; host page 5 free."""
    pool = PagePool(4, host_pages=2)
    pool.publish(b"h", pool.allocate())
    pool.retain([b"h"])
    pool.unpin([b"h"])
    assert [pool.allocate() for _ in range(4)] == [1, 2, 3, 0]  # the last one demotes b"h"
    pool.release([b"h"])
    pool.publish(b"a", 0)
    pool.publish(b"b", 1)
    pool.unpin([b"b"])
    pool.publish(b"r", 2)
    pool.retain([b"r"])
    pool.unpin([b"r"])
    return pool


IN_USE, PINS = {3}, Counter({b"a": 1, b"r": 1})


def move_to_device_order(pool: PagePool) -> None:
    """The host block listed in the device's eviction order: the union of both orders is right."""
    del pool.host_evictable[b"h"]
    pool.evictable[b"h"] = None


@pytest.mark.parametrize("problem, corrupt, in_use", [
    ("two hashes share a page", lambda pool: pool.published.__setitem__(b"z", 0), IN_USE),
    ("a request owns a host page", lambda pool: None, IN_USE | {5}),
    ("a free page is also in use", lambda pool: pool.free.append(1), IN_USE),
    ("1 pages are in no state", lambda pool: pool.host_free.clear(), IN_USE),
    ("pin counts differ", lambda pool: pool.pins.__setitem__(b"a", 2), IN_USE),
    ("the evictable sets differ", lambda pool: pool.evictable.pop(b"b"), IN_USE),
    ("the evictable sets differ", move_to_device_order, IN_USE),
    ("the demotable set differs", lambda pool: pool.demotable.pop(b"r"), IN_USE),
])
def test_the_invariant_check_reports_each_way_the_pool_can_break(problem, corrupt, in_use):
    """``problems`` is the oracle of the property tests: each invariant it states, once broken,
    is reported."""
    pool = healthy_pool()
    assert pool.problems(IN_USE, PINS) == []
    corrupt(pool)
    assert any(problem in line for line in pool.problems(in_use, PINS)), pool.problems(in_use, PINS)
