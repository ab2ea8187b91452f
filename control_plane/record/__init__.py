"""Record a scheduler session, replay it, and read it as a timeline (DESIGN.md, "Record and replay")."""
