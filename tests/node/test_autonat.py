"""AutoNAT on loopback: a third peer dials back; the service cannot be aimed elsewhere."""

import pytest
import trio

import meshd


async def test_a_third_peer_dials_back_and_we_are_public(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n:
        await b.connect(a.address)
        await n.connect(a.address)
        with trio.fail_after(30):
            assert await n.service("nat").autonat.check() == "public"
        assert n.service("nat").autonat.via == str(b.peer_id)
        # the dial-back connection is a connection like any other: both ends keep it, so a
        # call n makes to b on it right away is not cut off by a probe that is "done"
        assert b.live(n.peer_id) is not None and n.live(b.peer_id) is not None
        assert await n.rpc.call(b.peer_id, "ping", "after the dial-back") == "after the dial-back"
        assert n.service("nat").autonat.address == str(n.listen_address)
        status = n.service("nat").nat_status()
        assert status["reachability"] == "public"
        # A serves one request per peer per interval
        with pytest.raises(meshd.ResourceExhausted):
            await n.rpc.call(a.peer_id, "autonat.request", None)


async def test_without_a_third_peer_the_answer_stays_unknown(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n:
        await n.connect(a.address)
        with pytest.raises(meshd.NotFound, match="no third peer"):
            await n.rpc.call(a.peer_id, "autonat.request", None)
        assert n.service("nat").autonat.status == "unknown"


async def test_dial_back_refuses_a_peer_it_already_talks_to(tmp_path):
    async with meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n:
        await n.connect(b.address)
        with pytest.raises(meshd.ResourceExhausted, match="already connected"):
            await n.rpc.call(b.peer_id, "autonat.dial_back",
                             {"peer": str(n.peer_id), "addr": str(n.listen_address)})
        with pytest.raises(meshd.InvalidArgument):
            await n.rpc.call(b.peer_id, "autonat.dial_back", {"peer": "x", "addr": "y"})
