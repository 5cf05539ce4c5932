"""localrun: a local desktop inference runtime."""

__version__ = "0.1.0"
