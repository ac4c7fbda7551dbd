"""Errors about the user's data that the CLI reports as one clear line (no traceback).

Every message names the file (and line or row where there is one) and says what to do.
"""


class DataError(ValueError):
    """A source, tokenizer or prepared data set is missing, malformed or does not match the config."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A source path or tokenizer file does not exist."""


class MissingColumnError(DataError, KeyError):
    """A jsonl/parquet source lacks the configured text field."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class BadRecordError(DataError):
    """A record (file, jsonl line, parquet row) is unusable and ``data.on_bad_record`` is ``error``."""


class TooManyBadRecordsError(DataError):
    """More than ``data.max_malformed_fraction`` of a source's records are malformed."""


class EmptySourceError(DataError):
    """A source (or every source, for the tokenizer) yields no document to train on."""


class SourceChangedError(DataError):
    """A source file changed after its shards were prepared (``data.on_source_change: error``)."""


class DataDirBusy(DataError):
    """Another process is preparing (writing) this data directory (data_lock.py)."""


class UnreadableFileError(DataError):
    """A source file cannot be read at all, or changed while it was being read."""


class RemoteSourceError(DataError):
    """A source URL cannot be listed or read (unreachable, not found, access denied, no package for its protocol)."""


def one_line(s: object) -> str:
    """``s`` as text without line breaks, so a message stays one line whatever a file name or record holds."""
    return str(s).replace("\r", "\\r").replace("\n", "\\n")
