"""Adapters to the stacks users already train with, for runs launched with ``mpirun``:
:mod:`lowcomm.integrations.transformers` (the Hugging Face Trainer),
:mod:`lowcomm.integrations.accelerate` (an ``accelerate.Accelerator``) and
:mod:`lowcomm.integrations.lightning` (a PyTorch Lightning strategy); what they share is in
:mod:`lowcomm.integrations.launcher`. Each imports its framework when imported itself."""
