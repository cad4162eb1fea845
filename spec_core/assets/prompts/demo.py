import os


def walk_python_files(root):
    """Yield the path of every .py file under root, skipping hidden folders."""
