"""What a failed fetch raises."""


class FetchError(Exception):
    """A model could not be fetched (the message says why)."""
