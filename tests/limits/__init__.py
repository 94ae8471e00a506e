"""Rate limits and semaphores."""
