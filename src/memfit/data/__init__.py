"""Data: read the user's records, tokenize them under the policy's lengths, audit the lengths, collate batches."""

from memfit.data.collate import LABEL_PAD, CountingCollator, model_columns
from memfit.data.error import DataError
from memfit.data.sources import load_pairs
from memfit.data.tokenize import PreparedData, TokenizeSpec, load_and_tokenize

__all__ = [
    "LABEL_PAD",
    "CountingCollator",
    "DataError",
    "PreparedData",
    "TokenizeSpec",
    "load_and_tokenize",
    "load_pairs",
    "model_columns",
]
