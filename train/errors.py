"""The errors a command reports in one line with its own exit code (cli.py): defined apart from the modules that
raise them, which import torch, so that the command line can name them before it imports any of those."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model being trained."""


class DiskFullError(CheckpointError):
    """No space left on the device while writing a checkpoint; nothing of it was kept."""


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stops before writing a checkpoint."""
