"""Runnable examples (importable as packages so the tests run them as they are)."""
