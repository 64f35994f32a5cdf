"""``lattica state`` shows each member's role as the member claims it: a table cell, whatever it wrote."""

from __future__ import annotations

import pytest

from lattica.cli.commands import _shown_role


@pytest.mark.parametrize(
    ("claimed", "shown"),
    [("failed", "failed"), ("joining", "joining"), (None, "-"), ("", "-"), (7, "-"),
     ("\x1b[2Jtrainer", "?[2Jtrainer"), ("é" * 40, "?" * 16)],
)
def test_a_claimed_role_is_shown_as_one_short_plain_cell(claimed: object, shown: str) -> None:
    assert _shown_role(claimed) == shown
