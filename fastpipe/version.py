"""The package version (one place: the package, the info report and the wheel agree)."""

__version__ = "0.1.0"
