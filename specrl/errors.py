"""The one exception type specrl raises for bad user input.

`SpecRLError` subclasses ValueError so callers that catch ValueError keep working; its message always says
what was wrong and what would be right.
"""


class SpecRLError(ValueError):
    """Bad input: the message names what was wrong and what would be right."""
