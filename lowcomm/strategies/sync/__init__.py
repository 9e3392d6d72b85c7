"""Synchronous data parallelism: every step, the ranks' gradients are averaged.

``syncdp`` (:mod:`.syncdp`) on lowcomm's own collectives through the bucketed, overlapped
:mod:`.reducer` (torch DDP's semantics), and ``horovod`` (:mod:`.horovod`) on Horovod's.
"""
