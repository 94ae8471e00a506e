"""What the stores' clients for event loops share: the async interface
(``base``), one pipelined connection per loop and server (``pipeline``,
``watch``), a take or release carried through a cancel of its caller
(``finishing``), and any store's sync backend on executor threads
(``threaded``) for a store with no client of its own."""
