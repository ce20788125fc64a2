"""The one error the data phase raises for the user's data, apart so that every data module can raise it."""


class DataError(ValueError):
    """A problem with the user's data, phrased as one line naming the field and the fix."""
