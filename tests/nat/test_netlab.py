"""The lab itself: NAT semantics are real, shaping applies, teardown leaves nothing behind."""

import subprocess
import sys

import pytest

from lattica_lab.netlab import NetLab, shape_link

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60), pytest.mark.usefixtures("netlab_available")]

SERVER = (
    "import socket,sys;s=socket.socket();s.bind(('0.0.0.0',9000));s.listen();print('up',flush=True);"
    "c,a=s.accept();print(a[0],flush=True)"
)


def _connect(lab, host, ip, timeout=1.5):
    code = f"import socket;socket.create_connection(('{ip}',9000),{timeout})"
    return subprocess.run(["ip", "netns", "exec", host.ns, sys.executable, "-c", code],
                          capture_output=True, timeout=10).returncode


def test_nat_masquerades_and_drops_unsolicited_inbound():
    with NetLab() as lab:
        pub = lab.add_public("pub")
        router = lab.add_nat("nat")
        priv = lab.add_private("priv", router)
        server = subprocess.Popen(["ip", "netns", "exec", pub.ns, sys.executable, "-c", SERVER],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            assert _connect(lab, priv, pub.ip) == 0
            assert server.stdout.readline().strip() == router.wan_ip  # seen as the router
        finally:
            server.kill()
            server.wait()
        inner = subprocess.Popen(["ip", "netns", "exec", priv.ns, sys.executable, "-c", SERVER],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert inner.stdout.readline().strip() == "up"
            assert _connect(lab, pub, router.wan_ip) != 0  # NAT drops unsolicited inbound
            assert _connect(lab, pub, priv.ip) != 0  # LAN is not routable from the internet
        finally:
            inner.kill()
            inner.wait()
        namespaces = list(lab.namespaces)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)


def test_shape_link_installs_tbf():
    with NetLab() as lab:
        host = lab.add_public("shaped")
        shape_link(host.ns, host.ifname, rate_mbit=50)
        out = lab.run_in(host, ["tc", "qdisc", "show", "dev", host.ifname])
        assert "tbf" in out
        assert "50Mbit" in out
        with pytest.raises(ValueError, match="rate_mbit"):
            shape_link(host.ns, host.ifname, rate_mbit=0)
