"""Record a scheduler session, replay it, and read it as a timeline (docs/debugging.md)."""
