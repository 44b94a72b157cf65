"""The errors the ``meshtrain`` command turns into one line (besides ``config.ConfigError``, the config's own).

They live here, apart from the torch-using modules that raise them (``comm``, ``train.checkpoint``,
``train.trainer``), so that the command line can catch them without importing torch: a mistake in the options
answers in a fraction of a second, and ``meshtrain plan`` runs without torch at all."""


class CommError(RuntimeError):
    """A collective failed: a peer died or closed its connection. The message names the collective (group, op,
    sequence number, shape) and the ranks that did not arrive."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the file and the fix in the message."""


class NonFiniteError(RuntimeError):
    """The run stopped rather than apply or save non-finite values (train.max_bad_steps, or state at a save)."""
