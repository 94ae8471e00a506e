"""The suite's own machinery: its servers, processes and scheduling."""
