"""The one error the data layer raises for anything a user can get wrong (a missing file, a corrupt
index, a JSON line without the text key, a split too small for the sequence length)."""


class DataError(ValueError):
    """Bad data input: the message names the file (and line) at fault and what to do."""
