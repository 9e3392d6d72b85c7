"""Outer loops: local steps, then the ranks (or the units of a level) synchronise their progress.

The schedule every outer method shares is :mod:`.loop` (:class:`~.loop.OuterLoop`), a fragment
of the model with its in-flight reduction is :mod:`.fragment`, where the average goes is
:mod:`.route` and where the loop sits in a per-level policy is :mod:`.nesting`. The methods:
Local SGD (:mod:`.localsgd`), DiLoCo, streaming DiLoCo and MuLoCo (:mod:`.diloco`), SparseLoCo
(:mod:`.sparseloco`), SPARTA (:mod:`.sparta`), DES-LOC (:mod:`.desloc`), DiLoCo with dynamic
local updates (:mod:`.dylu`) and asynchronous DiLoCo across a fleet (:mod:`.async_diloco`).
"""
