"""frtools: the flight recorder and crash investigator for distributed PyTorch."""

__version__ = "0.1.0"
