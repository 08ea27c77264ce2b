"""The stream leases: a closed owner's streams go to the next owner, never to two live ones."""
import threading

from ainfer_pd.engine.runtime import stream_leases as sl


class FakeStream:
    made = 0

    def __init__(self):
        FakeStream.made += 1
        self.n = FakeStream.made


def test_take_makes_when_none_is_free_and_reuses_what_was_given_back():
    key = ("test-reuse", 0, 0)
    a, b = sl.take(key, FakeStream), sl.take(key, FakeStream)
    assert a is not b                                   # two live owners: two streams
    sl.give_back(key, a)
    sl.give_back(key, a)                                # a second give-back does not lend it twice
    assert sl.num_free(key) == 1
    assert sl.take(key, FakeStream) is a                # the next owner runs on the closed one's stream
    assert sl.num_free(key) == 0
    c = sl.take(key, FakeStream)
    assert c is not a and c is not b


def test_leases_are_kept_apart_by_key():
    k0, k1 = sl.cuda_stream_key(0, 0), sl.cuda_stream_key(0, -1)
    assert k0 != k1 and sl.green_stream_key(0, 64) != sl.green_stream_key(0, 32)
    s = sl.take(("test-keys", 1), FakeStream)
    sl.give_back(("test-keys", 1), s)
    assert sl.take(("test-keys", 2), FakeStream) is not s


def test_concurrent_owners_never_share_a_stream():
    key = ("test-threads", 0, 0)
    pool = [sl.take(key, FakeStream) for _ in range(4)]
    for s in pool:
        sl.give_back(key, s)
    got, lock = [], threading.Lock()

    def owner():
        for _ in range(200):
            s = sl.take(key, FakeStream)
            with lock:
                assert all(s is not g for g in got), "a stream leased to two live owners"
                got.append(s)
            with lock:
                got.remove(s)
            sl.give_back(key, s)
    ts = [threading.Thread(target=owner) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sl.num_free(key) >= 4
