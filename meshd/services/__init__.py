"""The services: one subpackage per capability, each of one shape (:class:`meshd.service.Service`).

========  ===============================================  ====================
name      what it does                                     library it shells
========  ===============================================  ====================
nat       STUN, AutoNAT, relays, hole punching, NAT-PMP     :mod:`nat`
dht       Kademlia records, providers, peer lookup          :mod:`dht`
crdt      replicated documents                              :mod:`crdt`
shards    model publish and fetch, the bulk lane            (its own format/store)
========  ===============================================  ====================

A service's name is its package, config section, RPC and control-method
prefix, ``meshctl`` group and key in ``meshctl status``.  Services never
import each other: one that needs another declares a Protocol, and
:mod:`meshd.daemon` hands it the instance.
"""
