"""Sharded data parallelism: the ranks split the optimizer state, the gradients or the parameters.

ZeRO stages 1 and 2 with ZeRO++'s collectives (:mod:`.zero`, Rajbhandari et al. 2020; Wang et
al. 2023), and ZeRO-3 through torch's FSDP2 (:mod:`.fsdp`).
"""
