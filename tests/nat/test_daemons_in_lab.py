"""Real ``lattica join`` daemons in the NAT lab: a public node and one behind a NAT.

The NAT'd daemon joins through the public one's address; both list each other as connected
(so the public side reaches the NAT'd one over the connection the NAT'd one opened), and
AutoNAT tells the NAT'd daemon it is private (and never calls the public one private) — shown
by ``lattica status`` exactly as a user would read it. Control sockets live in the data dirs on
the shared file system, so the CLI is used from outside the namespaces.
"""

from __future__ import annotations

import sys

import pytest

from lattica.control import client
from lattica.errors import LatticaError
from lattica_lab.daemons import wait_for
from lattica_lab.netlab import NetLab

pytestmark = [pytest.mark.netns, pytest.mark.timeout(90), pytest.mark.usefixtures("netlab_available")]


def _join(lab: NetLab, host, data_dir, *peers: str):
    argv = [
        sys.executable, "-m", "lattica.cli.main", "join", "--data-dir", str(data_dir),
        "--listen", f"/ip4/{host.ip}/tcp/4001", "--metrics-addr", "off", "--bootstrap-timeout", "20",
    ]
    for peer in peers:
        argv += ["--peer", peer]
    return lab.spawn(host, argv, name=host.name, stderr_path=str(data_dir) + ".log")


def _call(data_dir, method: str):
    try:
        return client.call(data_dir / "control.sock", method, timeout=5.0)
    except LatticaError:
        return None


def _connected(data_dir) -> set[str]:
    return {p["peer_id"] for p in _call(data_dir, "peers") or [] if p["connected"]}


def test_nat_daemon_joins_public_daemon_and_learns_it_is_private(tmp_path):
    with NetLab() as lab:
        public = lab.add_public("pub")
        router = lab.add_nat("nat1")
        private = lab.add_private("priv", router)
        pub_dir, priv_dir = tmp_path / "pub", tmp_path / "priv"
        _join(lab, public, pub_dir)
        pub_id = wait_for(lambda: (_call(pub_dir, "id") or {}).get("peer_id"), timeout=30)
        assert pub_id, "public daemon did not come up"
        _join(lab, private, priv_dir, f"/ip4/{public.ip}/tcp/4001/p2p/{pub_id}")
        priv_id = wait_for(lambda: (_call(priv_dir, "id") or {}).get("peer_id"), timeout=30)
        assert priv_id, "NAT'd daemon did not come up"

        assert wait_for(lambda: priv_id in _connected(pub_dir), timeout=20)
        assert wait_for(lambda: pub_id in _connected(priv_dir), timeout=20)
        assert wait_for(lambda: (_call(priv_dir, "status") or {}).get("reachability") == "private", timeout=40), (
            _call(priv_dir, "status")
        )
        status = _call(pub_dir, "status") or {}
        assert status.get("reachability") != "private", status
        peers = {p["peer_id"]: p for p in _call(pub_dir, "peers")}
        assert peers[priv_id]["path"] == "direct"
