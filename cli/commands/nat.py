"""``meshctl`` commands of the NAT service: reachability, relays, hole punching."""

from __future__ import annotations

import argparse

import meshd

from ..common import command_adder, console, rich_table


async def cmd_nat(client: meshd.Client, args) -> object:
    if args.stun:
        await client.stun(args.stun)
    result = await client.nat(discover=args.discover, autonat=args.autonat)

    def show() -> None:
        table = rich_table(show_header=False, box=None)
        table.add_row("listen", result["listen"])
        for server, mapped in result["reflexive"].items():
            table.add_row(f"reflexive via {server}", mapped)
        if not result["reflexive"]:
            table.add_row("reflexive", "- (no STUN server asked yet: meshctl nat --stun HOST:PORT)")
        table.add_row("mapping", result["mapping"] or "- (meshctl nat --discover)")
        pm = result["port_mapping"]
        table.add_row("port mapping", f"{pm['external']} via {pm['gateway']} ({pm.get('protocol', '?')}, "
                      f"{pm['lifetime']} s)" if pm else "none")
        if result["port_preserved"] is not None:
            table.add_row("port preserved", "yes" if result["port_preserved"] else "no")
        reach = result["reachability"]
        if result["reachability_via"]:
            reach += f" ({result['reachability_address']} dialed by {result['reachability_via'][:10]}...)"
        table.add_row("reachability", reach)
        table.add_row("filtering", result["filtering"] or "- (meshctl nat --autonat)")
        hairpin = result["hairpinning"]
        table.add_row("hairpinning", "-" if hairpin is None else ("yes" if hairpin else "no"))
        for relay, left in result["relay_reservations"].items():
            table.add_row(f"relay reservation at {relay[:10]}...", f"{left} s left")
        table.add_row("host candidates", ", ".join(result["host_candidates"]) or "-")
        lan = result["lan_discovery"]
        table.add_row("LAN discovery", lan if isinstance(lan, str) else
                      f"on {', '.join(lan['interfaces'])}: {lan['peers_heard']} peers heard" if lan["interfaces"]
                      else "on; no private-network interface to beacon on")
        table.add_row("STUN requests answered", str(result["stun_answered"]))
        console().print(table)

    return result, show


async def cmd_relay(client: meshd.Client, args) -> object:
    result = await client.relay(reserve=args.reserve)

    def show() -> None:
        table = rich_table(show_header=False, box=None)
        table.add_row("relaying for others", "on" if result["enabled"] else "off (\\[relay] enabled)")
        for peer, held in result["serving"].items():
            table.add_row(f"serving {peer[:10]}...", f"{held['circuits']} circuits, {held['expires_in']} s left")
        for peer, left in result["reserved_at"].items():
            table.add_row(f"reserved at {peer[:10]}...", f"{left} s left")
        console().print(table)

    return result, show


async def cmd_punch(client: meshd.Client, args) -> object:
    result = {"peer_id": args.peer, "punched": await client.punch(args.peer)}
    text = "direct path punched to" if result["punched"] else "hole punching failed; still relayed to"
    return result, lambda: console().print(f"{text} {args.peer}", highlight=False)


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """The NAT service's commands (top-level, as they always were): nat, relay, punch."""
    add = command_adder(sub, common)
    add("punch", cmd_punch, "try a direct path to a peer reached through a relay").add_argument("peer")
    p = add("relay", cmd_relay, "relay reservations: held here and ours elsewhere")
    p.add_argument("--reserve", metavar="RELAY", help="reserve a slot at this relay first")
    p = add("nat", cmd_nat, "reflexive addresses (STUN) and NAT facts")
    p.add_argument("--stun", metavar="HOST:PORT", help="ask this STUN server (any meshd port works) first")
    p.add_argument("--discover", action="store_true",
                   help="ask the configured STUN servers and all connected peers, classify the mapping")
    p.add_argument("--autonat", action="store_true",
                   help="have a peer arrange a dial-back from a third peer: are we reachable?")
