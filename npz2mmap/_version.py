"""The package's version, apart from its public face so inner modules need not import it."""

__version__ = "0.3.0"
