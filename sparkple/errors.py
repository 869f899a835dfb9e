"""Exceptions shared across sparkple; each says what is wrong and what to do."""

# Exit codes of the sparkple commands: done, a check found a problem, bad usage or input.
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2


class SparkpleError(Exception):
    """Base class for every error sparkple raises on purpose."""


class CheckpointError(SparkpleError):
    """A HF snapshot or safetensors file is missing, malformed or inconsistent."""


class BuildError(SparkpleError):
    """The packed table could not be built or does not match its source."""


class TableError(SparkpleError):
    """A published packed table is missing, inconsistent, or not what the caller expects."""


class ReleaseError(SparkpleError):
    """The nodes of a pair run different releases (release id or patch manifest)."""


class PatchError(SparkpleError):
    """A vLLM patch profile cannot be rendered or applied as asked."""


class HandshakeError(SparkpleError):
    """The host-side gather/forward handshake broke its protocol."""


class HandshakeTimeout(HandshakeError):
    """The waiter gave up on a sequence number the producer never published."""

    def __init__(self, seq: int, flag: int, elapsed_s: float) -> None:
        super().__init__(
            f"waited {elapsed_s:.3f} s for seq {seq}, flag still {flag}: "
            "the gather worker is stuck or too slow; raise the timeout or check the table's disk"
        )
        self.seq = seq
        self.flag = flag
        self.elapsed_s = elapsed_s


class ProducerDied(HandshakeError):
    """The producer process or thread is gone while a waiter still expects a sequence number."""
