"""memfit: fine-tune transformers under a GPU memory budget."""

__version__ = "0.1.0"
