"""Running a training job: the config, the registry of methods, the one training loop, the run
folder, checkpoints, signals and the supervisor. Built on :mod:`lowcomm.strategies`; nothing
below this layer imports it."""
