"""refpar: the reference implementation of parallel training, exact against one device."""

__version__ = "0.1.0"
