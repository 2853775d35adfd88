"""The errors a user can fix: the base class that rule scripts report without a traceback.

Every subclass's message names the key, file or rank at fault and the fix. Anything that is
not a UserError is a bug (or an environment failure) and keeps its full traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user fixes in the config, the data, the cluster request or the inputs."""


class ReportInputError(UserError, ValueError):
    """A run's metrics file is missing, unreadable or malformed (names the file and key)."""


class DataError(UserError):
    """A dataset problem the user can fix; the message names the file or key and the fix."""


class TaskError(UserError):
    """A task that cannot run: an unknown name, bad task_kwargs, a plug-in's broken return."""
