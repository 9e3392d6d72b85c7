"""The asynchronous parameter server: :mod:`.protocol` (what worker and server agree on),
:mod:`.worker` (:class:`AsyncPS`, the worker's strategy) and :mod:`.server`
(:class:`ParameterServer`, which serves and is not a strategy). Worker and server depend on the
protocol only, never on each other."""
