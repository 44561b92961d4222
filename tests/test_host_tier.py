"""The host tier: retained blocks leave the device only when it is full, reads gather their rows
from the host, and nothing is ever read wrong when the host evicts.

Every test runs on both copy backends (the ``backend`` fixture) and again under ``python -O``
(test_bad_input.py). Expected rows are the rows the test captured.
"""

import pytest
import torch
from conftest import copy_one_segment_at_a_time
from test_cache import assert_accounting, assert_rows, assert_unavailable, h, rand_rows, states, u8

from routed_experts_cache import CacheFullError, RoutedExpertsCacheError
from routed_experts_cache.connector import cache as cache_module


def finished_and_retained(cache, gen, tag, num_blocks, page_size=4):
    """A request's blocks, captured, published, finished and retained (as vLLM's scheduler
    retains a finished request's blocks); returns their rows."""
    rows = rand_rows(gen, num_blocks * page_size)
    hashes = [h(tag, i) for i in range(num_blocks)]
    cache.add_block_hashes(tag, hashes)
    cache.capture(tag, 0, rows)
    cache.finish(tag)
    cache.retain(hashes)
    return rows


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.int32], ids=str)  # uint16: torch has no index_put for it
def test_retained_blocks_go_to_the_host_only_when_the_device_is_full_and_read_back_exactly(make_cache, gen, dtype):
    cache = make_cache(4, host_pages=4, dtype=dtype)
    rows_a = finished_and_retained(cache, gen, "a", 4)
    assert cache.stats()["demoted"] == 0  # room on the device: nothing moves
    rows_b = rand_rows(gen, 8)
    cache.capture("b", 0, rows_b)  # two pages: the two oldest retained blocks go to the host
    stats = cache.stats()
    assert (stats["demoted"], stats["demotions"], stats["evictions"]) == (2, 2, 0)
    assert all(cache.is_published(h("a", i)) for i in range(4))
    assert_rows(cache.read("b", 0, 8), rows_b.to(dtype))
    cache.finish("b")
    # A prefix hit over a0..a3 reads host pages (a0, a1), device pages (a2, a3) and its own rows.
    cache.add_block_hashes("c", [h("a", i) for i in range(4)])
    rows_c = rand_rows(gen, 3)
    cache.capture("c", 16, rows_c)
    assert_rows(cache.read("c", 2, 19), torch.cat([rows_a[2:], rows_c]).to(dtype))
    assert cache.stats()["host_read_rows"] == 6
    packed, offsets = cache.read_batch(["c", "c", "c"], [0, 16, 9], [5, 19, 12])
    assert_rows(packed[offsets[0] : offsets[1]], rows_a[:5].to(dtype))
    assert_rows(packed[offsets[1] : offsets[2]], rows_c.to(dtype))
    assert_rows(packed[offsets[2] : offsets[3]], rows_a[9:12].to(dtype))
    assert_accounting(cache)


def test_a_request_pin_keeps_a_block_on_the_device_and_the_oldest_retained_block_goes_first(make_cache, gen):
    cache = make_cache(3, host_pages=3)
    finished_and_retained(cache, gen, "a", 3)
    cache.add_block_hashes("reader", [h("a", 0)])  # a live request reads a0: it stays on the device
    cache.capture("b", 0, rand_rows(gen, 4))
    assert cache.stats()["demoted"] == 1
    device_pages = set(cache.page_states())
    assert len(device_pages) == 3 and cache.stats()["published"] == 2  # a0 and a2 on the device, a1 on the host
    cache.capture("b", 4, rand_rows(gen, 4))
    assert cache.stats()["demoted"] == 2  # then a2; a0 never while pinned
    with pytest.raises(CacheFullError, match=r"host tier: 0 to demote of 3"):
        cache.capture("b", 8, rand_rows(gen, 4))
    assert_accounting(cache)


def test_an_import_that_demotes_a_retained_block_publishes_every_block_on_the_page_it_wrote(make_cache, gen):
    """A full device pool imports two blocks: one takes the free page, the other the page of a
    retained block, which moves to the host first. Each imported block must be published on the
    page its rows were copied to and the retained one on the host; before, the first imported
    block (unpinned, so evictable) was evicted for the second, and the retained block stayed
    published on a device page that now held imported rows: a wrong read, found by
    ``scripts/soak.sh``."""
    cache = make_cache(3, page_size=2, host_pages=1)
    rows_a = finished_and_retained(cache, gen, "a", 1, page_size=2)
    rows_b = rand_rows(gen, 1)
    cache.capture("b", 0, rows_b)  # a live request's tail page: one page left free
    imported = rand_rows(gen, 4)
    assert cache.import_blocks([h("z", 0), h("z", 1)], imported) == 2
    cache.add_block_hashes("c", [h("a", 0)])
    assert_rows(cache.read("c", 0, 2), u8(rows_a))  # from the host
    stats = cache.stats()
    assert (stats["demoted"], stats["demotions"], stats["evictions"], stats["free"]) == (1, 1, 0, 0)
    cache.add_block_hashes("d", [h("z", 0), h("z", 1)])
    assert_rows(cache.read("d", 0, 4), u8(imported))
    assert_rows(cache.read("b", 0, 1), u8(rows_b))
    assert_accounting(cache)


