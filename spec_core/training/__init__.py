"""Reproducible training of the shipped target/draft pair (``ssd train-pair``)."""
