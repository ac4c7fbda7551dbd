"""data_pipeline: sources -> tokenizer -> token shards -> packed, blended, resumable batches.

The errors and the tokenizer are imported here; the rest on first use (PEP 562): dataset.py and sampler.py import
torch (~2 s of CPU on a 2-core VM), prepare.py and shards.py numpy, and what the command line needs before any work
(the errors it reports, the data directory's name in data_dir.py) needs none of them.
"""

from hybridtron.data_pipeline.errors import (
    BadRecordError,
    DataError,
    EmptySourceError,
    RemoteSourceError,
    SourceChangedError,
    TooManyBadRecordsError,
    UnreadableFileError,
)
from hybridtron.data_pipeline.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BadRecordError",
    "BlendedDataset",
    "DataError",
    "DataLoaderState",
    "DistributedLoader",
    "EmptySourceError",
    "PackedDataset",
    "PreparedData",
    "RemoteSourceError",
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


def __getattr__(name: str):
    if name in ("BlendedDataset", "PackedDataset", "build_dataset"):
        from hybridtron.data_pipeline import dataset as module
    elif name in ("PreparedData", "prepare_data"):
        from hybridtron.data_pipeline import prepare as module
    elif name in ("DataLoaderState", "DistributedLoader", "build_loader"):
        from hybridtron.data_pipeline import sampler as module
    elif name == "ShardError":
        from hybridtron.data_pipeline import shards as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
