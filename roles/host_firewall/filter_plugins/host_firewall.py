"""The addresses host_firewall lets in: inventory hosts and CIDRs, checked and split by family.

An inventory host's address is its `sparkple_firewall_address` (one address or a list), else its
`ansible_host` or inventory name where that is an IP address, else the IPv4 address of its
default route from gathered facts. A host with none of those is refused by name: nftables takes
addresses, and a name resolved once at load time would silently go stale.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _network(value: Any, what: str) -> Network:
    try:
        return ipaddress.ip_network(str(value).strip(), strict=False)
    except ValueError:
        raise AnsibleFilterError(
            f"host_firewall: {what} is {value!r}: use an IP address or a CIDR (10.0.0.0/24)"
        ) from None


def _address(value: Any) -> str | None:
    try:
        return str(ipaddress.ip_address(str(value).strip()))
    except ValueError:
        return None


def host_addresses(host: str, hostvars: Mapping[str, Any]) -> list[str]:
    """The addresses one inventory host connects from (see the module's docstring)."""
    hv = hostvars[host]
    explicit = hv.get("sparkple_firewall_address")
    if explicit:
        values = [explicit] if isinstance(explicit, str) else list(explicit)
        return [str(_network(v, f"{host}'s sparkple_firewall_address")) for v in values]
    for candidate in (hv.get("ansible_host"), host):
        address = _address(candidate) if candidate else None
        if address:
            return [address]
    facts = hv.get("ansible_facts") or {}
    gathered = (facts.get("default_ipv4") or {}).get("address") or (
        hv.get("ansible_default_ipv4") or {}
    ).get("address")
    if gathered and _address(gathered):
        return [str(_address(gathered))]
    raise AnsibleFilterError(
        f"host_firewall: {host} has no IP address the firewall can let in: its ansible_host "
        f"({hv.get('ansible_host', host)!r}) is a name and no facts were gathered for it. Set "
        f"sparkple_firewall_address on {host} in the inventory (the address it connects from)."
    )


def host_firewall_sources(
    hosts: Iterable[str], hostvars: Mapping[str, Any], cidrs: Iterable[Any] = ()
) -> dict[str, list[str]]:
    """Every address of hosts plus cidrs, deduplicated: {'v4': [...], 'v6': [...]}, sorted."""
    networks: set[Network] = set()
    for host in dict.fromkeys(hosts):
        networks.update(_network(a, f"{host}'s address") for a in host_addresses(host, hostvars))
    networks.update(_network(c, "an allowed CIDR") for c in cidrs or ())
    out: dict[str, list[str]] = {"v4": [], "v6": []}
    for net in sorted(networks, key=lambda n: (n.version, n)):
        text = str(net.network_address) if net.num_addresses == 1 else str(net)
        out["v4" if net.version == 4 else "v6"].append(text)
    return out


def host_firewall_family(address: Any) -> str:
    """nftables' payload keyword of an address: ip or ip6."""
    return "ip" if _network(address, "an address").version == 4 else "ip6"


def host_firewall_ip(value: Any) -> str:
    """The IP address in value, or "" (the controller's ssh peer, where there is one)."""
    return _address(value) or ""


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "host_firewall_sources": host_firewall_sources,
            "host_firewall_family": host_firewall_family,
            "host_firewall_ip": host_firewall_ip,
        }
