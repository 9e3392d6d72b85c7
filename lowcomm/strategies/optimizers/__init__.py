"""Communication-efficient optimizers: what is exchanged is part of the optimizer's own update.

1-bit Adam (:mod:`.onebit_adam`), 0/1 Adam (:mod:`.zeroone_adam`), and DeMo / DisTrO's decoupled
momentum (:mod:`.demo`).
"""
