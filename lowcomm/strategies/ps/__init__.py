"""Asynchronous parameter servers: sharded servers, bounded staleness, stragglers and lost workers.

The strategy and its registry entry are :mod:`.async_ps` (:class:`~.async_ps.AsyncPS`); its parts
are :mod:`.protocol` (what worker and server agree on), :mod:`.worker` (:class:`~.worker.Worker`,
a training rank's part) and :mod:`.server` (:class:`~.server.ParameterServer`, a serving rank's
part). Worker and server depend on the protocol only, never on each other.
"""
