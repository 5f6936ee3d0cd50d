"""Which network addresses an https adapter source may reach, and a resolver that holds every
connection to that rule.

A source URL comes from a registration, so its host (and every host it redirects to) is
untrusted: it could name the server's loopback, a private service or a cloud's metadata address
(169.254.169.254) and use the server's network position. Link-local, multicast and unspecified
addresses are never reached, nor is a cloud's metadata service at any of its addresses (also with
the operator's flag); loopback, private and other non-global ones only when the operator allows
them (a local mirror, tests). An IPv6 address that carries an IPv4 one (mapped, NAT64, 6to4) is
judged by the IPv4 address it reaches. The rule is applied to an IP literal before connecting and
to every address a name resolves to at connect time (:class:`CheckedResolver`), so a name that
resolves elsewhere the second time is held to it as well.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

ALLOW_FLAG = "--allow-private-adapter-sources"


# Cloud metadata services outside link-local space (AWS's IPv6 IMDS, Alibaba, Oracle's legacy one,
# AWS ECS's task metadata); refused even with ALLOW_FLAG, which is for mirrors, not metadata.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200", "192.0.0.192", "169.254.170.2")
)
# IPv6 prefixes whose last 32 bits are an IPv4 address a translator forwards to (RFC 6052, 8215).
NAT64_PREFIXES = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


class RefusedAddressError(OSError):
    """A source host is, or resolves to, an address sources may not reach; the message says which."""


def refusal(ip_text: str, allow_private: bool) -> str | None:
    """Why ``ip_text`` may not be reached (None: it may)."""
    try:
        ip = ipaddress.ip_address(ip_text.split("%", 1)[0])  # an IPv6 scope ("fe80::1%eth0") is no part of it
    except ValueError:
        return None  # a name: its addresses are checked when it is resolved
    ip = reached(ip)
    if ip in METADATA_ADDRESSES:
        return f"{ip} is a cloud metadata address, which adapter sources never reach"
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        return f"{ip} is a link-local, multicast or unspecified address, which adapter sources never reach"
    if not ip.is_global and not allow_private:
        kind = "loopback" if ip.is_loopback else "private or reserved"
        return (
            f"{ip} is a {kind} address; adapter sources reach only public addresses unless the server "
            f"is started with {ALLOW_FLAG}"
        )
    return None


def reached(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IPv4 address an IPv6 one delivers to (IPv4-mapped, 6to4, NAT64), else ``ip`` itself."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in prefix for prefix in NAT64_PREFIXES):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def check_host(host: str, allow_private: bool) -> None:
    """Refuse ``host`` when it is an IP literal sources may not reach (RefusedAddressError)."""
    if (why := refusal(host.strip("[]"), allow_private)) is not None:
        raise RefusedAddressError(why)


class CheckedResolver(AbstractResolver):
    """aiohttp's default resolver, refusing a name any of whose addresses sources may not reach
    (a name that answers with one public and one private address is refused whole)."""

    def __init__(self, allow_private: bool) -> None:
        self._inner = DefaultResolver()
        self._allow_private = allow_private

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
        found: list[ResolveResult] = await self._inner.resolve(host, port, family)
        for info in found:
            if (why := refusal(info["host"], self._allow_private)) is not None:
                raise RefusedAddressError(f"{host} resolves to {why}")
        return found

    async def close(self) -> None:
        await self._inner.close()
