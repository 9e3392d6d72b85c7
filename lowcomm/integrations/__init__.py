"""Adapters to the stacks users already train with: :mod:`lowcomm.integrations.transformers`
(the Hugging Face Trainer under mpirun). Each imports its framework when imported itself."""
