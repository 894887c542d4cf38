"""FastDeploy's version."""

__version__ = "2.0.0.dev0"