@pytest.mark.parametrize("by_row", [True, False], ids=["copies_by_row", "copies_segment_by_segment"])
def test_seeds_read_their_blocks_before_another_seed_overwrites_them(make_cache, gen, monkeypatch, by_row):
    """Two whole-prompt hits in one call: "y"'s first capture releases its seed block, whose page
    the allocation gives to "x"'s seed, so one seed copies onto the page another seed copies
    from. Every seed must read its rows before any is written, whatever order the copy's
    segments run in."""
    cache = make_cache(3, host_pages=2)
    if not by_row:
        monkeypatch.setattr(cache_module, "SMALL_COPY_ROWS", 0)  # every copy through the segment copy
        monkeypatch.setattr(cache, "_copy", copy_one_segment_at_a_time())
    rows = {tag: rand_rows(gen, 4) for tag in ("x", "y")}
    for tag in ("x", "y"):
        cache.capture(f"p{tag}", 0, rows[tag])
        cache.add_block_hashes(f"p{tag}", [h(tag, 0)])
        cache.finish(f"p{tag}")
    rows["r"] = finished_and_retained(cache, gen, "r", 1)  # demotable: the host tier gives the second new page
    cache.add_block_hashes("keep", [h("x", 0)])  # x's block stays pinned: not released by x
    cache.add_block_hashes("x", [h("x", 0)])
    cache.add_block_hashes("y", [h("y", 0)])
    assert states(cache, "free", "evictable") == dict(free=0, evictable=0)
    new_rows = rand_rows(gen, 2)
    cache.capture_batch(new_rows, ["x", "y"], [2, 3], [0, 1], [1, 1])  # seeds of 2 and 3 rows
    assert_rows(cache.read("x", 0, 3), u8(torch.cat([rows["x"][:2], new_rows[:1]])))
    assert_rows(cache.read("y", 0, 4), u8(torch.cat([rows["y"][:3], new_rows[1:]])))
    cache.add_block_hashes("c", [h("r", 0)])
    assert_rows(cache.read("c", 0, 4), u8(rows["r"]))
    assert_accounting(cache)


def test_released_host_blocks_are_evicted_when_the_host_needs_room_and_then_fail_closed(make_cache, gen):
    cache = make_cache(2, host_pages=2)
    rows_a = finished_and_retained(cache, gen, "a", 2)
    cache.capture("b", 0, rand_rows(gen, 8))  # both a blocks to the host
    assert cache.stats()["demoted"] == 2
    cache.release([h("a", 0)])  # the scheduler let a0 go: evictable on the host
    cache.finish("b")
    finished_and_retained(cache, gen, "x", 1)  # x0 on the device, retained
    cache.capture("d", 0, rand_rows(gen, 8))  # needs both device pages: x0 is demoted over a0
    assert not cache.is_published(h("a", 0)) and cache.is_published(h("a", 1)) and cache.is_published(h("x", 0))
    cache.add_block_hashes("e", [h("a", 0), h("a", 1)])
    assert_unavailable(cache, "e", 0, 8)  # a0's rows are gone: refused, never stale rows
    cache.add_block_hashes("f", [h("x", 99), h("a", 1)])
    cache.finish("f")
    cache.add_block_hashes("g", [h("a", 1)])  # a1 reached as block 0 of another prefix: its rows
    assert_rows(cache.read("g", 0, 4), u8(rows_a[4:8]))
    assert_accounting(cache)


def test_a_whole_prompt_hit_seeds_from_a_demoted_block(make_cache, gen):
    cache = make_cache(2, host_pages=2)
    rows_a = finished_and_retained(cache, gen, "a", 2)
    cache.capture("b", 0, rand_rows(gen, 8))  # a0, a1 to the host
    cache.finish("b")
    cache.add_block_hashes("c", [h("a", 0), h("a", 1)])
    recomputed = rand_rows(gen, 1)
    cache.capture("c", 7, recomputed)  # the last prompt token, inside a1 (on the host)
    assert_rows(cache.read("c", 0, 8), u8(torch.cat([rows_a[:7], recomputed])))
    assert_accounting(cache)


def test_a_recomputed_block_replaces_an_unpinned_host_copy_and_reset_empties_the_host(make_cache, gen):
    cache = make_cache(2, host_pages=2)
    finished_and_retained(cache, gen, "a", 2)
    cache.capture("b", 0, rand_rows(gen, 8))
    cache.finish("b")
    cache.release([h("a", 0), h("a", 1)])
    rows_c = rand_rows(gen, 4)
    cache.add_block_hashes("c", [h("a", 0)])
    cache.capture("c", 0, rows_c)  # c recomputes a0: its device copy replaces the host one
    assert cache.stats()["demoted"] == 1 and cache.stats()["published"] == 1
    cache.add_block_hashes("d", [h("a", 0)])
    assert_rows(cache.read("d", 0, 4), u8(rows_c))
    cache.reset()
    stats = cache.stats()
    assert (stats["demoted"], stats["published"], stats["free"]) == (0, 0, 2) and not cache.is_published(h("a", 1))
    assert_accounting(cache)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4", None])
def test_a_bad_host_size_is_refused(backend, bad):
    from routed_experts_cache import RoutedExpertsCache

    with pytest.raises(RoutedExpertsCacheError, match=r"host_pages must be an int >= 0"):
        RoutedExpertsCache(4, 4, (3, 2), backend=backend, host_pages=bad)
