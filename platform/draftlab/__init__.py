"""draftlab: speculative decoding with parallel drafters on Ray."""

__version__ = "0.1.0"
