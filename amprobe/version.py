"""amprobe's version, in a leaf module the store can read without importing the package."""

__version__ = "0.1.0"
