"""The old path of ddpflow.words (counted), for the modules that still import it; remove
once they import ddpflow.words."""

from ddpflow.words import counted

__all__ = ["counted"]
