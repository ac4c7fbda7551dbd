"""data_pipeline: sources -> tokenizer -> token shards -> packed, blended, resumable batches."""

from .dataset import BlendedDataset, PackedDataset, build_dataset
from .errors import (
    BadRecordError,
    DataError,
    EmptySourceError,
    SourceChangedError,
    TooManyBadRecordsError,
    UnreadableFileError,
)
from .prepare import PreparedData, prepare_data
from .sampler import DataLoaderState, DistributedLoader, build_loader
from .shards import ShardError
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BadRecordError",
    "BlendedDataset",
    "DataError",
    "DataLoaderState",
    "DistributedLoader",
    "EmptySourceError",
    "PackedDataset",
    "PreparedData",
    "ShardError",
    "SourceChangedError",
    "Tokenizer",
    "TooManyBadRecordsError",
    "UnreadableFileError",
    "build_dataset",
    "build_loader",
    "load_tokenizer",
    "prepare_data",
]
