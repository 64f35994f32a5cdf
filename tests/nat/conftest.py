import pytest

from lattica_lab.netlab import lab_unavailable_reason


@pytest.fixture
def netlab_available() -> None:
    """Skip (with the reason) where namespaces cannot be built; CI has root and nft."""
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(f"NAT lab unavailable: {reason}")
