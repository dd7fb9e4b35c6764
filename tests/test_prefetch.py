import threading

import pytest

from eaglet.train.prefetch import prefetched


def test_items_come_out_in_order_each_once():
    assert list(prefetched(iter(range(50)), lambda x: x * x, depth=3)) == [x * x for x in range(50)]


def test_an_error_in_the_thread_is_raised_at_its_item():
    def prepare(x):
        if x == 4:
            raise ValueError("bad item 4")
        return x

    seen = []
    with pytest.raises(ValueError, match="bad item 4"):
        for value in prefetched(iter(range(10)), prepare, depth=2):
            seen.append(value)
    assert seen == [0, 1, 2, 3]


def test_closing_early_stops_the_thread():
    """A training loop that stops mid-epoch (max steps, SIGTERM) must not leave a producer blocked behind it."""
    produced = []

    def endless():
        n = 0
        while True:
            produced.append(n)
            yield n
            n += 1

    batches = prefetched(endless(), lambda x: x, depth=2)
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
    batches.close()
    assert not any(t.name == "eaglet-batch-prefetch" for t in threading.enumerate())
    assert len(produced) <= 3 + 2 + 1  # read at most depth (+ the one in hand) ahead
