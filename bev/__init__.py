"""Lift-Splat bird's-eye-view perception training pipeline."""
__version__ = "0.1.0"
