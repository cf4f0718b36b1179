"""Adapters to the libraries we run on (not stages, not facts): pyinfra speedups behind a version gate."""
