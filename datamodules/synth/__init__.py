"""Offline generators that make every recipe runnable on a fresh machine with no download."""
