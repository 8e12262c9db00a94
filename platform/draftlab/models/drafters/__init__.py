"""Drafter families (one per file) behind a registry (`registry.py`, a leaf); the network they
share (`network.py`); building and loading them (`build.py`)."""
