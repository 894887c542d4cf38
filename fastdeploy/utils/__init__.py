"""Small helpers shared by the entrypoints (argument parsing, networking)."""
