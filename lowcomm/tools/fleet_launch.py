"""Where a fleet's jobs run (:mod:`lowcomm.run.fleet`): how each datacenter's MPI job and the
coordinator are launched, and how the leaders reach the coordinator and each other.

* :func:`local`: every datacenter's job on this machine (mpirun with this machine's flags), the
  coordinator on loopback; gloo over ``lo``. For tests and trying things out.
* :func:`emulated_wan`: on the emulated WAN that is up (``lowcomm wan up --dcs D``,
  :mod:`lowcomm.tools.wan`): datacenter i's job inside namespace ``lowcomm-dc<i>`` (its own
  hostname, shared memory inside), gloo on its WAN device ``lcwan<i>``, the coordinator in
  datacenter 0's namespace at ``10.77.0.1`` — so a link taken down with ``lowcomm wan fault``
  cuts a datacenter off from the coordinator and the others, as on real links.
* :func:`hostfiles`: real machines: datacenter i's job is ``mpirun --hostfile FILE_i`` (with
  the fleet's variables passed on with ``-x``), the coordinator on this machine at ``host``
  (an address every datacenter reaches); ``GLOO_SOCKET_IFNAME`` is passed on when set.

Each returns ``(launch, coordinator_prefix, host, env)`` for :class:`~lowcomm.run.fleet.Fleet`.
Every mpirun gets ``--mca odls_base_sigkill_timeout 0``: when one of its ranks is killed, Open
MPI otherwise waits a second per signal to the others and exits about 2 s later (measured
here); a fleet's job is torn down at once, so the coordinator hears of the failure in
milliseconds.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from ..run.member import ENV
from .compare import mpirun_command

#: tear a job down at once when one of its ranks dies (module docstring)
TEAR_DOWN = ["--mca", "odls_base_sigkill_timeout", "0"]


def local(launcher=None):
    """Every datacenter on this machine (module docstring)."""
    return (lambda dc, n: mpirun_command(n, launcher) + ([] if launcher else TEAR_DOWN)), [], \
        "127.0.0.1", \
        (lambda dc: {"GLOO_SOCKET_IFNAME": "lo"})


def emulated_wan(dcs: int):
    """The datacenters in the namespaces of the emulated WAN that is up (module docstring)."""
    from .wan import DEV_PREFIX, WanError, address, namespace, state
    s = state()
    if s is None or s["dcs"] != dcs:
        raise WanError(f"a fleet of {dcs} datacenters on the emulated WAN needs 'lowcomm wan up "
                       f"--dcs {dcs}' first" + (f" (the WAN that is up has {s['dcs']})" if s else ""))

    def launch(dc: int, n: int) -> list[str]:
        ns = namespace(dc)
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "/bin/sh", "-c",
                f'hostname {ns}; exec "$@"', "sh", *mpirun_command(n, None), *TEAR_DOWN,
                "--mca", "btl", "self,vader"]

    return launch, ["ip", "netns", "exec", namespace(0)], address(0), \
        (lambda dc: {"GLOO_SOCKET_IFNAME": f"{DEV_PREFIX}{dc}"})


def hostfiles(files: list[str], host: str | None = None):
    """Datacenter i on the machines of ``files[i]`` (module docstring)."""
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"--hostfiles: {f} is not a file")
    passed = [*ENV, "GLOO_SOCKET_IFNAME"] if os.environ.get("GLOO_SOCKET_IFNAME") else list(ENV)

    def launch(dc: int, n: int) -> list[str]:
        cmd = [*mpirun_command(n, None), *TEAR_DOWN, "--hostfile", files[dc]]
        for name in passed:
            cmd += ["-x", name]
        return cmd

    return launch, [], host or socket.gethostbyname(socket.gethostname()), (lambda dc: {})


__all__ = ["emulated_wan", "hostfiles", "local"]
