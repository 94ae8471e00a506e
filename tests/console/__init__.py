"""The command, the lock console, metrics and logs."""
