"""Test-wide settings: never reach a model or dataset hub, never open a plot window."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("MPLBACKEND", "Agg")
