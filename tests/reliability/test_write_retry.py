"""When a write that keeps failing (a full disk) is tried again, and which failure is reported."""

from __future__ import annotations

import pytest

from lattica.files import WriteRetry


def test_a_failing_write_is_retried_after_a_doubling_backoff_up_to_its_cap() -> None:
    retry = WriteRetry(first_s=1.0, max_s=4.0)
    assert retry.due(0.0)
    waits = []
    now = 0.0
    for _ in range(5):
        retry.failed("disk full", now)
        waits.append(retry.wait_s(now))
        assert not retry.due(now + waits[-1] - 0.01)
        now += waits[-1]
        assert retry.due(now)
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_only_the_first_failure_of_a_run_is_news_and_a_success_ends_the_run() -> None:
    retry = WriteRetry()
    assert retry.failed("disk full (0 B free)", 0.0)
    assert not retry.failed("disk full (12 B free)", 1.0)
    assert retry.error == "disk full (12 B free)"
    assert retry.succeeded()
    assert retry.error is None
    assert retry.due(1.0)
    assert not retry.succeeded()  # nothing was failing
    assert retry.failed("disk full", 2.0)  # a new run of failures
    assert retry.wait_s(2.0) == 1.0  # starts over at the first backoff


@pytest.mark.parametrize(("first_s", "max_s"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_a_backoff_that_cannot_work_is_refused(first_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="first_s"):
        WriteRetry(first_s=first_s, max_s=max_s)
