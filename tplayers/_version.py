"""The package version (a leaf module every floor may import)."""
__version__ = "0.1.0"
