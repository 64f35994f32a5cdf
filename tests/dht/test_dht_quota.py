"""The store ledger (sans-IO): per-sender quotas, total bounds, fair eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lattica.dht.quota import Refusal, StoreLedger, StoreLimits

SMALL = StoreLimits(max_records=6, max_bytes=600, max_records_per_sender=3, max_bytes_per_sender=300)


def _ledger(limits: StoreLimits = SMALL) -> StoreLedger:
    return StoreLedger(limits)


def test_a_sender_is_refused_beyond_its_record_quota():
    ledger = _ledger()
    assert all(ledger.admit(("value", i), "a", 10).accepted for i in range(3))
    assert ledger.admit(("value", 3), "a", 10).refusal is Refusal.SENDER_QUOTA
    assert ledger.holdings("a") == (3, 30)
    assert ledger.admit(("value", 3), "b", 10).accepted  # others are not held to a's quota


def test_a_sender_is_refused_beyond_its_byte_quota():
    ledger = _ledger()
    assert ledger.admit(("value", 0), "a", 200).accepted
    assert ledger.admit(("value", 1), "a", 101).refusal is Refusal.SENDER_QUOTA
    assert ledger.admit(("value", 1), "a", 100).accepted


def test_a_record_larger_than_a_whole_quota_is_too_large():
    assert _ledger().admit(("value", 0), "a", 301).refusal is Refusal.TOO_LARGE


def test_replacing_an_own_entry_counts_it_once_and_makes_it_the_newest():
    ledger = _ledger(StoreLimits(max_records=3, max_bytes=600, max_records_per_sender=3, max_bytes_per_sender=300))
    for i in range(3):
        ledger.admit(("value", i), "a", 10)
    assert ledger.admit(("value", 0), "a", 50).accepted  # a re-announce at quota: allowed
    assert ledger.holdings("a") == (3, 70)
    # the store is full: b's record evicts a's oldest entry, which is now 1, not the refreshed 0
    admission = ledger.admit(("value", "b"), "b", 10)
    assert admission.evicted == (("value", 1),)


def test_a_full_store_evicts_the_oldest_entry_of_the_largest_holder():
    ledger = _ledger()
    for i in range(3):
        ledger.admit(("big", i), "big", 100)
    ledger.admit(("mid", 0), "mid", 150)
    ledger.admit(("small", 0), "small", 50)
    evicted: list[object] = []
    ledger.on_evict(evicted.append)
    admission = ledger.admit(("new", 0), "new", 150)  # 500 + 150 > 600
    assert admission.accepted
    assert admission.evicted == (("big", 0),) == tuple(evicted)
    assert ledger.bytes == 550
    # big holds 200, the most: a newcomer of 150 evicts big's next oldest entry
    admission = ledger.admit(("newer", 0), "newer", 150)
    assert admission.evicted == (("big", 1),)
    # mid, new and newer hold 150 each, more than big's 100: ties go to the smallest id
    assert ledger.admit(("newest", 0), "newest", 140).evicted == (("mid", 0),)
    assert ("small", 0) in ledger


def test_a_full_store_refuses_a_sender_that_would_hold_as_much_as_anyone():
    ledger = _ledger()
    for sender in "abc":
        ledger.admit((sender, 0), sender, 100)
        ledger.admit((sender, 1), sender, 100)
    assert ledger.check(("d", 0), "d", 100) is None  # d would hold 100 < 200: it may evict
    assert ledger.admit(("d", 0), "d", 100).accepted
    assert ledger.check(("a", 9), "a", 100) is Refusal.STORE_FULL  # a is now a largest holder
    assert ledger.admit(("a", 9), "a", 100).refusal is Refusal.STORE_FULL


def test_a_refused_record_puts_back_what_was_evicted_for_it():
    ledger = _ledger(StoreLimits(max_records=10, max_bytes=300, max_records_per_sender=10, max_bytes_per_sender=300))
    ledger.admit(("a", 0), "a", 100)
    ledger.admit(("a", 1), "a", 60)
    ledger.admit(("b", 0), "b", 140)
    # 300 + 150 > 300: evicting a's oldest (a: 160 > 150) frees 100, not enough; then b holds
    # 140, less than c's 150: refused, and a's entry is back, still a's oldest
    assert ledger.admit(("c", 0), "c", 150).refusal is Refusal.STORE_FULL
    assert ledger.records == 3
    assert ledger.bytes == 300
    assert ledger.admit(("d", 0), "d", 20).evicted == (("a", 0),)


def test_an_entry_replaced_by_another_sender_moves_to_that_sender():
    ledger = _ledger()
    ledger.admit(("value", "k"), "a", 100)
    assert ledger.admit(("value", "k"), "b", 40).accepted
    assert ledger.holdings("a") == (0, 0)
    assert ledger.holdings("b") == (1, 40)
    assert ledger.bytes == 40


def test_released_and_reconciled_entries_free_their_share():
    ledger = _ledger()
    for i in range(3):
        ledger.admit(("value", i), "a", 100)
    assert ledger.release(("value", 0))
    assert not ledger.release(("value", 0))
    assert ledger.reconcile([("value", 2)]) == 1
    assert ledger.holdings("a") == (1, 100)
    assert ledger.stats().senders == 1


def test_dropping_a_sender_evicts_all_its_entries_and_tells_the_stores():
    ledger = _ledger()
    evicted: list[object] = []
    ledger.on_evict(evicted.append)
    ledger.admit(("value", 0), "bad", 10)
    ledger.admit(("provider", b"k", "bad"), "bad", 10)
    ledger.admit(("value", 1), "good", 10)
    assert ledger.drop_sender("bad") == 2
    assert evicted == [("value", 0), ("provider", b"k", "bad")]
    assert ledger.entries() == [("value", 1)]


@pytest.mark.parametrize("field", ["max_records", "max_bytes", "max_records_per_sender", "max_bytes_per_sender"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        StoreLimits(**{field: 0})


def test_a_sender_quota_cannot_exceed_the_total():
    with pytest.raises(ValueError, match="must not exceed"):
        StoreLimits(max_records=4, max_records_per_sender=5)


_OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "admit", "release"]),
        st.integers(0, 7),  # sender
        st.integers(0, 11),  # entry
        st.integers(1, 160),  # cost
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(_OPERATIONS)
def test_bounds_hold_and_only_larger_holders_are_evicted(operations):
    ledger = _ledger()
    owner: dict[tuple[str, int], str] = {}  # the test's own model of who holds what
    for op, sender_n, entry, cost in operations:
        sender, key = f"s{sender_n}", ("value", entry)
        if op == "release":
            ledger.release(key)
            owner.pop(key, None)
            continue
        before = {f"s{n}": ledger.holdings(f"s{n}")[1] for n in range(8)}
        predicted = ledger.check(key, sender, cost)
        admission = ledger.admit(key, sender, cost)
        if predicted is not None:
            assert admission.refusal is predicted  # check never promises more than admit gives
        after_admitted = ledger.holdings(sender)[1]
        for evicted in admission.evicted:
            # whoever lost an entry held more than the newcomer holds with its record
            victim = owner.pop(evicted)
            assert victim != sender
            assert before[victim] > after_admitted
        if admission.accepted:
            owner[key] = sender
        assert set(owner) == set(ledger.entries())
        assert ledger.records <= SMALL.max_records
        assert ledger.bytes <= SMALL.max_bytes
        for n in range(8):
            records, held = ledger.holdings(f"s{n}")
            assert records <= SMALL.max_records_per_sender
            assert held <= SMALL.max_bytes_per_sender
        assert ledger.bytes == sum(ledger.holdings(f"s{n}")[1] for n in range(8))


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 40), st.integers(1, 60))
def test_a_flood_over_many_identities_never_evicts_a_member_holding_less(identities, cost):
    limits = StoreLimits(max_records=32, max_bytes=4096, max_records_per_sender=8, max_bytes_per_sender=1024)
    ledger = _ledger(limits)
    assert ledger.admit(("provider", "run", "member"), "member", 60).accepted
    for n in range(identities):
        for i in range(10):
            ledger.admit(("value", n, i), f"flood{n}", max(cost, 61))
    assert ("provider", "run", "member") in ledger
    assert ledger.records <= limits.max_records
    assert ledger.bytes <= limits.max_bytes
