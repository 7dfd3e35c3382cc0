"""The version of estimatorch (lowest layer: the checkpoint format records it)."""

__version__ = "0.1.0"
