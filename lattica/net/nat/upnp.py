"""UPnP IGD port mapping: ask the LAN gateway to forward our TCP listen port.

Default: off (``--upnp`` turns it on). UPnP discovery multicasts SSDP on the LAN and waits up to
``discover_timeout`` seconds; on cloud VMs and most rented GPUs there is no gateway to answer,
and the blocking miniupnpc calls run in a worker thread. When a gateway maps the port, the
mapped ``/ip4/<external>/tcp/<port>`` is returned so the daemon can announce it; the mapping
is removed when ``run`` ends. Known static forwards need no UPnP: pass ``--announce``.
"""

from __future__ import annotations

import logging

import trio
from multiaddr import Multiaddr
from trio_typing import TaskStatus

logger = logging.getLogger(__name__)


class PortMapper:
    def __init__(self, port: int, *, discover_timeout: float = 3.0) -> None:
        if not 0 < port < 65536:
            raise ValueError("port must be in 1..65535")
        self._port = port
        self._timeout = discover_timeout
        self.external_addr: Multiaddr | None = None

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            from libp2p.discovery.upnp.upnp import UpnpManager
        except ImportError:  # miniupnpc missing
            logger.info("UPnP unavailable: miniupnpc is not installed")
            task_status.started()
            await trio.sleep_forever()
            return
        manager = UpnpManager()
        mapped = False
        try:
            with trio.move_on_after(self._timeout):
                if await manager.discover() and await manager.add_port_mapping(self._port, "TCP"):
                    mapped = True
                    ip = manager.get_external_ip()
                    if ip:
                        self.external_addr = Multiaddr(f"/ip4/{ip}/tcp/{self._port}")
            logger.info("UPnP mapping: %s", self.external_addr or "none (no gateway answered)")
            task_status.started()
            await trio.sleep_forever()
        finally:
            if mapped:
                with trio.move_on_after(2), trio.CancelScope(shield=True):
                    await manager.remove_port_mapping(self._port, "TCP")
