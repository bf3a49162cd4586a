"""dflash-batch: offline batch generation with DFlash speculative decoding."""

__version__ = "0.1.0"
