"""Client library and the generate / bench commands."""
