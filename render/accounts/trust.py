"""Which peers may tell the worker a request's tier or account (`worker.trusted_proxies`).

A balancer that checked the client's key sets X-Turbonode-Account (and may set X-Turbonode-Tier);
the worker obeys those headers only from the balancer's addresses. From any other peer they
are ignored and counted, and logged once per peer address (a client sending them on every
request does not fill the log), never obeyed.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

REMEMBERED_PEERS = 4096  # peers already logged; the oldest is forgotten (and logged again) beyond


class TrustedProxies:
    def __init__(self, addresses: Iterable[str]):
        self.networks = tuple(ipaddress.ip_network(a, strict=False) for a in addresses)
        self._logged: collections.OrderedDict[str, None] = collections.OrderedDict()

    def trusts(self, peer: str | None) -> bool:
        if not self.networks or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer.split("%", 1)[0])  # an IPv6 zone is no part of the address
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
        return any(address in net for net in self.networks)

    def ignored(self, peer: str | None, headers: list[str]) -> None:
        """`peer` sent `headers` it may not: log it, the first time for this peer."""
        key = peer or "unknown"
        if key in self._logged:
            self._logged.move_to_end(key)
            return
        self._logged[key] = None
        while len(self._logged) > REMEMBERED_PEERS:
            self._logged.popitem(last=False)
        log.warning(
            "ignoring %s from %s: not in worker.trusted_proxies (logged once per peer; counted in "
            "turbonode_worker_untrusted_headers_total)",
            ", ".join(headers),
            key,
        )
