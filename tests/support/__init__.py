"""Helpers the test directories share (real processes, never fakes)."""
