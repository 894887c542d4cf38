"""Shim package."""
