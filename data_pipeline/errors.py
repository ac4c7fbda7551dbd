"""Errors about the user's data that the CLI reports as one clear line (no traceback)."""


class DataError(ValueError):
    """A source, tokenizer or prepared data set is missing, malformed or does not match the config."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A source path or tokenizer file does not exist."""


class MissingColumnError(DataError, KeyError):
    """A jsonl/parquet source lacks the configured text field."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])
