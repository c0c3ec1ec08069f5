"""Placeholder package: filled in by the backend issues."""
