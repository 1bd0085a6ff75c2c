"""The error every model loader raises for a model the user named but rayspec cannot load."""


class ModelLoadError(RuntimeError):
    """A model name or directory that is missing, incomplete, corrupt (a checksum mismatch) or of another kind;
    its message is one line naming what is missing (the CLI prints it as ``rayspec: error: ...``, exit status 2)."""


class ModelPairingError(ModelLoadError, ValueError):
    """A drafter that does not fit its target (another tokenizer: prompt ids, EOS or vocabulary size; another
    width); the message says what differs."""
