"""The one exception type of the data layer.

Role: every user-fixable problem in `phalanx.data` (bad input file, wrong option, corrupt token
file, impossible sampler settings) is raised as `DataError` with a message that names the thing
at fault, its value, and the fix. Callers (the CLI, the trainer) catch this single type.

Must not know about: anything else; it is a leaf module.
"""

from __future__ import annotations


class DataError(ValueError):
    """A data problem the user can fix; the message says what is wrong and how to fix it."""
