"""Transformers from Scratch: the course's shared solution modules.

Each chapter's code lives in one module; later chapters import earlier ones.
"""

__version__ = "0.1.0"
