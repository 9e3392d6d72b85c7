"""Where the parameter server used to live: :class:`ParameterServer` is now in
:mod:`lowcomm.strategies.ps.server` (re-exported here for existing imports)."""
from .ps.server import ParameterServer

__all__ = ["ParameterServer"]
