"""The asynchronous parameter server's parts: :mod:`.protocol` (what worker and server agree on),
:mod:`.worker` (:class:`~.worker.Worker`, a training rank's part) and :mod:`.server`
(:class:`~.server.ParameterServer`, a serving rank's part). Worker and server depend on the
protocol only, never on each other; the strategy that holds either part, and its registry entry,
is :mod:`lowcomm.strategies.async_ps`, which imports this folder (never the other way round)."""
