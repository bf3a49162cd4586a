"""dflash-batch: offline batch generation with DFlash speculative decoding."""

__version__ = "0.1.0"


def generate(*args, **kwargs):
    """dflash_batch.api.generate: run a job over rows held in memory (imported on first use)."""
    from dflash_batch.api import generate as run

    return run(*args, **kwargs)
