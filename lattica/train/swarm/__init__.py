"""A trainer among its peers: membership, liveness, expert ownership, run config and identity,
and the outer state members publish, fetch, adopt and repair (joining and catching up)."""
