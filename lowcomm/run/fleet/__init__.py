"""A fleet of datacenters: one MPI job per datacenter, the outer level of the method across
them through a coordinator, a failed datacenter relaunched and healed back in live
(``lowcomm train --dcs D --np N``, :func:`lowcomm.train_fleet`).

The pieces, from the outside in:

* :mod:`~lowcomm.run.fleet.plan`: the run in the form a fleet runs it, decided once — the outer
  method on the ``dc`` level of a per-level policy, the topology parsed once
  (:class:`~lowcomm.run.fleet.plan.FleetPlan`) — and a job's place in the fleet, from the
  environment the supervisor gives it (:data:`~lowcomm.run.fleet.plan.ENV`);
* :mod:`~lowcomm.run.fleet.supervisor`: the process that runs the fleet
  (:class:`~lowcomm.run.fleet.supervisor.Fleet`): starts the coordinator and each datacenter's
  job, relaunches a failed one, falls back to checkpoints when the coordinator is lost, and
  stops every datacenter at the same round on a signal;
* :mod:`~lowcomm.run.fleet.folder` and :mod:`~lowcomm.run.fleet.report`: the fleet's run
  folder (its lock, its marker, what ``--overwrite`` may remove) and what it leaves there
  (``summary.json`` with the membership, failures, heals and goodput; ``metrics.jsonl``);
* :mod:`~lowcomm.run.fleet.coordinator`: a small process holding the ``TCPStore`` the
  datacenters' leaders talk through, moving their messages to and from
  :mod:`~lowcomm.run.fleet.membership`, the state machine of the datacenters (a table of state
  × message: who is active, dead, fenced, admitted; heartbeats and the quorum) and its policy,
  :mod:`~lowcomm.run.fleet.rounds` (who takes part in each round, when it commits or goes again,
  when the fleet halts) — no I/O, tested without a process;
* :mod:`~lowcomm.run.fleet.server`: under asynchronous DiLoCo (``diloco-async``) there are no
  rounds: the coordinator holds the outer state and applies each datacenter's pseudo-gradient
  as it arrives (:class:`~lowcomm.run.fleet.server.ArrivalServer`,
  :meth:`Channel.arrive <lowcomm.run.fleet.channel.Channel.arrive>`); the membership's policy
  is then :mod:`~lowcomm.run.fleet.arrivals`, which answers each arrival at once and only the
  last ones together;
* :mod:`~lowcomm.run.fleet.channel`: a datacenter's side of the rounds
  (:class:`~lowcomm.run.fleet.channel.Channel` on its leader, rank 0; in
  :mod:`~lowcomm.run.fleet.ranks`, :class:`~lowcomm.run.fleet.ranks.RankChannel` for rank i of
  every datacenter when the outer state is sharded and :class:`~lowcomm.run.fleet.ranks.Span`
  for every rank at once), the
  reductions over a group of the round's members (TLS 1.3 by default,
  :class:`~lowcomm.comm.tls.TlsComm`; or gloo, :class:`~lowcomm.comm.gloo.GlooComm`);
* :mod:`~lowcomm.run.fleet.member`: one datacenter's job, the one training loop
  (:mod:`lowcomm.run.loop`) with the channel as the ``dc`` level's peers
  (:class:`~lowcomm.run.fleet.member.FleetLevels`) and a coordination that joins, admits and
  halts at round boundaries (:class:`~lowcomm.run.fleet.member.FleetLockstep`, over the
  loop's :class:`~lowcomm.run.lockstep.Lockstep`).

Where the jobs run (this machine, the emulated WAN's namespaces, or hostfiles) is the launcher's
business, :mod:`lowcomm.tools.fleet_launch`: it builds on the WAN emulator and the tools'
``mpirun`` command, a layer above this one.

How a round flows (:meth:`Channel.round_of <lowcomm.run.fleet.channel.Channel.round_of>`, the
one round loop every kind of round runs through: an average of pseudo-gradients, an admission,
a relaunched datacenter's join, a sharded average's leader):

1. at its synchronisation step the outer method of each datacenter's leader hands the channel
   its pseudo-gradient and says ``ready`` with the round's tag
   (:class:`~lowcomm.comm.round_tag.RoundTag`, ``t40.f0``: fragment 0 at step 40), the same on
   every member;
2. the membership decides the round once every active datacenter is ready or found dead
   (its job ended, or silent past the limit) while a quorum (``fleet.min_dcs``) remains, and
   names the members and a group for this attempt;
3. the members all-reduce over that group (lowcomm's ring, tree or Rabenseifner, in the same
   order as over MPI: with no failure a fleet gives one MPI job's parameters, bit for bit) and
   each reports ``done``, with whether its reduction completed;
4. the membership commits the attempt only when every member's did; otherwise the round goes
   again without the member that failed, from the same contributions (no inner step lost, no
   partial sum applied);
5. the committed decision says whether a datacenter waits to be admitted (the members then hold
   an admission round at this boundary, in which the donor sends it the live state) and
   whether the fleet halts (every member stops at this boundary and writes its checkpoint).

A fenced member, a lost coordinator and the run's end raise
:class:`~lowcomm.run.fleet.store.FleetError` naming the rank and the op: never a hang.
"""
