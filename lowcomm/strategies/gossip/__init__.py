"""Decentralised averaging without an all-reduce: each rank mixes with a few peers.

Gossip SGD over a peer graph (:mod:`.gossip`, :mod:`.graphs`) and NoLoCo's outer step with one
random peer (:mod:`.noloco`).
"""
