"""A handler that blocks until it is cancelled, for cancellation tests."""

import trio


class BlockingHandler:
    """Registered as a unary handler; ``started`` and ``cancelled`` say what happened."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.cancelled = trio.Event()

    async def __call__(self, arg, ctx):
        self.started.set()
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled.set()
